"""Long runs on the GPU backend: a differential fuzz against the reference (aliasing tables included), many applies
racing a busy stream on two-slot rings, and a soak whose resources must stay flat."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import select_backend
from tests.gpu.helpers import RandomBlockTables, RandomTensors, busy, count_waits, gpu_backend, warm_up
from tests.support.fuzz import run_fuzz
from tests.support.soak import rss_bytes, soak


@pytest.mark.parametrize("engine_args", [False, True], ids=["plain", "engine arguments"])
def test_a_differential_fuzz_equals_the_reference(device, backend_name, engine_args):
    """2,000 random batches on the GPU backend against the reference (`tests.support.fuzz.run_fuzz`); with the engine's
    apply arguments, two tables over one memory: on a GPU a round's writes run in parallel, so a wrong round
    grouping of aliasing tables shows here (the interpreter runs programs in order and cannot show it)."""
    stats = run_fuzz(backend_name, device, 2_000, 20240808, engine_args=engine_args)
    assert all(count > 0 for count in stats.values()), stats


def test_ten_thousand_applies_racing_a_busy_stream(device, backend_name, monkeypatch):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    waits = count_waits(monkeypatch)
    rng = np.random.default_rng(1234)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    busy(0.5)
    for it in range(10_000):
        if it % 1000 == 999:
            busy(0.05)  # fall behind again, so that the host waits for slots
        rb.step()
        if it % 3 == 0:
            rt.step()
    torch.cuda.synchronize(device)
    assert (rb.mismatches(), rt.mismatches()) == (0, 0)
    assert waits, "the host never waited for a slot: the guard was not exercised"


def test_a_soak_of_20000_applies_keeps_resources_flat(device, backend_name):
    """The short variant of the 100,000-apply soak (`tests.support.soak.soak`), with GPU memory counted too; and the
    backend's per-device caches stay within their bounds (white-box: the descriptor cache, the retiring rings)."""
    from multiwrite.backends.triton.device import DESCRIPTOR_CACHE_SIZE  # (here: Triton is not everywhere)

    growth = soak(backend_name, device, 20_000, memory=lambda: torch.cuda.memory_allocated(device) + rss_bytes())
    assert growth["finalizers"] <= 4, growth
    state = select_backend(device, backend_name).device_state(device)
    assert len(state._descs) <= DESCRIPTOR_CACHE_SIZE and len(state._retiring) <= 8, (len(state._descs),
                                                                                      len(state._retiring))  # fmt: skip
