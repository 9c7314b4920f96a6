"""The faults graph mode's protocol is built against: a late replay after an eager apply, failures at and after the
publish point, misuse. Where an earlier design got the sequence wrong, the test's docstring says what it did; the
others pin the consistency around those points. Checked against `tests/graph/model.py`'s model of what the device
must hold; Triton's interpreter on CPU, simulated captures. The eager Triton plan's twins are in
tests/backends/test_triton_plan.py."""

from __future__ import annotations

import gc
import time
import types
import warnings
import weakref

import numpy as np
import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite.backends.triton.ring import SlotRing
from multiwrite.capture import simulated_capture
from multiwrite.errors import BackendError, RingStallError, RingWaitWarning, StagedWriteError
from multiwrite.staging.headers import HeaderRing
from multiwrite.tables import graph as graph_module
from tests.graph.model import REQS, WIDE, GraphModel, fill, retry_after_a_replay, staged, two_unapplied_commits
from tests.support import host


def interrupting_sleep(monkeypatch) -> list[int]:
    """Make the staging wait raise KeyboardInterrupt at its first sleep (as a Ctrl-C while it polls); returns a list
    that counts the interrupts."""
    hits: list[int] = []

    def sleep(_seconds: float) -> None:
        hits.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(wait_module, "time", types.SimpleNamespace(perf_counter=time.perf_counter, sleep=sleep))
    return hits


# -- 1: a replay never applies a batch committed after it was issued -------------------------------------------
def test_a_late_replay_after_an_eager_apply_applies_nothing_committed_after_it():
    """Commit step 1, replay it; commit step 2; an eager apply_staged_writes() (applies step 2); the host stages and
    commits step 3, in which row 1 is freed and reused by a new request; only then does step 2's replay run (it was
    queued behind a busy stream). It must apply nothing: step 2 was applied by the eager apply, and step 3 belongs to
    the next replay. The earlier design (each replay applies the oldest batch not yet applied) applied step 3 in
    step 2's replay, so step 2's model step read the new request's block ids in row 1."""
    m = GraphModel()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.stage(1, ([5, 6], [7], [8, 9]), True)
    m.commit()
    m.replay()
    m.check("step 1")
    m.stage(1, ([10], [], [11]), False)  # step 2: row 1 grows
    m.commit()
    m.eager_apply()  # e.g. a prefill run outside the graph: applies every published batch
    m.check("eager apply")
    step2 = [host(t.tensor).copy() for t in m.bt.block_tables]
    m.stage(1, ([], [], []), True)  # step 3: row 1's request finished ...
    m.stage(1, ([20], [21], [22]), True)  # ... and a new request takes the row
    m.commit()
    m.replay()  # step 2's replay, running after the commit of step 3
    m.check("step 2's late replay")
    for g, t in enumerate(m.bt.block_tables):
        np.testing.assert_array_equal(host(t.tensor), step2[g], err_msg=f"group {g}: the late replay applied step 3")
    assert m.bt[0].tensor[1, :3].tolist() == [5, 6, 10]
    m.replay()  # step 3's replay
    m.check("step 3")
    assert m.bt[0].tensor[1, :3].tolist() == [20, 6, 10] and m.bt.num_blocks_device[:, 1].tolist() == [1, 2, 1]


# -- 2: a failure after the launch or publish point leaves a consistent state ----------------------------------
def test_an_interrupt_while_a_commit_waits_for_a_header_entry_changes_nothing(monkeypatch):
    """Ctrl-C while a commit waits for the header ring (two entries, both unapplied): nothing published, every
    write staged, the host counts as staged; once a replay has run the same commit publishes them."""
    m = two_unapplied_commits()
    counts = m.bt.num_blocks.copy()
    hits = interrupting_sleep(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        m.bt.commit_staged_writes()
    monkeypatch.undo()
    assert hits and m.bt.graph.ring.published == 2 and staged(m) == [1, 1, 1]
    np.testing.assert_array_equal(m.bt.num_blocks, counts)
    retry_after_a_replay(m)


def test_an_interrupt_while_a_commit_waits_for_a_staging_slot_changes_nothing(monkeypatch):
    """A batch that stays in its slot needs the next slot for the host's next batch: with two slots, the next one
    still holds the batch committed before (not replayed yet). Ctrl-C while the commit waits for it: nothing
    published, the batch staged, its memory intact; after the replay the commit and its replay land it exactly."""
    m = GraphModel(ring_depth=2, reqs=8, widths=WIDE)
    fill(m, [0, 1], seed=1)
    m.commit()
    fill(m, [2, 3], seed=2)
    hits = interrupting_sleep(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        m.bt.commit_staged_writes()
    monkeypatch.undo()
    assert hits and m.bt.graph.ring.published == 1 and staged(m) == [2, 2, 2]
    m.replay()
    m.check("first batch")
    m.commit()
    m.replay()
    m.check("second batch")


def test_a_failed_allocation_of_a_larger_slot_keeps_everything_staged(monkeypatch):
    """A call that stages more than its slot holds needs a larger one (pinned memory on a GPU): when that allocation
    fails (MemoryError) the call stages nothing, the writes staged before it stay staged in their slot, and the next
    commit publishes exactly them; the call, retried, then lands too."""
    m = GraphModel(reqs=8, widths=WIDE)
    fill(m, range(7), seed=3)  # 1,001 values: the slot's first 1,024 hold them
    counts = m.bt.num_blocks.copy()

    def no_memory(self, *args, **kwargs):
        raise MemoryError("pinned allocation failed")

    monkeypatch.setattr(SlotRing, "_slot", no_memory)
    with pytest.raises(MemoryError):
        m.bt.append_block_ids(7, [list(range(1, w + 1)) for w in m.widths], True)  # 143 more: past 1,024
    monkeypatch.undo()
    assert m.bt.graph.ring.published == 0 and staged(m) == [7, 7, 7]
    np.testing.assert_array_equal(m.bt.num_blocks, counts)
    m.commit()
    m.replay()
    m.check("the writes staged before the failed call")
    fill(m, [7], seed=4)
    m.commit()
    m.replay()
    m.check("the retried call")


def test_an_interrupt_right_after_a_publish_keeps_the_published_batch_and_stages_elsewhere(monkeypatch):
    """Ctrl-C just after a batch (left in its slot) is published: the batch stays published (its replay applies it),
    the arena has moved to a fresh slot, so the host's next batches never overwrite it, and a clear drops nothing
    of it: num_blocks is never rolled back past a published batch. The earlier design published with a series of
    Python stores and moved the arena after them: interrupted in between, the arena kept staging into the published
    batch's slot (and a clear restored the counts of before it)."""
    m = GraphModel(reqs=8, widths=WIDE)
    real = HeaderRing.publish

    def publish_then_interrupt(self, *args):
        real(self, *args)
        raise KeyboardInterrupt

    fill(m, [0, 1], seed=4)
    monkeypatch.setattr(HeaderRing, "publish", publish_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        m.bt.commit_staged_writes()
    monkeypatch.undo()
    assert m.bt.graph.ring.published == 1 and staged(m) == [0, 0, 0]
    m.committed(0)  # the model: the batch was committed (ticket 0)
    m.bt.clear_staged_writes()  # nothing staged since the publish: nothing to roll back
    m.ref.clear_staged_writes()
    np.testing.assert_array_equal(m.bt.num_blocks, m.ref.num_blocks)
    fill(m, [1, 2], seed=5)  # the next batches, staged before the first replay runs
    m.commit()
    fill(m, [0, 3], seed=6)
    m.replay()
    m.check("the interrupted commit's batch")
    m.replay()
    m.check("the next one")
    m.commit()
    m.replay()
    m.check("the third")


def test_an_interrupt_during_an_eager_apply_launch_loses_no_published_batch(monkeypatch):
    """Ctrl-C while an eager graph-mode apply launches its consume kernel (before it runs): the staged writes were
    published, so they are not staged any more, and the next eager apply (nothing staged) applies them."""
    from multiwrite.backends.triton.launcher import Launcher

    m = GraphModel()
    m.stage(0, ([1, 2], [3], [4]), True)

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(Launcher, "_interpret", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.bt.apply_staged_writes()
    monkeypatch.undo()
    assert staged(m) == [0, 0, 0] and not m.bt[0].tensor.any()
    m.eager_apply()
    m.check("the next eager apply")
    assert m.bt[0].tensor[0, :2].tolist() == [1, 2]


def test_a_failed_eager_apply_says_its_batch_stays_committed_and_the_next_apply_lands_it(monkeypatch):
    """The consume launch of an eager graph-mode apply fails after the publish: the error says the batch stays
    committed (not that it is still staged, which it is not), and the next eager apply lands it."""
    from multiwrite.backends.triton.launcher import Launcher

    m = GraphModel()
    m.stage(1, ([5], [6], [7]), True)

    def failing(self, *args):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(Launcher, "_interpret", failing)
    with pytest.raises(BackendError) as info:
        m.bt.apply_staged_writes()
    monkeypatch.undo()
    message = str(info.value)
    assert "1 committed batches are not applied yet" in message and "still staged" not in message, message
    assert isinstance(info.value.__cause__, RuntimeError) and staged(m) == [0, 0, 0]
    m.eager_apply()
    m.check("the next eager apply")
    assert m.bt[0].tensor[1, :1].tolist() == [5]


# -- 3: misuse is refused clearly ------------------------------------------------------------------------------
def test_a_commit_during_a_capture_with_a_full_ring_raises_without_synchronizing(monkeypatch):
    """A commit made while a (simulated) capture is underway, into a full header ring: RingWaitWarning, then
    RingStallError saying it did not synchronize (a synchronization would invalidate the capture); nothing
    committed. The earlier design synchronized the device before raising, capture or not."""
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.02)
    monkeypatch.setattr(wait_module, "WAIT_TIMEOUT_S", 0.1)
    m = GraphModel(ring_depth=2)
    for r in (0, 1):
        m.stage(r, ([r + 1], [r + 2], [r + 3]), True)
        m.commit()
    m.stage(2, ([9], [9], [9]), True)
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError) as info, simulated_capture():
        m.bt.commit_staged_writes()
    assert "no device synchronization: the current stream is capturing a CUDA graph" in str(info.value)
    assert m.bt.graph.ring.published == 2 and staged(m) == [1, 1, 1]
    m.replay()
    m.replay()
    m.check("the two commits")
    m.commit()
    m.replay()
    m.check("the third")


@pytest.mark.parametrize("change", ["resize_", "set_", "num_blocks_device.set_"])
def test_a_table_resized_in_place_is_refused_at_the_commit(change):
    """A graph-mode table is captured by address: after a `resize_` or `set_` in place the commit (and the eager
    apply) refuse with StagedWriteError naming the table; nothing is published, so the next replay applies nothing
    and neither the old nor the new memory is written. The earlier design did not check at the commit: the batch
    was published and its replay wrote through the descriptors of the tables as they were at construction."""
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.replay()
    m.stage(1, ([4], [5], [6]), True)
    before = [host(t.tensor).copy() for t in m.bt.block_tables]
    if change == "resize_":
        m.bt[0].tensor.resize_(REQS - 1, 5)
        what = "group 0"
    elif change == "set_":
        m.bt[1].tensor.set_(torch.zeros_like(m.bt[1].tensor))
        what = "group 1"
    else:
        m.bt.num_blocks_device.set_(torch.zeros_like(m.bt.num_blocks_device))
        what = "num_blocks"
    for call in (m.bt.commit_staged_writes, m.bt.apply_staged_writes):
        with pytest.raises(StagedWriteError, match=rf"{what} of a BlockTables was resized in place.*stays staged"):
            call()
    assert m.bt.graph.ring.published == 1 and staged(m) == [1, 1, 1]
    m.graph.replay()  # no ticket: nothing applied, nothing written
    if change == "set_":
        assert not m.bt[1].tensor.any()
    np.testing.assert_array_equal(host(m.bt[2].tensor), before[2])
    assert m.bt.graph.ring.applied == 1


def test_outputs_moved_in_place_are_refused_at_the_commit():
    """A captured stage writes `slot_mappings` and `input_block_tables` by address: after a `set_` in place the
    commit refuses, naming the output; nothing is published and the writes stay staged."""
    m = GraphModel(max_num_batched_tokens=8)
    m.stage(0, ([1], [2], [3]), True)
    m.bt.slot_mappings.set_(torch.zeros_like(m.bt.slot_mappings))
    with pytest.raises(StagedWriteError, match=r"slot_mappings of a BlockTables was resized in place.*stays staged"):
        m.bt.commit_staged_writes()
    assert m.bt.graph.ring.published == 0 and staged(m) == [1, 1, 1]


def test_a_captured_graph_outlives_its_block_tables():
    """A CUDA graph keeps reading a graph-mode BlockTables' memory at every replay, after the BlockTables is gone:
    once captured, its GraphMode (tables, descriptors, header ring, staging slots) stays in graph.py's keep-alive
    list, so a replay recorded before `del bt` still lands the last committed batch in live memory. The earlier
    design freed that memory with the BlockTables (its users had to keep it alive): a later replay read and wrote
    freed memory."""
    m = GraphModel()
    bt = m.bt
    mode = bt.graph
    assert any(g is mode for g in graph_module._CAPTURED)
    bt.append_block_ids(3, ([1, 2], [3], [4, 5]), True)
    bt.commit_staged_writes()
    gone = weakref.ref(bt)
    del bt, m.bt
    gc.collect()
    assert gone() is None, "the BlockTables is still alive: the test would prove nothing"
    m.graph.replay()
    tables = mode.layout.tables
    assert tables[0][3, :2].tolist() == [1, 2] and tables[1][3, :2].tolist() == [6, 7]
    assert tables[2][3, :2].tolist() == [4, 5] and mode.layout.num_blocks[:, 3].tolist() == [2, 2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.graph.replay()  # no ticket: nothing, no error
    assert mode.ring.runs == 2 and mode.ring.applied == 1
