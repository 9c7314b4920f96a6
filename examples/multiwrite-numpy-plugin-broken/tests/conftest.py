"""Point multiwrite's conformance kit at this package's backend (the kit's fixtures are overridable)."""

import pytest


@pytest.fixture
def multiwrite_backend_name() -> str:
    return "numpy-cpu-broken"
