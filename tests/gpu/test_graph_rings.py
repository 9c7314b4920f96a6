"""Graph mode on a real GPU with full staging rings: big batches left in their slots by commits without a replay or by
an interrupted eager apply, behind a busy stream, land without a stall; a commit into a full header ring during a
capture raises without invalidating the capture."""

from __future__ import annotations

import warnings

import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite import GraphProtocolError, RingStallError, RingWaitWarning
from tests.gpu.captured import Captured, full_rows, mismatches
from tests.gpu.helpers import busy


def test_an_eager_big_apply_after_unreplayed_big_commits_waits_only_for_the_busy_stream(device, backend_name):
    """Seven commits of batches over 256 values (each left in its staging slot: every slot of the default eight but
    the arena's own) with no replay, behind 300 ms of device work; then an eager apply_staged_writes() of one more.
    It launches the consume kernel for the seven first, so its publish waits only for the stream: no
    RingWaitWarning, no RingStallError, and everything lands in commit order. The seven commits had no replay: the
    next commit raises GraphProtocolError once, and the commit and replay after it pair. Before, the publish waited
    for a slot no launch would free and gave up after 10 s with RingStallError naming commit_staged_writes."""
    c = Captured(device, backend_name, reqs=16)
    torch.cuda.synchronize(device)
    busy(0.3)
    for i in range(7):
        c.stage(full_rows(c, [i], seed=i))
        c.bt.commit_staged_writes()
    c.stage(full_rows(c, [7, 8], seed=7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        c.bt.apply_staged_writes()
    c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert mismatches(c.live(), c.expected()) == 0
    c.stage([(9, ([1], [2], [3]), True)])
    with pytest.raises(GraphProtocolError, match="commit 0 .counting commits from 0.*and the 6 commits after it") as e:
        c.bt.commit_staged_writes()
    assert e.value.commits_without_replay == 7 and [t.num_staged_writes for t in c.bt.block_tables] == [1, 1, 1]
    c.bt.commit_staged_writes()
    c.graph.replay()
    c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert mismatches(c.snapshot(), c.expected()) == 0 and mismatches(c.live(), c.expected()) == 0


@pytest.mark.parametrize("then", ["eager apply", "commit"])
def test_a_big_batch_lands_after_an_interrupted_eager_apply_on_two_slots_behind_a_busy_stream(
    device, backend_name, monkeypatch, then
):
    """Staging rings of two slots. Ctrl-C in the consume launch of an eager apply of a big batch leaves it published
    without a ticket, holding the other slot, behind 300 ms of device work. The next big batch needs that slot: an
    eager apply, or a commit (one launch, outside a capture), applies the stranded batch first and waits only for
    the stream; then everything lands, and the next step pairs. Before, both waited for a slot no launch would free
    (RingStallError after 10 s)."""
    c = Captured(device, backend_name, reqs=16, ring_depth=2)
    torch.cuda.synchronize(device)
    busy(0.3)
    c.stage(full_rows(c, [0], seed=1))
    from multiwrite.backends.triton.plan import TritonPlan  # (here: the room is collected where triton is absent)

    with monkeypatch.context() as patch:
        patch.setattr(TritonPlan, "consume", lambda self, *args: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            c.bt.apply_staged_writes()
    c.stage(full_rows(c, [1], seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        if then == "commit":
            c.bt.commit_staged_writes()
            c.graph.replay()
        else:
            c.bt.apply_staged_writes()
    c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert mismatches(c.live(), c.expected()) == 0
    if then == "commit":
        assert mismatches(c.snapshot(), c.expected()) == 0
    c.stage(full_rows(c, [2], seed=3))
    c.bt.commit_staged_writes()
    c.graph.replay()
    c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert mismatches(c.snapshot(), c.expected()) == 0
    assert (c.bt.graph.ring.missed, c.bt.graph.ring.extra) == (0, 0)


def test_a_commit_during_a_capture_into_a_full_ring_raises_without_invalidating_it(device, backend_name, monkeypatch):
    """A commit made while the current stream captures a graph, into a full header ring: RingWaitWarning, then
    RingStallError, without a device synchronization (which would invalidate the capture): the capture of the
    surrounding work completes and replays; nothing was committed."""
    monkeypatch.setattr(wait_module, "WAIT_WARN_S", 0.05)
    monkeypatch.setattr(wait_module, "WAIT_TIMEOUT_S", 0.3)
    c = Captured(device, backend_name, reqs=8)
    depth = c.bt.graph.ring.depth
    for step in range(depth):
        c.stage([(step % 8, ([step + 1], [step + 2], [step + 3]), True)])
        c.bt.commit_staged_writes()  # no replay: the header ring fills up
    c.stage([(1, ([9], [9], [9]), True)])
    syncs: list[int] = []  # device synchronizations asked for by the commit (torch.cuda.graph makes its own)
    inside: list[int] = []
    real_sync = torch.cuda.synchronize

    def sync(*args, **kwargs):
        if inside:
            syncs.append(1)  # (not run: it would invalidate the capture)
            return None
        return real_sync(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    marker = torch.zeros(4, device=device)
    g = torch.cuda.CUDAGraph()
    with pytest.warns(RingWaitWarning), pytest.raises(RingStallError, match="no device synchronization"):
        with torch.cuda.graph(g):
            marker.add_(1)
            inside.append(1)
            try:
                c.bt.commit_staged_writes()
            finally:
                inside.clear()
    monkeypatch.undo()
    assert syncs == [] and c.bt.graph.ring.published == depth
    g.replay()
    torch.cuda.synchronize(device)
    assert marker.tolist() == [1.0] * 4
