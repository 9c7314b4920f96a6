"""Graph mode's compiled commit (`multiwrite.staging.headers.CommitEntry`): `commit_staged_writes` in its common case
is one C call, the preamble's checks and the ring's in front of the publish; anything else takes the one Python path
(`GraphMode.commit`), which checks in full. Both publish the same header: what lands is checked against the model."""

from __future__ import annotations

import pytest
import torch

from multiwrite import TableMovedError
from multiwrite.tables.graph import GraphMode
from multiwrite.tables.mode import ADDRESS_CHECK_PERIOD
from tests.graph.model import WIDE, GraphModel, fill, staged


@pytest.fixture
def python_commits(monkeypatch):
    """The commits that took the Python path (`GraphMode.commit`), counted."""
    calls = []
    original = GraphMode.commit

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(GraphMode, "commit", counted)
    return calls


def test_a_decode_sized_commit_is_one_compiled_call_and_the_rest_takes_the_python_path(python_commits):
    m = GraphModel(widths=WIDE)
    for step in range(5):  # decode-sized batches (and one empty commit): the compiled call publishes them
        if step != 3:
            m.stage(step % 6, ([step + 1], [step + 2], [step + 3]), step % 2 == 0)
        m.commit()
        m.replay()
        m.check(f"step {step}")
    assert python_commits == []
    fill(m, range(3), seed=1)  # the first row twice: two rounds, which the compiled call leaves to the Python path
    m.commit()
    assert len(python_commits) == 1
    m.replay()
    m.check("the batch of two rounds")
    m.stage(4, ([7], [8], [9]), False)
    m.commit()  # and the next decode-sized one is compiled again
    m.replay()
    m.check("after it")
    assert len(python_commits) == 1


def test_a_mis_pairing_is_reported_by_the_python_path_then_commits_are_compiled_again(python_commits):
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.replay()
    m.replay()  # a replay without its commit: the next commit reports it
    m.stage(1, ([4], [5], [6]), True)
    m.expect_report()
    assert len(python_commits) == 1 and staged(m) == [1, 1, 1]
    m.commit()
    m.replay()
    m.check("the commit after the report")
    assert len(python_commits) == 1


def test_the_compiled_commit_counts_down_to_the_address_check_like_every_call():
    """Each commit the compiled call takes is one call of the preamble: a table re-pointed with `tensor.data = ...`
    (its version counter unchanged) is found by the ADDRESS_CHECK_PERIOD-th commit after the last check, not later
    (a compiled commit that did not count would never find it) and not earlier."""
    m = GraphModel()
    m.bt.refresh_layout()  # checks the addresses: the countdown starts again
    t = m.bt[0].tensor
    saved = t.data
    t.data = torch.full_like(t, 7)
    for call in range(1, ADDRESS_CHECK_PERIOD):
        m.stage(call % 6, ([call], [call + 1], [call + 2]), True)
        m.commit()
        m.replay()
    m.stage(5, ([1], [2], [3]), False)
    published = m.bt.graph.ring.published
    with pytest.raises(TableMovedError, match="group 0 of a BlockTables was re-pointed"):
        m.bt.commit_staged_writes()
    assert m.bt.graph.ring.published == published and staged(m) == [1, 1, 1]  # nothing committed
    t.data = saved
    m.commit()
    m.replay()
    m.check("after it points back")
