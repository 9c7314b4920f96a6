"""The conformance kit on a real GPU: torch-generic forced on CUDA, and triton-cuda (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from multiwrite.testing import run_kit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]


@pytest.mark.parametrize("name", ["torch-generic", "triton-cuda"])
def test_kit_passes_on_cuda(name):
    if name == "triton-cuda" and getattr(torch.version, "hip", None):
        name = "triton-rocm"
    code, results, output = run_kit(name, "cuda", examples=100)
    failed = [r.first_failure for r in results if r.failed]
    assert code == 0 and results and not failed, "\n".join(failed) or output[-4000:]
