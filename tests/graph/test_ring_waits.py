"""A graph-mode commit that finds its rings full of what no replay has applied waits: `RingWaitWarning` after
`multiwrite.staging.wait.WAIT_WARN_S` (1 s), `RingStallError` after `WAIT_TIMEOUT_S` (10 s) with nothing committed;
never a silent reuse. The thresholds are module constants read at each wait: tests shrink them."""

from __future__ import annotations

import threading
import warnings

import pytest

import multiwrite.staging.wait as wait_module
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
                 "commit once before each replay"):  # fmt: skip
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
    assert m.bt.graph.ring.published == 1 and staged(m) == [2, 2, 2]
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
