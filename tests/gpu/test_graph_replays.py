"""Graph mode on a real GPU: `apply_staged_writes()` (and `prepare_inputs`) captured once in `torch.cuda.graph`,
replayed over the real trace with one `commit_staged_writes()` per step, replays queued behind busy streams, eager steps
between replays, checked against the reference.

Each captured apply graph also copies the tables and `num_blocks_device` into snapshot buffers right after the apply,
as an engine's model step would read them: a snapshot shows what THAT replay left, even when the host has committed
later steps before the replay ran.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import multiwrite.staging.wait as wait_module
from multiwrite import (
    BlockTables,
    GraphCaptureError,
    GraphProtocolError,
    RingStallError,
    RingWaitWarning,
    StageInputError,
)
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import CONFIGS, TOKEN_BUDGET, load_trace, max_blocks_per_group, replay_schedule, replay_steps
from tests.gpu.helpers import busy, gpu_backend

BLOCK_SIZES, KERNEL_BLOCK_SIZES = CONFIGS["G3"]


class Captured:
    """A graph-mode BlockTables of G3 at concurrency `reqs` (on a fresh backend: `backend_kw`, e.g. `ring_depth=2`), its
    reference, and a graph that applies the batch of its commit and snapshots the tables."""

    def __init__(self, device, backend_name: str, reqs: int = 40, **backend_kw):
        widths = self.widths = max_blocks_per_group(BLOCK_SIZES)
        self.bt = BlockTables(BLOCK_SIZES, reqs, widths, device, KERNEL_BLOCK_SIZES,
                              backend=gpu_backend(backend_name, **backend_kw), cuda_graphs=True)  # fmt: skip
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
        ring = self.bt.graph.ring
        assert (ring.published, ring.runs) == (0, 0) and not self.bt[0].tensor.any()  # the capture ran nothing

    def stage(self, calls) -> None:
        for req, ids, overwrite in calls:
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)

    def expected(self) -> tuple[list[np.ndarray], np.ndarray]:
        return [t.copy() for t in self.ref.tables], self.ref.num_blocks.copy()

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Copies of the snapshot buffers, taken in stream order after the last replay."""
        return [s.clone() for s in self.snaps], self.snap_counts.clone()

    def live(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t.tensor for t in self.bt.block_tables], self.bt.num_blocks_device


def mismatches(got: tuple[list[torch.Tensor], torch.Tensor], want: tuple[list[np.ndarray], np.ndarray]) -> int:
    bad = sum(int(np.count_nonzero(g.cpu().numpy() != w)) for g, w in zip(got[0], want[0]))
    return bad + int(np.count_nonzero(got[1].cpu().numpy() != want[1]))


def values_of(calls, k=(1, 2, 1)) -> int:
    """Values a step's calls stage (kernel block ids and the counts rows)."""
    return sum(sum(len(ids) * kk for ids, kk in zip(groups, k)) + len(groups) for _, groups, _ in calls)


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


def full_rows(c: Captured, rows, seed: int) -> list:
    """Calls that overwrite `rows` with fresh ids over their whole width: more than 256 values, a batch that stays in
    its staging slot."""
    rng = np.random.default_rng(seed)
    calls = [(r, [rng.integers(1, 100_000, w).tolist() for w in c.widths], True) for r in rows]
    assert values_of(calls) > 256
    return calls


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


def test_a_second_consume_launch_in_one_capture_is_refused(device, backend_name):
    """apply_staged_writes() and then prepare_inputs() in one torch.cuda.graph capture: the second consume launch is
    refused (GraphCaptureError, found by the driver's capture id), the capture completes, and its replays pair one to
    one with the commits; a second capture records its own consume launch."""
    if torch.version.hip is not None:
        pytest.skip("the capture id is read on NVIDIA only (cuStreamGetCaptureInfo)")
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name),
                     cuda_graphs=True, max_num_batched_tokens=64)  # fmt: skip
    idx = torch.zeros(8, dtype=torch.int32, device=device)
    qsl, pos = torch.zeros(9, dtype=torch.int32, device=device), torch.zeros(64, dtype=torch.int64, device=device)
    bt.prepare_inputs(idx, qsl, pos, 8, 64)  # warm-up
    torch.cuda.synchronize(device)
    g, other = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        bt.apply_staged_writes()
        with pytest.raises(GraphCaptureError, match="already recorded their consume launch"):
            bt.prepare_inputs(idx, qsl, pos, 8, 64)
    with torch.cuda.graph(other):
        bt.prepare_inputs(idx, qsl, pos, 8, 64)
    torch.cuda.synchronize(device)
    for step in range(4):
        bt.append_block_ids(step, ([step + 1], [], []), True)
        bt.commit_staged_writes()
        (g if step % 2 else other).replay()
    torch.cuda.synchronize(device)
    assert bt[0].tensor[:4, 0].tolist() == [1, 2, 3, 4]
    assert (bt.graph.ring.runs, bt.graph.ring.missed, bt.graph.ring.idle_runs) == (4, 0, 0)


def test_a_capture_without_the_flag_is_refused_naming_it(device, backend_name):
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name))
    bt.append_block_ids(0, ([1], [2], [3]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([4], [5], [6]), True)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match=r"cuda_graphs=True"):
        with torch.cuda.graph(g):
            bt.apply_staged_writes()
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert bt[2].tensor[1, 0].item() == 6


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


# -- prepare_inputs captured (apply + gather + slot mappings in the graph) ---------------------------------------
class CapturedStep:
    """A graph-mode BlockTables of G3 with `reqs` rows, and a graph that captured `prepare_inputs` once over persistent
    device input buffers sized for the padded bucket: `reqs` batch entries (a step's unused ones name row 0 with zero
    tokens) and TOKEN_BUDGET tokens (`is_padding` marks the unscheduled ones). `pdl`: the stage kernel is recorded as
    the programmatic dependent launch of the consume kernel (`TritonPlan.pdl`; skipped where the GPU cannot) or as a
    plain launch after it."""

    def __init__(self, device, backend_name: str, reqs: int = 40, pdl: bool = True):
        widths = max_blocks_per_group(BLOCK_SIZES)
        self.reqs, self.device = reqs, device
        self.bt = BlockTables(BLOCK_SIZES, reqs, widths, device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name),
                              cuda_graphs=True, max_num_batched_tokens=TOKEN_BUDGET)  # fmt: skip
        plan = self.bt.graph.plan
        if pdl and not plan.pdl:
            pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or newer")
        plan.pdl = pdl  # white-box: the plan's switch, read at each capture
        self.ref = ReferenceBlockTables(BLOCK_SIZES, reqs, widths, KERNEL_BLOCK_SIZES)
        self.idx = torch.zeros(reqs, dtype=torch.int32, device=device)
        self.qsl = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.pos = torch.zeros(TOKEN_BUDGET, dtype=torch.int64, device=device)
        self.pad = torch.ones(TOKEN_BUDGET, dtype=torch.bool, device=device)
        args = (self.idx, self.qsl, self.pos, reqs, TOKEN_BUDGET, self.pad)
        self.bt.prepare_inputs(*args)  # the eager warm-up: compiles the kernels for these buffers (no replay's run)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.gathered, self.slots = self.bt.prepare_inputs(*args)
        torch.cuda.synchronize(device)
        self._pinned: list[torch.Tensor] = []  # host copies of queued inputs, alive until the next synchronize

    def stage(self, calls) -> None:
        for req, ids, overwrite in calls:
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)

    def load(self, step):
        """Write the step's inputs into the device buffers (asynchronously, in stream order, from pinned copies: the
        host never waits for earlier replays). Returns them as lists, and the real entry count."""
        n = len(step.rows)
        idx = list(step.rows) + [0] * (self.reqs - n)
        tokens = list(step.tokens) + [0] * (self.reqs - n)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        T = int(qsl[-1])
        pos = np.zeros(TOKEN_BUDGET, dtype=np.int64)
        pos[:T] = np.concatenate([np.arange(s, s + t) for s, t in zip(step.starts, step.tokens)] or [np.zeros(0)])
        pad = np.arange(TOKEN_BUDGET) >= T
        for buf, host in ((self.idx, np.asarray(idx, dtype=np.int32)), (self.qsl, qsl.astype(np.int32)),
                          (self.pos, pos), (self.pad, pad)):  # fmt: skip
            pinned = torch.from_numpy(host).pin_memory()
            buf.copy_(pinned, non_blocking=True)
            self._pinned.append(pinned)
        return idx, qsl.tolist(), pos[:T].tolist(), pad.tolist(), n

    def expected(self, inputs):
        """The reference's gathered rows (-7 where the step defines no cell) and slot mappings for `inputs`."""
        idx, qsl, pos, pad, _ = inputs
        zero = [np.zeros(t.shape, dtype=np.int64) for t in self.ref.tables]
        gathered = gather_block_tables_reference(self.ref.tables, self.ref.num_blocks, idx, self.reqs, zero)
        slots = compute_slot_mappings_reference(self.ref.tables, KERNEL_BLOCK_SIZES, idx, qsl, pos, TOKEN_BUDGET, pad)
        counts = [self.ref.num_blocks[g, idx] for g in range(len(BLOCK_SIZES))]
        return [np.where(np.arange(w.shape[1])[None, :] < c[:, None], w, -7) for w, c in zip(gathered, counts)], slots

    def outputs(self):
        """Copies of the outputs, taken in stream order after the last replay."""
        return [t.clone() for t in self.gathered], self.slots.clone()


def stage_mismatch(got, want, n: int) -> str:
    """An empty string when the gathered cells the step defines (entries < n, columns < num_blocks) and every slot
    equal the reference, else the first difference."""
    for g, (a, w) in enumerate(zip(got[0], want[0])):
        a = a.cpu().numpy()[:n]
        bad = np.argwhere((w[:n] != -7) & (a != w[:n]))
        if bad.size:
            b, col = (int(i) for i in bad[0])
            return f"group {g} gathered[{b}, {col}] = {a[b, col]}, reference {w[b, col]}"
    s = got[1].cpu().numpy()
    bad = np.argwhere(s != want[1])
    if bad.size:
        g, i = (int(v) for v in bad[0])
        return f"slot_mappings[{g}, {i}] = {s[g, i]}, reference {want[1][g, i]}"
    return ""


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_a_captured_prepare_inputs_over_the_real_trace_equals_the_reference(device, backend_name, pdl):
    """prepare_inputs captured once (padded bucket: 40 entries, 8,192 tokens); 500 steps of the trace (G3, C=40), each:
    stage, commit, write the step's inputs into the buffers, replay: every step's defined gathered cells and all its
    slot mappings equal the reference. With PDL the stage kernel starts while the consume kernel lands the step's
    writes: a stage that read the tables before `griddepcontrol.wait` would see the last step's."""
    c = CapturedStep(device, backend_name, pdl=pdl)
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for step in replay_schedule(load_trace(), BLOCK_SIZES, 40, 500):
            c.stage(step.calls)
            c.bt.commit_staged_writes()
            c.ref.apply_staged_writes()
            inputs = c.load(step)
            c.graph.replay()
            got = c.outputs()
            torch.cuda.synchronize(device)
            c._pinned.clear()
            assert stage_mismatch(got, c.expected(inputs), inputs[4]) == "", f"step {steps}"
            steps += 1
    assert steps == 500 and c.bt.graph.ring.idle_runs == 0
    np.testing.assert_array_equal(c.bt.num_blocks_device.cpu().numpy(), c.ref.num_blocks)
    for g, t in enumerate(c.bt.block_tables):
        np.testing.assert_array_equal(t.tensor.cpu().numpy(), c.ref.tables[g], err_msg=f"group {g}")


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_a_captured_prepare_inputs_queued_behind_a_busy_stream_sees_only_its_own_step(device, backend_name, pdl):
    """Replay N of the captured prepare_inputs waits behind 50 ms of device work while the host stages, commits and
    loads the inputs of step N+1 and queues its replay: replay N applies step N only and reads step N's inputs."""
    c = CapturedStep(device, backend_name, pdl=pdl)
    schedule = iter(replay_schedule(load_trace(), BLOCK_SIZES, 40, 60))
    for i, step in enumerate(schedule):
        c.stage(step.calls)
        c.bt.commit_staged_writes()
        c.ref.apply_staged_writes()
        if i < 50:  # past the first prefills: rows are freed and reused by new requests (overwrites)
            c.load(step)
            c.graph.replay()
            continue
        torch.cuda.synchronize(device)
        c._pinned.clear()
        busy(0.05)
        inputs_n = c.load(step)
        c.graph.replay()
        got_n, want_n = c.outputs(), c.expected(inputs_n)
        assert not torch.cuda.current_stream(device).query(), "replay N ran too early for this test to mean anything"
        nxt = next(schedule, None)
        if nxt is None:
            break
        c.stage(nxt.calls)
        c.bt.commit_staged_writes()  # while replay N still waits
        c.ref.apply_staged_writes()
        inputs_n1 = c.load(nxt)
        c.graph.replay()
        got_n1, want_n1 = c.outputs(), c.expected(inputs_n1)
        torch.cuda.synchronize(device)
        assert stage_mismatch(got_n, want_n, inputs_n[4]) == "", f"step {i}: replay N saw more (or less) than step N"
        assert stage_mismatch(got_n1, want_n1, inputs_n1[4]) == "", f"step {i + 1}"
    ring = c.bt.graph.ring
    assert ring.idle_runs == 0 and ring.applied == ring.published


def test_a_host_input_is_refused_during_capture_and_nothing_is_recorded(device, backend_name):
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name),
                     cuda_graphs=True, max_num_batched_tokens=64)  # fmt: skip
    idx = torch.zeros(8, dtype=torch.int32, device=device)
    qsl, pos = torch.zeros(9, dtype=torch.int32, device=device), torch.zeros(64, dtype=torch.int64, device=device)
    bt.prepare_inputs(idx, qsl, pos, 8, 64)  # warm-up
    bt.append_block_ids(0, ([1], [2], [3]), True)
    host_idx = torch.zeros(8, dtype=torch.int32).pin_memory()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(StageInputError, match="idx_mapping is on cpu.*host->device copy would be captured"):
        with torch.cuda.graph(g):
            bt.prepare_inputs(host_idx, qsl, pos, 8, 64)
    assert bt.graph.recordings == [] and [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert bt[2].tensor[0, 0].item() == 3
