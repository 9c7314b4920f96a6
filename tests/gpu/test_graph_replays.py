"""Graph mode on a real GPU: `apply_staged_writes()` captured once in `torch.cuda.graph`, replayed over the real trace
with one `commit_staged_writes()` per step, replays queued behind busy streams, eager steps between replays, checked
against the reference (the snapshots of `tests.gpu.captured.Captured`)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from multiwrite import BlockTables, RingWaitWarning
from multiwrite.workload import load_trace, replay_steps
from tests.gpu.captured import BLOCK_SIZES, KERNEL_BLOCK_SIZES, Captured, mismatches, values_of
from tests.gpu.helpers import busy, gpu_backend


def test_replays_of_the_real_trace_equal_the_reference(device, backend_name):
    """Capture once; 1,000 steps of the trace (G3, C=40), each: stage, commit, replay. The host is never synchronized
    between checkpoints: it runs ahead of the replays (the rings throttle it, without a warning)."""
    c = Captured(device, backend_name)
    checkpoints = {1, 2, 3, 50, 100, 250, 500, 750}
    steps = 0
    pending = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for calls in replay_steps(load_trace(), BLOCK_SIZES, 40, 1000):
            c.stage(calls)
            c.bt.commit_staged_writes()
            c.graph.replay()
            steps += 1
            if steps in checkpoints:
                pending.append((steps, c.snapshot(), c.expected()))  # compared after one synchronize
            c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert steps == 1000
    for step, got, want in pending:
        assert mismatches(got, want) == 0, f"step {step}"
    final = c.expected()
    assert mismatches(c.snapshot(), final) == 0 and mismatches(c.live(), final) == 0
    np.testing.assert_array_equal(c.bt.num_blocks, c.ref.num_blocks)
    ring = c.bt.graph.ring
    assert (ring.runs, ring.applied, ring.idle_runs) == (1000, 1000, 0)


def test_a_replay_queued_behind_a_busy_stream_applies_only_its_own_step(device, backend_name):
    """Replay N waits behind 50 ms of device work while the host stages and commits step N+1 and queues its replay:
    replay N must apply step N only (its snapshot), replay N+1 step N+1."""
    c = Captured(device, backend_name)
    steps = replay_steps(load_trace(), BLOCK_SIZES, 40, 60)
    for i, calls in enumerate(steps):
        if i < 50:  # past the first prefills: rows are freed and reused by new requests (overwrites)
            c.stage(calls)
            c.bt.commit_staged_writes()
            c.graph.replay()
            c.ref.apply_staged_writes()
            continue
        torch.cuda.synchronize(device)
        busy(0.05)
        c.stage(calls)
        c.bt.commit_staged_writes()
        c.graph.replay()
        snap_n, want_n = c.snapshot(), c.expected()  # queued behind replay N
        c.ref.apply_staged_writes()
        assert not torch.cuda.current_stream(device).query(), "replay N ran too early for this test to mean anything"
        nxt = next(steps, None)
        if nxt is None:
            break
        c.stage(nxt)
        c.bt.commit_staged_writes()  # while replay N still waits
        c.graph.replay()
        snap_n1, want_n1 = c.snapshot(), c.expected()
        c.ref.apply_staged_writes()
        torch.cuda.synchronize(device)
        assert mismatches(snap_n, want_n) == 0, f"step {i}: replay N applied more (or less) than its own step"
        assert mismatches(snap_n1, want_n1) == 0, f"step {i + 1}"
    assert c.bt.graph.ring.idle_runs == 0


def test_eager_applies_interleave_with_replays(device, backend_name):
    """Steps of more than 256 values (prefill bursts) applied eagerly outside the graph, the others by replays, 300
    steps; after some eager applies a replay too, of an empty commit (it applies nothing)."""
    c = Captured(device, backend_name)
    eager = replays = 0
    for step, calls in enumerate(replay_steps(load_trace(), BLOCK_SIZES, 40, 300)):
        c.stage(calls)
        if values_of(calls) > 256:
            c.bt.apply_staged_writes()
            eager += 1
            if step % 3 == 0:
                c.bt.commit_staged_writes()  # an empty commit: its replay applies nothing, reads the eager result
                c.graph.replay()
        else:
            c.bt.commit_staged_writes()
            c.graph.replay()
            replays += 1
        c.ref.apply_staged_writes()
        if step % 50 == 49:
            torch.cuda.synchronize(device)
            assert mismatches(c.live(), c.expected()) == 0, f"step {step}"
            assert mismatches(c.snapshot(), c.expected()) == 0 or values_of(calls) > 256, f"step {step}"
    torch.cuda.synchronize(device)
    assert eager > 5 and replays > 100
    assert mismatches(c.live(), c.expected()) == 0
    np.testing.assert_array_equal(c.bt.num_blocks, c.ref.num_blocks)


def test_a_late_replay_with_an_eager_apply_queued_after_it_applies_only_its_own_step(device, backend_name):
    """The protocol's first fault, for real, on one stream: step 2's replay waits behind 200 ms of device work; the host
    queues an eager apply_staged_writes() after it (nothing staged: it applies what is published), stages and commits
    step 3, which frees row 1 and gives it to a new request, and queues step 3's replay. Step 2's replay must show
    step 2 (ticket 1: step 3 is not its batch), step 3's replay step 3; the eager call found every commit replayed
    (no GraphProtocolError). (An earlier design applied step 3 in step 2's replay.)"""
    c = Captured(device, backend_name, reqs=8)
    c.stage([(0, ([1, 2], [3], [4]), True), (1, ([5, 6], [7], [8, 9]), True)])
    c.bt.commit_staged_writes()
    c.graph.replay()
    c.ref.apply_staged_writes()
    torch.cuda.synchronize(device)
    c.stage([(1, ([10], [], [11]), False)])  # step 2
    c.bt.commit_staged_writes()
    c.ref.apply_staged_writes()
    want2 = c.expected()
    busy(0.2)
    c.graph.replay()  # step 2's replay, behind 200 ms of work
    snap2 = c.snapshot()
    c.bt.apply_staged_writes()  # eager, queued after step 2's replay
    c.stage([(1, ([], [], []), True), (1, ([20], [21], [22]), True)])  # step 3: row 1 freed and reused
    c.bt.commit_staged_writes()
    c.ref.apply_staged_writes()
    assert not torch.cuda.current_stream(device).query(), "step 2's replay ran before the commit of step 3"
    c.graph.replay()  # step 3's replay
    snap3 = c.snapshot()
    torch.cuda.synchronize(device)
    assert mismatches(snap2, want2) == 0, "step 2's late replay applied step 3"
    assert mismatches(snap3, c.expected()) == 0 and c.bt[0].tensor[1, 0].item() == 20
    ring = c.bt.graph.ring
    assert (ring.missed, ring.extra, ring.runs, ring.tickets_published) == (0, 0, 3, 3)
    c.bt.commit_staged_writes()  # no mis-pairing to report
    c.graph.replay()


def test_one_graph_replayed_from_two_tables_objects_is_independent(device, backend_name):
    """Two graph-mode BlockTables captured in one graph: each replay applies the batch of one commit of each."""
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
        b.commit_staged_writes()  # empty, except for what steps 1, 5, 9 staged below
        if step in (1, 5, 9):
            b.append_block_ids(step % 8, ([step + 7], [], []), True)
        g.replay()
    torch.cuda.synchronize(device)
    assert a[0].tensor[:, 0].tolist() == [17, 18, 19, 20, 13, 14, 15, 16]
    assert b[0].tensor[:, 0].tolist() == [0, 16, 0, 0, 0, 12, 0, 0]
    assert a.graph.ring.applied == 20 and b.graph.ring.applied == 20
    b.append_block_ids(2, ([30], [], []), True)
    b.apply_staged_writes()  # eager: publishes and applies
    torch.cuda.synchronize(device)
    assert b[0].tensor[2, 0].item() == 30


def test_a_replay_applies_a_batch_of_65537_overlap_rounds_in_staging_order(device, backend_name):
    """65,537 writes to one cell, committed and replayed: the last write wins. A header layout with the INLINE flag
    inside the rounds' bits read 65,536 rounds as an inline batch of none, and 65,537 as a single round."""
    bt = BlockTables([16], 2, [4], device, [16], backend=gpu_backend(backend_name), cuda_graphs=True)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph):
        bt.apply_staged_writes()
    table = bt.block_tables[0]
    for i in range((1 << 16) + 1):
        table.stage_write(0, 1, [i + 1])
    table.stage_write(1, 0, [7])
    bt.commit_staged_writes()
    graph.replay()
    torch.cuda.synchronize(device)
    assert table.tensor[0].tolist() == [0, (1 << 16) + 1, 0, 0] and table.tensor[1].tolist() == [7, 0, 0, 0]
    assert bt.graph.ring.applied == 1
