"""The shipped conformance kit and the trace replay (`multiwrite.replay`) on the GPU: every property passes for
torch-generic forced on CUDA and for the GPU backend; the replay of the real trace has zero mismatches."""

from __future__ import annotations

import pytest
import torch

from multiwrite.replay import run_replay
from multiwrite.testing import run_kit
from multiwrite.workload import CONFIGS, load_trace


@pytest.mark.parametrize("name", ["torch-generic", "triton"])
def test_the_kit_passes_on_cuda(name, backend_name):
    name = backend_name if name == "triton" else name
    code, results, output = run_kit(name, "cuda", examples=100)
    failed = [r.first_failure for r in results if r.failed]
    assert code == 0 and results and not failed, "\n".join(failed) or output[-4000:]


@pytest.mark.parametrize("concurrency", [40, 256])
@pytest.mark.parametrize("config", ["G1", "G3"])
def test_the_trace_replay_has_zero_mismatches(device, backend_name, config, concurrency):
    block_sizes, kernel_block_sizes = CONFIGS[config]
    result = run_replay(load_trace(), block_sizes, kernel_block_sizes, concurrency, 1000, device, backend=backend_name)
    assert result.steps > 0 and result.writes > 0 and result.checks >= 1
    assert result.mismatches == 0
    assert torch.cuda.current_device() == device.index
