"""Ctrl-C (a `KeyboardInterrupt` from a SIGALRM handler) during an eager apply or `prepare_inputs` whose staging
slot is still read by a kernel queued behind busy work (issue 23, item 1), on two staging slots: after it the
tables hold exactly the batches that landed, what did not land is still staged, and it lands whole later, also
while the next steps stage on under queued kernels. The interrupt comes wherever the delay puts it (the wait
for the slot, the launch, the resolution of an interrupted launch): the assertions hold at every point. The CPU
model of the same faults, point by point: tests/backends/test_triton_interrupts.py."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.gpu.helpers import busy, gpu_backend, warm_up
from tests.support.interrupts import InterruptedTables


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("delay", [0.05, 0.0005, 0.002, 0.01, 0.2, 0.29])
@pytest.mark.parametrize("how", ["apply", "prepare_inputs"])
def test_an_interrupt_while_an_apply_waits_for_its_slot(device, backend_name, how, delay, warm):
    backend = gpu_backend(backend_name, ring_depth=2)
    if warm:
        warm_up(device, backend)
    s = InterruptedTables(backend, device, 8, how, lambda: torch.cuda.synchronize(device))
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        busy(0.3)
        s.stage(0, [1, 2, 3])
        s.run()  # apply 1: queued behind the busy work
        s.land()
        s.stage(1, list(range(100, 110)))
        try:
            signal.setitimer(signal.ITIMER_REAL, delay)
            s.run()  # waits for apply 1's slot
            signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if s.bt.num_staged_writes == 0:  # the call landed: its kernel was issued
            s.land()
        s.stage(2, list(range(200, 230)))
        s.check("after the interrupt")
        for step in range(3):  # later steps: each stages the next while its kernel is queued behind busy work
            busy(0.05)
            s.run()
            s.land()
            s.stage(3 + step, list(range(300 + step, 340)))
            s.check(f"step {step}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
