"""The eager Triton plan (`backends/triton/plan.py`, `TritonPlan.apply` / `prepare`) when an apply fails at each
point of its launch sequence: the next staging slot is taken first (it may wait, or need a larger pinned
allocation), then the kernel is launched on the staged slot. A failure before the launch changes nothing (every
write staged, the host counts as staged); an interrupt after the kernel ran lands the batch (nothing staged any
more, so a later clear never rolls `num_blocks` back past it). White-box where a failure is injected (the ring's
slot allocation, the interpreter's launch); graph mode's twins are in tests/graph/test_protocol_faults.py."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite import BlockTables
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.ring import SlotRing
from multiwrite.reference import ReferenceBlockTables
from tests.support.tables import host

BS, KBS, WIDTHS = [16, 32], [16, 16], [1200, 8]
IDX, QSL, POS = [1, 0], [0, 1, 2], [3, 0]


class Tables:
    """triton-cuda tables on a backend instance of their own (two staging slots), and their reference."""

    def __init__(self):
        self.bt = BlockTables(BS, 3, WIDTHS, "cpu", KBS, backend=TritonCudaBackend(ring_depth=2),
                              max_num_batched_tokens=4)  # fmt: skip
        self.ref = ReferenceBlockTables(BS, 3, WIDTHS, KBS)
        self.stage(0, ([1], [2]), True)
        self.stage(1, ([3], [4]), True)
        self.run("apply")  # the arena now stages into the ring lent by the backend

    def stage(self, req, ids, overwrite):
        self.bt.append_block_ids(req, ids, overwrite)
        self.ref.append_block_ids(req, ids, overwrite)

    def run(self, how: str) -> None:
        if how == "apply":
            self.bt.apply_staged_writes()
        else:
            idx, qsl, pos = (torch.tensor(x) for x in (IDX, QSL, POS))
            self.bt.prepare_inputs(idx, qsl, pos, 2, 2)
        self.ref.apply_staged_writes()

    def staged(self) -> list[int]:
        return [t.num_staged_writes for t in self.bt.block_tables]

    def check(self, applied: bool, what: str) -> None:
        """Device tables and counts: the reference's, as of its last apply (`applied`) or of the one before."""
        tables = self.ref.tables if applied else self.before
        for g, t in enumerate(self.bt.block_tables):
            np.testing.assert_array_equal(host(t.tensor), tables[g], err_msg=f"{what}: group {g}")
        counts = self.ref.num_blocks_applied if applied else self.before_counts
        np.testing.assert_array_equal(host(self.bt.num_blocks_device), counts, err_msg=f"{what}: num_blocks_device")

    def step(self) -> None:
        """Stage a step; remember the device state before it."""
        self.before = [t.copy() for t in self.ref.tables]
        self.before_counts = self.ref.num_blocks_applied.copy()
        self.stage(0, ([5, 6], [7]), False)
        self.stage(2, ([8], []), True)


HOW = ["apply", "prepare_inputs"]


@pytest.mark.parametrize("how", HOW)
def test_an_interrupt_while_waiting_for_the_next_slot_changes_nothing(monkeypatch, how):
    """The next slot is taken before the launch: Ctrl-C while waiting for it writes nothing and keeps every write
    staged. The earlier design launched first and took the next slot after: interrupted in that wait, the tables
    held the batch while it was still staged (a clear then rolled num_blocks back below what the device held)."""
    t = Tables()
    t.step()
    lender = t.bt[0].arena.lender
    nxt = lender.leases[lender.next]
    token = nxt.next_token()  # the next slot is still read by a launch that has not finished
    counts = t.bt.num_blocks.copy()

    def interrupt(_seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(wait_module, "time", types.SimpleNamespace(perf_counter=time.perf_counter, sleep=interrupt))
    with pytest.raises(KeyboardInterrupt):
        t.run(how)
    monkeypatch.undo()
    assert t.staged() == [2, 2]
    np.testing.assert_array_equal(t.bt.num_blocks, counts)
    t.check(applied=False, what="interrupted")
    lender.done[nxt.slot] = token  # the launch finishes
    t.run(how)
    t.check(applied=True, what="retried")


@pytest.mark.parametrize("how", HOW)
def test_a_failed_allocation_of_a_larger_slot_keeps_every_write_staged(monkeypatch, how):
    """A call that stages more values than its slot holds needs a larger slot (pinned memory on a GPU): when that
    allocation fails the call raises MemoryError having staged nothing; the writes staged before it land exactly at
    the next apply, and the call, retried, after it."""
    t = Tables()
    t.step()
    counts = t.bt.num_blocks.copy()

    def no_memory(self, *args, **kwargs):
        raise MemoryError("pinned allocation failed")

    monkeypatch.setattr(SlotRing, "_slot", no_memory)
    with pytest.raises(MemoryError):
        t.bt.append_block_ids(1, (list(range(10, 1110)), []), False)  # 1,100 values: past the slot's 1,024
    monkeypatch.undo()
    assert t.staged() == [2, 2]
    np.testing.assert_array_equal(t.bt.num_blocks, counts)
    t.run(how)
    t.check(applied=True, what="the writes staged before the failed call")
    t.stage(1, (list(range(10, 1110)), []), False)
    t.run(how)
    t.check(applied=True, what="the retried call")


@pytest.mark.parametrize("how", HOW)
def test_an_interrupt_before_the_kernel_runs_keeps_every_write_staged(monkeypatch, how):
    t = Tables()
    t.step()

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(Launcher, "_interpret", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.run(how)
    monkeypatch.undo()
    assert t.staged() == [2, 2]
    t.check(applied=False, what="interrupted")
    t.run(how)
    t.check(applied=True, what="retried")


@pytest.mark.parametrize("how", HOW)
def test_an_interrupt_after_the_kernel_ran_lands_the_batch_and_a_clear_keeps_its_counts(monkeypatch, how):
    """The kernel ran (its token is in the slot's word), then Ctrl-C: the batch has landed, so nothing stays staged,
    and a clear afterwards keeps the counts of that batch; the next call appends after them. The earlier design
    marked the slot free and kept the writes staged: the clear then rolled num_blocks back to before a batch the
    device held, and the next appends overwrote its blocks."""
    t = Tables()
    t.step()
    real = Launcher._interpret

    def ran_then_interrupted(self, *args):
        real(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(Launcher, "_interpret", ran_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.run(how)
    monkeypatch.undo()
    t.ref.apply_staged_writes()  # (run() was interrupted before the reference's apply)
    assert t.staged() == [0, 0]
    t.check(applied=True, what="landed")
    t.bt.clear_staged_writes()
    np.testing.assert_array_equal(t.bt.num_blocks, t.ref.num_blocks)
    np.testing.assert_array_equal(t.bt.num_blocks, host(t.bt.num_blocks_device))
    t.stage(0, ([9], []), False)
    t.run(how)
    t.check(applied=True, what="next call")
    assert t.bt[0].tensor[0, :4].tolist() == [1, 5, 6, 9]


def test_captured_launches_read_the_plans_own_descriptors_never_the_devices_bounded_cache(monkeypatch):
    """A graph-mode plan builds its tables' and its stage's descriptors once, at construction, and every launch a
    capture recorded reads them by address: the device's descriptor cache (bounded: it evicts) is never consulted
    at capture or replay, so no host->device copy can happen inside a capture and no evicted descriptor is read."""
    from multiwrite.backends.triton.device import TritonDevice
    from multiwrite.capture import simulated_capture

    bt = BlockTables([16, 32, 8], 6, [4, 4, 6], "cpu", [16, 16, 8], backend=TritonCudaBackend(), cuda_graphs=True)
    idx = torch.tensor([3, 1], dtype=torch.int64)

    def refuse(self, tables):
        raise AssertionError("the device's descriptor cache was used by a graph-mode launch")

    monkeypatch.setattr(TritonDevice, "descriptors", refuse)
    with simulated_capture() as graph:
        bt.apply_staged_writes()
        gathered = bt.gather_block_tables(idx, 4)
    bt.append_block_ids(1, ([5, 6], [7], [8, 9]), True)
    bt.append_block_ids(3, ([1], [2], [3]), True)
    bt.commit_staged_writes()
    graph.replay()
    assert gathered[0][:2, :2].tolist() == [[1, 0], [5, 6]] and gathered[1][1, :2].tolist() == [14, 15]
    assert not gathered[0][2:].any()
