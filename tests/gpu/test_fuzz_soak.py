"""The differential fuzz and the soak of issue 8 on the GPU backend.

They use the shared harnesses `tests/fuzz_util.py` and `tests/soak_util.py` when present (`tests/` is on
`sys.path` under pytest); without `fuzz_util`, a fuzz of this file's own against the reference runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .gpu_helpers import RandomBlockTables, RandomTensors, gpu_backend, warm_up

BATCHES = 2_000
SEED = 20240808


def _own_fuzz(device, backend, batches: int, seed: int) -> None:
    """Random BlockTables steps (appends, overwrites, overlapping writes, staged-then-cleared appends) and
    fused StagedWriteTensor applies, compared with the reference every 100 batches, no sync in between."""
    rng = np.random.default_rng(seed)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    for batch in range(1, batches + 1):
        pick = rng.random()
        if pick < 0.15:  # stage, drop, stage again: only the second lands
            r = int(rng.integers(0, rb.reqs))
            if rb.ref.num_blocks[0, r] < rb.widths[0]:
                rb.bt.append_block_ids(r, ([int(rng.integers(1, 1000))], [], []), overwrite=False)
            rb.bt.clear_staged_writes()
            rb.step()
        elif pick < 0.6:
            rb.step()
        else:
            rt.step()
        if batch % 100 == 0:
            torch.cuda.synchronize(device)
            assert (rb.mismatches(), rt.mismatches()) == (0, 0), f"seed {seed}, batch {batch}"


def test_differential_fuzz(device, backend_name):
    try:
        from fuzz_util import run_fuzz
    except ImportError:
        backend = gpu_backend(backend_name, ring_depth=2)
        warm_up(device, backend)
        _own_fuzz(device, backend, BATCHES, SEED)
    else:
        stats = run_fuzz(backend_name, device, BATCHES, SEED)
        assert all(count > 0 for count in stats.values()), stats


def test_soak_resources_stay_flat(device, backend_name):
    soak_util = pytest.importorskip("soak_util", reason="tests/soak_util.py (the shared soak harness) is absent")
    from multiwrite.dispatch import select_backend

    growth = soak_util.soak(
        backend_name, device, 20_000, memory=lambda: torch.cuda.memory_allocated(device) + soak_util.rss_bytes()
    )
    assert growth["finalizers"] <= 4, growth
    writer = select_backend(device, backend_name).writer(device)
    assert len(writer._descs) <= writer.DESCRIPTOR_CACHE_SIZE
    assert len(writer._retiring) <= 8  # rings of dead arenas are released once idle
