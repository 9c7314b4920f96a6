"""The trace replay (`multiwrite.replay`) on the GPU backend: zero mismatches against the reference."""

from __future__ import annotations

import pytest

from multiwrite.replay import run_replay
from multiwrite.workload import CONFIGS, load_trace

from .gpu_helpers import gpu_backend


@pytest.mark.parametrize("concurrency", [40, 256])
@pytest.mark.parametrize("config", ["G1", "G3"])
def test_replay_has_zero_mismatches(device, backend_name, config, concurrency):
    block_sizes, kernel_block_sizes = CONFIGS[config]
    backend = gpu_backend(backend_name)  # default ring depth and launcher, as a user gets them
    result = run_replay(load_trace(), block_sizes, kernel_block_sizes, concurrency, 1000, device, backend=backend)
    assert result.steps > 0 and result.writes > 0 and result.checks >= 1
    assert result.mismatches == 0
