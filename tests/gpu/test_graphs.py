"""Graph mode on a real GPU (issue 10): `apply_staged_writes()` captured once in `torch.cuda.graph`, replayed
over the real trace with one `commit_staged_writes()` per step, checked against the reference.

Each captured graph also copies the tables and `num_blocks_device` into snapshot buffers right after the
apply, as an engine's gather would read them: a snapshot shows what THAT replay left, even when the host
has committed later steps before the replay ran.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.errors import GraphCaptureError
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import CONFIGS, load_trace, max_blocks_per_group, replay_steps

from .gpu_helpers import busy, gpu_backend

BLOCK_SIZES, KERNEL_BLOCK_SIZES = CONFIGS["G3"]


def _ring_wait_warning() -> type[Warning]:
    from multiwrite.backends.triton_kernel import RingWaitWarning

    return RingWaitWarning


class Captured:
    """A graph-mode BlockTables of G3 at concurrency `reqs`, its reference, and a graph that applies the
    next committed batch and snapshots the tables."""

    def __init__(self, device, backend_name: str, reqs: int = 40):
        widths = max_blocks_per_group(BLOCK_SIZES)
        self.bt = BlockTables(
            BLOCK_SIZES, reqs, widths, device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name), cuda_graphs=True
        )
        self.ref = ReferenceBlockTables(BLOCK_SIZES, reqs, widths, KERNEL_BLOCK_SIZES)
        self.snaps = [torch.empty_like(t.tensor) for t in self.bt.block_tables]
        self.snap_counts = torch.empty_like(self.bt.num_blocks_device)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.bt.apply_staged_writes()
            for s, t in zip(self.snaps, self.bt.block_tables):
                s.copy_(t.tensor)
            self.snap_counts.copy_(self.bt.num_blocks_device)
        torch.cuda.synchronize(device)
        assert self.bt._graph.published == 0 and self.bt._graph.consumed == 0  # capturing ran nothing

    def stage(self, calls) -> None:
        for req, ids, overwrite in calls:
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)

    def expected(self) -> tuple[list[np.ndarray], np.ndarray]:
        return [t.copy() for t in self.ref.tables], self.ref.num_blocks.copy()

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Copies of the snapshot buffers, taken in stream order after the last replay."""
        return [s.clone() for s in self.snaps], self.snap_counts.clone()


def _mismatches(got: tuple[list[torch.Tensor], torch.Tensor], want: tuple[list[np.ndarray], np.ndarray]) -> int:
    bad = sum(int(np.count_nonzero(g.cpu().numpy() != w)) for g, w in zip(got[0], want[0]))
    return bad + int(np.count_nonzero(got[1].cpu().numpy() != want[1]))


def _live(c: Captured) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [t.tensor for t in c.bt.block_tables], c.bt.num_blocks_device


def test_replays_of_the_real_trace_equal_the_reference(device, backend_name):
    """Capture once; 1,000 steps of the trace (G3, C=40), each: stage, commit, replay. The host is never
    synchronized between checkpoints, so it runs ahead of the replays (the ring throttles it)."""
    c = Captured(device, backend_name)
    checkpoints = {1, 2, 3, 50, 100, 250, 500, 750}
    steps = 0
    pending: list[tuple[int, tuple]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ring_wait_warning())
        for calls in replay_steps(load_trace(), BLOCK_SIZES, 40, 1000):
            c.stage(calls)
            c.bt.commit_staged_writes()
            c.graph.replay()
            steps += 1
            if steps in checkpoints:
                pending.append((steps, (c.snapshot(), c.expected())))  # compared after one synchronize
            c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert steps == 1000
    for step, (got, want) in pending:
        assert _mismatches(got, want) == 0, f"step {step}"
    final = c.expected()
    assert _mismatches(c.snapshot(), final) == 0 and _mismatches(_live(c), final) == 0
    np.testing.assert_array_equal(c.bt.num_blocks, c.ref.num_blocks)
    assert c.bt._graph.consumed == 1000 and c.bt._graph.idle_runs == 0


def test_a_replay_queued_behind_a_busy_stream_applies_only_its_own_step(device, backend_name):
    """The replay of step N waits behind 50 ms of device work while the host stages and commits step N+1 and
    queues its replay: replay N must still apply step N only (its snapshot), replay N+1 then step N+1."""
    c = Captured(device, backend_name)
    steps = replay_steps(load_trace(), BLOCK_SIZES, 40, 60)
    for i, calls in enumerate(steps):
        if i < 50:  # get past the first prefills: rows are reused by new requests (overwrites)
            c.stage(calls)
            c.bt.commit_staged_writes()
            c.graph.replay()
            c.ref.apply_staged_writes()
            continue
        busy(0.05)
        c.stage(calls)
        c.bt.commit_staged_writes()
        c.graph.replay()
        snap_n = c.snapshot()  # queued behind the replay of step N
        want_n = c.expected()
        c.ref.apply_staged_writes()
        assert c.bt._graph.consumed < c.bt._graph.published  # the replay has not run yet
        nxt = next(steps, None)
        if nxt is None:
            break
        c.stage(nxt)
        c.bt.commit_staged_writes()  # while replay N still waits
        c.graph.replay()
        snap_n1, want_n1 = c.snapshot(), c.expected()
        c.ref.apply_staged_writes()
        torch.cuda.synchronize(device)
        assert _mismatches(snap_n, want_n) == 0, f"step {i}: the replay applied more (or less) than its own step"
        assert _mismatches(snap_n1, want_n1) == 0, f"step {i + 1}"
    assert c.bt._graph.idle_runs == 0


def test_eager_applies_interleave_with_replays(device, backend_name):
    """Steps with more than 256 values (prefill bursts) applied eagerly outside the graph, the others by
    replays, 300 steps; plus replays with nothing committed after an eager apply (no-ops)."""
    c = Captured(device, backend_name)
    eager = replays = 0
    for step, calls in enumerate(replay_steps(load_trace(), BLOCK_SIZES, 40, 300)):
        c.stage(calls)
        if c.bt._arena.num_values > 256:
            c.bt.apply_staged_writes()
            eager += 1
            if step % 3 == 0:
                c.graph.replay()  # nothing committed since: applies nothing, snapshots the eager result
        else:
            c.bt.commit_staged_writes()
            c.graph.replay()
            replays += 1
        c.ref.apply_staged_writes()
        if step % 50 == 49:
            torch.cuda.synchronize(device)
            assert _mismatches(_live(c), c.expected()) == 0, f"step {step}"
    torch.cuda.synchronize(device)
    assert eager > 5 and replays > 100
    assert _mismatches(_live(c), c.expected()) == 0
    np.testing.assert_array_equal(c.bt.num_blocks, c.ref.num_blocks)


def test_capture_without_the_flag_is_refused_naming_it(device, backend_name):
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name))
    bt.append_block_ids(0, ([1], [2], [3]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([4], [5], [6]), True)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match=r"cuda_graphs=True"):
        with torch.cuda.graph(g):
            bt.apply_staged_writes()
    assert bt._arena.num_writes == 4  # still staged
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert bt[2].tensor[1, 0].item() == 6


def test_one_graph_replayed_from_two_tables_objects_is_independent(device, backend_name):
    """Two graph-mode BlockTables captured in one graph: each replay consumes one batch of each."""
    widths = [20, 10, 40]
    backend = gpu_backend(backend_name)
    a = BlockTables(BLOCK_SIZES, 8, widths, device, KERNEL_BLOCK_SIZES, backend=backend, cuda_graphs=True)
    b = BlockTables(BLOCK_SIZES, 8, widths, device, KERNEL_BLOCK_SIZES, backend=backend, cuda_graphs=True)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a.apply_staged_writes()
        b.apply_staged_writes()
    for step in range(20):
        a.append_block_ids(step % 8, ([step + 1], [step + 2], [step + 3]), True)
        a.commit_staged_writes()
        b.commit_staged_writes()  # empty, except for what step 1, 5, 9 staged below
        if step in (1, 5, 9):
            b.append_block_ids(step % 8, ([step + 7], [], []), True)
        g.replay()
    torch.cuda.synchronize(device)
    assert a._graph.consumed == 20 and a[0].tensor[:, 0].tolist() == [17, 18, 19, 20, 13, 14, 15, 16]
    assert b._graph.consumed == 20 and b[0].tensor[:, 0].tolist() == [0, 16, 0, 0, 0, 12, 0, 0]
    b.append_block_ids(2, ([30], [], []), True)
    b.apply_staged_writes()  # eager: commits and applies
    torch.cuda.synchronize(device)
    assert b._graph.consumed == 21 and b[0].tensor[2, 0].item() == 30
