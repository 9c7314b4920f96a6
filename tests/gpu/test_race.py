"""The ring race: many applies, two slots per ring, no host synchronization, the stream held busy."""

from __future__ import annotations

import numpy as np
import torch

from .gpu_helpers import RandomBlockTables, RandomTensors, busy, gpu_backend, warm_up


def test_ten_thousand_applies_racing_a_busy_stream(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(1234)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    busy(0.5)
    for it in range(10_000):
        if it % 1000 == 999:
            busy(0.05)  # fall behind again, so the host has to wait for slots
        rb.step()
        if it % 3 == 0:
            rt.step()
    torch.cuda.synchronize(device)
    assert (rb.mismatches(), rt.mismatches()) == (0, 0)
    assert backend.writer(device).waits > 0  # the host did wait for slots: the guard was exercised
