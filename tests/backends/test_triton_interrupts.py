"""An interrupt at any point of an eager apply (or `prepare_inputs`) on the Triton plan, with kernels that run
late: after it the tables hold exactly the batches that landed, what did not land is still staged, and it lands
whole later (issue 23, item 1).

The interpreter runs a launch when it is issued; here a launch is held back in a queue (the "stream") and runs at
`TritonDevice.drain` or at the test's own synchronization, so that a kernel still reads its staging slot while the
host goes on, as on a GPU. Two staging slots (ring depth 2), as in the issue: apply 1 is still queued while apply 2
waits for its slot. The GPU twin, with `torch.cuda._sleep` and SIGALRM, is tests/gpu/test_interrupts.py."""

from __future__ import annotations

import time
import types

import pytest

import multiwrite.staging.wait as wait_module
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.device import TritonDevice
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.ring import SlotRing
from multiwrite.staging.arena import Lease
from tests.support.interrupts import InterruptedTables


class Stream:
    """Launches held back until `sync()` (in issue order), as a busy GPU stream holds them; a host that waits for
    a staging slot lets the stream run (after `on_wait()`: where an interrupt may come)."""

    def __init__(self, monkeypatch):
        self.queue: list[tuple] = []
        self.real = Launcher._interpret
        self.on_wait = lambda: None
        monkeypatch.setattr(Launcher, "_interpret", lambda launcher, *args: self.queue.append((launcher, args)))
        monkeypatch.setattr(TritonDevice, "drain", lambda device: self.sync())
        monkeypatch.setattr(wait_module, "time", types.SimpleNamespace(perf_counter=time.perf_counter,
                                                                       sleep=self.sleep))  # fmt: skip

    def sleep(self, _seconds: float) -> None:
        self.on_wait()
        self.sync()

    def sync(self) -> None:
        while self.queue:
            launcher, args = self.queue.pop(0)
            self.real(launcher, *args)


class Interrupt:
    """Raise KeyboardInterrupt once, at one point of the launch sequence (`arm()` first)."""

    def __init__(self):
        self.armed = False
        self.fired = 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise KeyboardInterrupt


def install(point: str, interrupt: Interrupt, stream: Stream, monkeypatch) -> None:
    """Make `interrupt` fire at `point`."""
    if point == "waiting for the next slot":
        stream.on_wait = interrupt
    elif point == "after the next slot was taken":
        real = SlotRing.acquire

        def acquire(ring, *args):
            lease = real(ring, *args)
            interrupt()
            return lease

        monkeypatch.setattr(SlotRing, "acquire", acquire)
    elif point == "after the token was taken":
        real_token = Lease.next_token

        def next_token(lease):
            token = real_token(lease)
            interrupt()
            return token

        monkeypatch.setattr(Lease, "next_token", next_token)
    elif point in ("before the kernel was issued", "after the kernel was issued", "issued, then again while drained"):
        queue = stream.queue

        def interpret(launcher, *args):
            if point == "before the kernel was issued":
                interrupt()
            queue.append((launcher, args))
            if point != "before the kernel was issued" and interrupt.armed:
                try:
                    interrupt()
                finally:
                    if point == "issued, then again while drained":  # (and once more while it is resolved)
                        interrupt.arm()

        monkeypatch.setattr(Launcher, "_interpret", interpret)
        if point == "issued, then again while drained":

            def drain(device):
                interrupt()
                stream.sync()

            monkeypatch.setattr(TritonDevice, "drain", drain)
    elif point == "after the launch returned":
        real_launch = TritonDevice.launch_on

        def launch_on(device, *args):
            real_launch(device, *args)
            interrupt()

        monkeypatch.setattr(TritonDevice, "launch_on", launch_on)
    else:
        raise AssertionError(point)


POINTS = ["waiting for the next slot", "after the next slot was taken", "after the token was taken",
          "before the kernel was issued", "after the kernel was issued", "issued, then again while drained",
          "after the launch returned"]  # fmt: skip


@pytest.mark.parametrize("how", ["apply", "prepare_inputs"])
@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_anywhere_leaves_the_landed_batches_and_the_rest_staged(monkeypatch, point, how):
    """The issue's run: apply 1 (row 0) queued behind busy work; row 1 gets 10 ids, the apply is interrupted;
    the program stages row 2 (30 ids) and synchronizes; later steps apply and stage on. Before the fix, an
    interrupt after the ring handed out the next slot (and before the apply could use or return it) left the ring
    one slot ahead: the next apply landed on the very slot it had launched, and the next step's staging rewrote
    it under the queued kernel (rows 1 and 2 then held neither their ids nor zeros)."""
    stream = Stream(monkeypatch)
    s = InterruptedTables(TritonCudaBackend(ring_depth=2), "cpu", 4, how, stream.sync)
    interrupt = Interrupt()
    install(point, interrupt, stream, monkeypatch)
    s.stage(0, [1, 2, 3])
    s.run()  # apply 1: its kernel stays queued
    s.land()
    s.stage(1, list(range(100, 110)))
    interrupt.arm()
    try:
        s.run()
    except KeyboardInterrupt:
        pass
    assert interrupt.fired == (2 if point == "issued, then again while drained" else 1)
    if s.bt.num_staged_writes == 0:  # the apply landed: its kernel was issued
        s.land()
    s.stage(2, list(range(200, 230)))
    s.check("after the interrupt")
    for step in range(3):  # later steps: apply, and stage the next step while the kernel is queued
        s.run()
        s.land()
        s.stage(3, list(range(300 + step, 340)))
        stream.sync()
        s.check(f"step {step}")
    assert s.bt.num_staged_writes == 2
