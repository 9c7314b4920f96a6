"""The Triton backends' staging rings (`backends/triton/ring.py`, white-box: the ring has no public face): a slot is
handed out again only once the kernel that read it stored its token into the slot's completion word; a wait for it
warns (`RingWaitWarning`) after `multiwrite.staging.wait.WAIT_WARN_S` and raises `RingStallError` after
`WAIT_TIMEOUT_S`, never force-freeing the slot. On CPU (Triton's interpreter) a launch that "never completes" is a
token taken and not stored."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite import FusedStagedWriter, RingStallError, RingWaitWarning, StagedWriteTensor
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.ring import SlotRing

CPU = torch.device("cpu")


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.05)
    monkeypatch.setattr(wait_module, "WAIT_TIMEOUT_S", 0.3)


def ring(depth: int = 2) -> SlotRing:
    return SlotRing(TritonCudaBackend(ring_depth=depth).device_state(CPU), depth, np.int32, "test")


def launched(lease) -> int:
    """As if a kernel reading `lease` had been launched (its token taken) and had not finished."""
    return lease.next_token()


def test_slots_rotate_and_one_is_handed_out_again_only_once_its_token_arrives(short_waits):
    r = ring(2)
    a = r.acquire(1, 1)
    token = launched(a)
    b = r.acquire(1, 1)
    assert (a.slot, b.slot) == (0, 1) and b.released()
    launched(b)
    r.done[b.slot] = b.token  # b's kernel finished, a's did not
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError):
        r.acquire(1, 1)  # slot 0 again: still read by a's kernel
    r.done[a.slot] = token
    assert r.acquire(1, 1).slot == 0 and r.idle()


def test_a_token_that_never_arrives_warns_then_raises_and_the_slot_is_never_force_freed(short_waits):
    r = ring(2)
    a = r.acquire(1, 1)
    token = launched(a)
    r.acquire(1, 1)
    with pytest.warns(RingWaitWarning) as caught, pytest.raises(RingStallError) as info:
        r.acquire(1, 1)
    warning = str(caught[0].message)
    for part in ("staging slot 0 of the test ring (depth 2) of the multiwrite Triton backend on cpu has waited 0.",
                 f"completion token {token}, its word holds 0", "MULTIWRITE_TRITON_RING_DEPTH",
                 "staged writes stay staged"):  # fmt: skip
        assert part in warning, part
    assert "gave up after 0." in str(info.value) and not a.released()
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError):  # waits (and fails) again: not reused
        r.acquire(1, 1)


def test_a_late_token_is_waited_for_with_one_warning_and_a_short_wait_is_silent(monkeypatch):
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.05)
    for delay, warns in ((0.25, 1), (0.0, 0)):
        r = ring(2)
        a = r.acquire(1, 1)
        token = launched(a)
        r.acquire(1, 1)
        timer = threading.Timer(delay, r.done.__setitem__, (a.slot, token))  # the "kernel" finishes
        timer.start()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert r.acquire(1, 1) is a
        finally:
            timer.join()
        assert len([c for c in caught if issubclass(c.category, RingWaitWarning)]) == warns


def test_a_grown_slot_keeps_its_token_and_a_released_lease_comes_back_next():
    r = ring(3)
    a = r.acquire(4, 8)
    token = launched(a)
    r.done[a.slot] = token
    big = r.grow(a, 100, 5000)  # larger memory for the same slot: the kernel's word still guards it
    assert (big.slot, big.token, big.meta_cap, big.values_cap) == (a.slot, token, 100, 5000) and big.released()
    b = r.acquire(1, 1)
    r.release(b)  # acquired for an apply that failed before its launch
    assert r.acquire(1, 1) is b


def test_an_apply_whose_next_staging_slot_is_held_by_a_lost_launch_raises_and_keeps_the_writes(short_waits):
    """Through a real apply: an arena stages into its own lent ring; after its batch is launched it moves to the
    next slot, which must be free. Held by a launch that never completes (as one captured and never replayed), the
    apply raises RingStallError naming the lent ring, writes nothing and keeps every write staged."""
    backend = TritonCudaBackend(ring_depth=2)
    t = StagedWriteTensor((2, 4), torch.int32, CPU, name="t")
    writer = FusedStagedWriter(CPU, backend=backend)
    t.stage_write(0, 0, [1])
    writer.apply([t])  # the arena now stages into a ring lent by the backend
    lender = t.arena.lender
    nxt = lender.leases[lender.next]
    token = launched(nxt)
    t.stage_write(1, 1, [5, 6])
    with pytest.warns(RingWaitWarning), pytest.raises(Exception) as info:
        writer.apply([t])
    stall = info.value if isinstance(info.value, RingStallError) else info.value.__cause__  # (a writer wraps it)
    assert isinstance(stall, RingStallError) and "the lent (int32 arena) ring" in str(stall)
    assert t.num_staged_writes == 1 and t.tensor.tolist() == [[1, 0, 0, 0], [0] * 4]
    lender.done[nxt.slot] = token
    writer.apply([t])
    assert t.num_staged_writes == 0 and t.tensor.tolist() == [[1, 0, 0, 0], [0, 5, 6, 0]]
