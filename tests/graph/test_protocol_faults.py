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
from multiwrite.errors import BackendError, GraphCaptureError, RingStallError, RingWaitWarning, StagedWriteError
from multiwrite.staging.headers import HeaderRing
from multiwrite.tables import graph as graph_module
from tests.graph.model import (
    REQS,
    WIDE,
    GraphModel,
    fill,
    graph_tables,
    report_one_replay_without_commit,
    retry_after_a_replay,
    staged,
    two_unapplied_commits,
)
from tests.support.tables import host


def interrupting_sleep(monkeypatch) -> list[int]:
    """Make the staging wait raise KeyboardInterrupt at its first sleep (as a Ctrl-C while it polls); returns a list
    that counts the interrupts."""
    hits: list[int] = []

    def sleep(_seconds: float) -> None:
        hits.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(wait_module, "time", types.SimpleNamespace(perf_counter=time.perf_counter, sleep=sleep))
    return hits


# -- 1: commits and replays mis-paired: reported once, the pairing restored, nothing lost ------------------------
def test_an_eager_apply_between_a_commit_and_its_replay_is_reported_and_the_later_replays_pair_again():
    """Commit step 1, replay it; commit step 2; an eager apply_staged_writes() (applies step 2) before step 2's replay
    is issued; the host stages step 3, in which row 1 is freed and reused by a new request. On one stream a replay
    issued before the eager call runs before it (tests/gpu: a replay queued behind a busy stream applies only its own
    step); one issued after it is the next commit's. So the eager call found commit 1 with no replay: the commit of
    step 3 raises GraphProtocolError naming it, publishing nothing; committed again, step 3 pairs with the next
    replay, and nothing of step 2 is lost. The protocol before this one said nothing, and the replay after the
    eager call then applied nothing (step 3 came one replay late)."""
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
    assert m.bt[0].tensor[1, :3].tolist() == [5, 6, 10]
    m.stage(1, ([], [], []), True)  # step 3: row 1's request finished ...
    m.stage(1, ([20], [21], [22]), True)  # ... and a new request takes the row
    err = m.expect_report()
    assert (err.commits_without_replay, err.first_commit, err.replays_without_commit, err.last_replay) == (
        1, 1, 0, None)  # fmt: skip
    assert "commit 1 (counting commits from 0), header 1, had no replay issued before the eager" in str(err)
    assert "commit_staged_writes of graph-mode BlockTables" in str(err) and "stay staged" in str(err)
    m.commit()
    m.replay()
    m.check("step 3")
    assert m.bt[0].tensor[1, :3].tolist() == [20, 6, 10] and m.bt.num_blocks_device[:, 1].tolist() == [1, 2, 1]
    m.stage(2, ([7], [8], [9]), True)
    m.commit()
    m.replay()
    m.check("step 4: paired")


def test_an_extra_commit_is_reported_at_the_call_after_the_next_eager_apply_and_nothing_is_lost():
    """One commit_staged_writes() too many (no replay for it): every later replay applies the batch of the commit
    before its own, which no replay can tell. The next eager apply (a step run outside the graph) applies every
    published batch and finds one commit more than replays: the call after it raises GraphProtocolError (publishing
    nothing); from then on each replay applies exactly its own commit's batch. Before, the shift was silent and
    lasted until a replay ran without a commit."""
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.replay()
    m.commit()  # the extra commit (empty)
    for step in range(2, 5):
        m.stage(step, ([step], [step], [step]), True)
        m.commit()
        m.replay()  # applies the previous commit's batch: one step late
        m.check(f"step {step}, one late")
        assert not m.bt[0].tensor[step].any()
    m.stage(5, ([9], [9], [9]), True)
    m.eager_apply()  # applies step 4 (the late one) and its own writes
    m.check("eager step")
    assert m.bt[0].tensor[4:6, 0].tolist() == [4, 9]
    err = m.expect_report("eager")
    assert (err.commits_without_replay, err.first_commit) == (1, 4)
    assert err.args[0].startswith("apply_staged_writes of graph-mode BlockTables")
    for step in range(6, 9):  # paired again: each replay applies its own step
        m.stage(step - 4, ([step + 10], [], []), False)
        m.commit()
        m.replay()
        m.check(f"step {step}")
        assert m.bt[0].tensor[step - 4, :2].tolist() == [step - 4, step + 10]
    assert (m.bt.graph.ring.extra, m.bt.graph.ring.missed) == (1, 0)


def test_a_replay_before_its_commit_is_reported_at_that_commit_which_then_pairs_with_the_next_replay():
    """The host replays step 2 before committing it: the replay finds its ticket unpublished and applies nothing.
    That commit raises GraphProtocolError naming replay 1 and publishes nothing, the writes staged; made again, it is
    the batch of the next replay, and every later step pairs. Before, the commit was silent."""
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.replay()
    m.stage(1, ([4], [5], [6]), True)
    m.replay()  # step 2's replay, before its commit
    m.check("early replay")
    report_one_replay_without_commit(m, 1)
    assert m.bt[0].tensor[1, 0].item() == 4
    m.stage(2, ([7], [8], [9]), True)
    m.commit()
    m.replay()
    m.check("step 3")


def test_replays_without_commits_are_reported_once_counted_and_named():
    """Two replays in a row without a commit: the next eager apply raises once, counting both and naming the last;
    the same call then works, and the commit and replay after it pair."""
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.replay()
    m.replay()
    m.replay()
    m.stage(1, ([4], [5], [6]), True)
    err = m.expect_report("eager")
    assert (err.replays_without_commit, err.last_replay) == (2, 2)
    assert "2 replays found no commit for them (the last: replay 2" in str(err)
    m.eager_apply()
    m.check("the eager apply, again")
    m.stage(2, ([7], [8], [9]), True)
    m.commit()
    m.replay()
    m.check("paired")
    assert m.bt[0].tensor[:3, 0].tolist() == [1, 4, 7]


def test_a_second_consume_launch_in_one_capture_is_refused_and_the_first_one_pairs():
    """A capture that records apply_staged_writes() and then prepare_inputs() (or the reverse) would consume two
    tickets per replay: the second is refused with GraphCaptureError, nothing recorded; the graph replays with one
    consume launch, paired with one commit each. Another capture of the same tables may record its own."""
    bt = graph_tables(max_num_batched_tokens=8)
    idx, qsl, pos = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 0, 0]), torch.zeros(8, dtype=torch.int64)
    with simulated_capture() as graph:
        bt.apply_staged_writes()
        with pytest.raises(GraphCaptureError, match=r"prepare_inputs on graph-mode BlockTables.*already recorded"):
            bt.prepare_inputs(idx, qsl, pos, 2, 8)
        with pytest.raises(GraphCaptureError, match=r"apply_staged_writes on graph-mode BlockTables.*already"):
            bt.apply_staged_writes()
        bt.gather_block_tables(idx, 2)  # the stage alone: allowed
    assert len(graph.launches) == 2 and len(bt.graph.recordings) == 1
    with simulated_capture() as other:
        bt.prepare_inputs(idx, qsl, pos, 2, 8)
    assert len(other.launches) == 2
    for step in range(3):
        bt.append_block_ids(step, ([step + 1], [], []), True)
        bt.commit_staged_writes()
        graph.replay()
    assert bt[0].tensor[:3, 0].tolist() == [1, 2, 3] and bt.graph.ring.missed == 0


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
    assert hits and m.bt.graph.ring.published == 1 and staged(m) == [3, 3, 3]
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
    fill(m, range(7), seed=3, twice=False)  # 1,001 values: the slot's first 1,024 hold them
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
