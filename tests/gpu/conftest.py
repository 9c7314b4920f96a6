"""GPU acceptance tests (issue 8, issue 11): every test under tests/gpu gets the `gpu` marker and is skipped,
with its reason, where torch sees no GPU. On a GPU machine run `pytest tests/gpu` (or `tox -e cuda`,
which runs the whole suite with triton-cuda forced). Shared workloads live in `gpu_helpers.py`. The
directory is a package (`__init__.py`), so this conftest does not shadow `tests/conftest.py`, which other
tests import as `conftest`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
_NO_GPU = (
    None if torch.cuda.is_available() else f"no GPU (torch.cuda.is_available() is False; torch {torch.__version__})"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if _NO_GPU:
                item.add_marker(pytest.mark.skip(reason=_NO_GPU))


@pytest.fixture
def device() -> torch.device:
    """The current CUDA device, with its index."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def backend_name() -> str:
    """The GPU backend of this build of torch: triton-rocm on HIP builds, else triton-cuda."""
    return "triton-rocm" if torch.version.hip else "triton-cuda"
