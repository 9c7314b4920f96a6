"""A graph-mode commit that finds its rings full of what no replay has applied waits: `RingWaitWarning` after
`multiwrite.staging.wait.WAIT_WARN_S` (1 s), `RingStallError` after `WAIT_TIMEOUT_S` (10 s) with nothing committed;
never a silent reuse. The thresholds are module constants read at each wait: tests shrink them."""

from __future__ import annotations

import functools
import threading
import warnings

import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.plan import TritonPlan
from multiwrite.errors import RingStallError, RingWaitWarning
from tests.graph.model import WIDE, GraphModel, fill, retry_after_a_replay, staged, two_unapplied_commits


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.05)
    monkeypatch.setattr(wait_module, "WAIT_TIMEOUT_S", 0.3)


def test_the_documented_thresholds():
    assert (wait_module.WAIT_WARN_S, wait_module.WAIT_TIMEOUT_S) == (1.0, 10.0)


def test_a_full_header_ring_warns_then_raises_and_commits_nothing(short_waits):
    m = two_unapplied_commits()
    with pytest.warns(RingWaitWarning) as caught, pytest.raises(RingStallError) as info:
        m.bt.commit_staged_writes()
    warning = str(caught[0].message)
    for part in ("commit_staged_writes (header 2) has waited 0.", "header ring (2 entries)",
                 "2 published batches are not applied", "2 tickets wait for their replay",
                 "commit once right before each replay"):  # fmt: skip
        assert part in warning, part
    assert "gave up after 0." in str(info.value)
    assert m.bt.graph.ring.published == 2 and staged(m) == [1, 1, 1]
    retry_after_a_replay(m)


def test_the_stall_of_a_commit_says_nothing_was_committed_and_that_a_replay_is_due(short_waits):
    m = two_unapplied_commits()
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError) as entry:
        m.bt.commit_staged_writes()
    s = GraphModel(ring_depth=2, reqs=8, widths=WIDE)
    fill(s, [0, 1], seed=1)
    s.commit()
    fill(s, [2, 3], seed=2)
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError) as slot:
        s.bt.commit_staged_writes()
    for info in (entry, slot):
        assert "Nothing was committed; the staged writes stay staged" in str(info.value)
        assert "replay" in str(info.value)


def test_a_batch_left_in_its_slot_waits_for_the_replay_that_frees_the_next_slot(short_waits):
    """With two staging slots, a batch that stays in its slot is committed once the other slot's batch has been
    applied: before that the commit warns, then raises having committed nothing."""
    m = GraphModel(ring_depth=2, reqs=8, widths=WIDE)
    fill(m, [0, 1], seed=1)
    m.commit()
    fill(m, [2, 3], seed=2)
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError, match=r"staged writes stay staged"):
        m.bt.commit_staged_writes()
    assert m.bt.graph.ring.published == 1 and staged(m) == [3, 3, 3]
    m.replay()
    m.commit()
    m.replay()
    m.check()


def test_a_commit_waits_for_a_late_replay_with_one_warning(monkeypatch):
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.05)
    m = two_unapplied_commits()
    late = threading.Timer(0.3, m.graph.replay)  # the replay runs while the commit waits
    late.start()
    try:
        with pytest.warns(RingWaitWarning) as caught:
            h = m.bt.commit_staged_writes()
    finally:
        late.join()
    assert len([c for c in caught if issubclass(c.category, RingWaitWarning)]) == 1
    m.replayed()
    m.committed(h)
    m.check("the late replay")
    m.replay()
    m.replay()
    m.check("the waiting commit's batch")


def test_an_eager_apply_into_a_full_ring_applies_the_published_batches_first_and_never_waits():
    m = two_unapplied_commits()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        m.eager_apply()
    m.check()
    assert m.bt[0].tensor[:3, 0].tolist() == [1, 4, 7]


def test_a_commit_and_replay_loop_on_the_smallest_rings_never_waits():
    m = GraphModel(ring_depth=2, reqs=8, widths=WIDE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for step in range(6):
            if step % 2:
                fill(m, [step % 8, (step + 1) % 8], seed=step)  # left in its slot
            else:
                m.stage(step % 8, ([step + 1], [step + 2], []), True)  # inline
            m.commit()
            m.replay()
            m.check(f"step {step}")


# -- an eager apply applies what is published first, so that its own publish never waits for a replay --------------
def big_commits(m: GraphModel, n: int) -> None:
    """`n` commits of two full rows each, the first twice (batches left in their staging slots), none replayed."""
    for i in range(n):
        fill(m, [2 * i % 8, (2 * i + 1) % 8], seed=i)
        m.commit()


@pytest.mark.parametrize(("depth", "published"), [(8, 7), (2, 1)])
def test_an_eager_apply_of_a_big_batch_after_unreplayed_big_commits_never_waits(short_waits, depth, published):
    """Staging rings of 8 and 2 slots: every slot but the arena's own holds a committed batch no replay has run
    (7, 1). An eager apply of a batch left in its slot needs the next slot for the arena: it applies the
    published batches first, so it never waits, and lands them and its own in order. (Those commits had no replay
    issued before the eager call: the next commit reports it.) Before, the publish waited for the slot, which only
    a replay could free, and raised RingStallError naming commit_staged_writes."""
    m = GraphModel(ring_depth=depth, reqs=8, widths=WIDE)
    big_commits(m, published)
    fill(m, [6, 7], seed=99)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        m.eager_apply()
    m.check("the eager apply")
    assert m.expect_report().commits_without_replay == published
    fill(m, [0, 5], seed=100)
    m.commit()
    m.replay()
    m.check("paired again")


@pytest.mark.parametrize("then", ["eager apply", "commit"])
def test_a_big_batch_lands_after_an_interrupted_eager_apply_on_a_ring_of_two_slots(short_waits, then):
    """Ctrl-C in the consume launch of an eager apply leaves its big batch published, unapplied and without a ticket,
    in one of the two slots; the arena stages into the other. The next big batch needs that slot: an eager apply
    applies the stranded batch first; so does a commit (one launch, outside a capture). Both then land exactly.
    Before, both waited for the slot (which no replay would free) and raised RingStallError."""
    m = GraphModel(ring_depth=2, reqs=8, widths=WIDE)
    fill(m, [0, 1], seed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Launcher, "_interpret", lambda self, *args: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            m.bt.apply_staged_writes()
    m.published_eagerly()
    fill(m, [2, 3], seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        if then == "commit":
            m.eager_run()  # (what the commit's launch applies: header 0)
            m.commit()
            m.check("the commit")
            m.replay()
        else:
            m.eager_apply()
    m.check(then)
    fill(m, [4, 5], seed=3)
    m.commit()
    m.replay()
    m.check("the next step")


def test_the_stall_of_an_eager_call_names_it_and_never_prints_a_negative_count(short_waits, monkeypatch):
    """The eager consume launches queued behind a held-up stream (here: kept in a list until the test runs them):
    an eager apply_staged_writes() or prepare_inputs() whose publish waits for a slot a published batch holds gives
    up naming ITSELF, says nothing of it was published, and, after three replays without commits, says that more
    replays ran than commits were made instead of a negative ticket count. Before, it named commit_staged_writes and
    printed "-3 tickets wait for their replay". Once the stream runs, everything lands."""
    m = GraphModel(ring_depth=2, reqs=8, widths=WIDE, max_num_batched_tokens=8)
    for _ in range(3):
        m.replay()
    m.expect_report()
    queued: list = []
    real = TritonPlan.consume
    monkeypatch.setattr(TritonPlan, "consume", lambda self, *a: queued.append(functools.partial(real, self, *a)))
    fill(m, [0, 1], seed=1)
    m.bt.apply_staged_writes()  # published; its consume launch is queued
    m.published_eagerly()
    fill(m, [2, 3], seed=2)
    idx, qsl, pos = torch.tensor([2]), torch.tensor([0, 1]), torch.tensor([0])
    for call, run in (("apply_staged_writes", m.bt.apply_staged_writes),
                      ("prepare_inputs", lambda: m.bt.prepare_inputs(idx, qsl, pos, 1, 1))):  # fmt: skip
        with pytest.warns(RingWaitWarning), pytest.raises(RingStallError) as info:
            run()
        message = str(info.value)
        assert message.startswith(f"{call} (header 1) gave up after 0."), message
        for part in ("no ticket waits for its replay (3 more replays have run than commits were made",
                     f"{call}() has launched the consume kernel", "Nothing of this call was published"):  # fmt: skip
            assert part in message, part
        assert "commit_staged_writes" not in message and "-3" not in message, message
        assert m.bt.graph.ring.published == 1 and staged(m) == [3, 3, 3]
    monkeypatch.undo()
    for launch in queued:  # the stream runs
        launch()
    m.eager_run()
    m.check("the queued launch")
    m.eager_apply()
    m.check("the eager apply, again")


@pytest.mark.parametrize("depth", [2, 8])
def test_batches_that_outgrow_their_staging_slot_are_waited_for_on_the_grown_memory(short_waits, depth):
    """A batch larger than its slot's memory (8 full rows: 1144 values, over the 1024 a slot starts with) grows the
    arena's lease; the consume kernel that reads it stores its token into the slot's word, and the next time round
    the ring must wait on the grown memory's token, not on the memory it replaced. (On the H200, before the fix,
    the ring kept its record of the replaced memory: every later commit that needed that slot stalled for 10 s
    although the batch had long been applied.)"""
    m = GraphModel(ring_depth=depth, reqs=8, widths=WIDE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for step in range(2 * depth + 1):
            fill(m, range(8), seed=step, twice=False)
            m.commit()
            m.replay()
            m.check(f"step {step}")
