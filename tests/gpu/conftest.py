"""Tests that need a real GPU: every test under this directory gets the `gpu` marker and is skipped, with its reason,
where torch sees no GPU. On a GPU machine: `pytest tests/gpu` (or `tox -e cuda` / `tox -e rocm`, which run the whole
suite with the GPU backend forced). The directory is a package, so that this conftest applies to it alone.
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
    """The current CUDA (or ROCm) device, with its index."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def backend_name() -> str:
    """The GPU backend of this build of torch: triton-rocm on HIP builds, else triton-cuda."""
    return "triton-rocm" if torch.version.hip else "triton-cuda"
