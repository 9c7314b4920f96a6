"""Graph mode of `BlockTables` (`cuda_graphs=True`, issue 10): the header ring, commit and the consume kernel.

Runs the consume kernel through Triton's interpreter on CPU. A graph replay runs the launch a capture
recorded, `GraphStage.launch(-1)`; tests call exactly that launch eagerly (`_replay`). Every ordering of
commits, replays and eager applies is checked against `multiwrite.reference` through a model of what the
device must hold: each commit queues the reference state it closes, each replay takes the oldest queued
state, an eager apply takes the newest. Real captures run in tests/gpu/test_graphs.py.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import multiwrite.block_tables as block_tables_module
from multiwrite import BlockTables, FusedStagedWriter
from multiwrite.errors import BackendUnavailableError, StagedWriteError
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

triton_kernel = pytest.importorskip("multiwrite.backends.triton_kernel")
if not triton_kernel.INTERPRETED:  # pragma: no cover - a GPU machine
    pytest.skip("these tests drive the consume kernel through Triton's interpreter on CPU", allow_module_level=True)
from multiwrite.backends.triton_cuda import TritonCudaBackend  # noqa: E402

CPU = torch.device("cpu")
BS, KBS, WIDTHS, REQS = [16, 32, 8], [16, 16, 8], [5, 4, 6], 6


class Model:
    """A graph-mode `BlockTables` beside its reference and the device state each run must leave."""

    def __init__(self, ring_depth: int = 8, reqs: int = REQS, widths=WIDTHS, **writer_kw):
        backend = TritonCudaBackend(ring_depth=ring_depth)
        writer = backend.writer(CPU)
        for k, v in writer_kw.items():
            setattr(writer, k, v)
        self.bt = BlockTables(BS, reqs, widths, CPU, KBS, backend=backend, cuda_graphs=True)
        self.ref = ReferenceBlockTables(BS, reqs, widths, KBS)
        self.queue: list[tuple[list[np.ndarray], np.ndarray]] = []  # committed, not yet consumed
        self.device = ([t.copy() for t in self.ref.tables], self.ref.num_blocks.copy())  # what the device holds

    def stage(self, req, ids, overwrite) -> None:
        self.bt.append_block_ids(req, ids, overwrite)
        self.ref.append_block_ids(req, ids, overwrite)

    def _snapshot(self):
        return [t.copy() for t in self.ref.tables], self.ref.num_blocks.copy()

    def commit(self) -> int:
        h = self.bt.commit_staged_writes()
        self.queue.append(self._snapshot())
        self.ref.apply_staged_writes()  # the reference's "applied" state: what a clear returns to
        return h

    def replay(self) -> None:
        _replay(self.bt)
        if self.queue:
            self.device = self.queue.pop(0)

    def eager_apply(self) -> None:
        self.bt.apply_staged_writes()
        self.ref.apply_staged_writes()
        self.queue.clear()
        self.device = self._snapshot()

    def check(self) -> None:
        """The device tables and num_blocks_device hold exactly the state of the last consumed batch."""
        tables, counts = self.device
        for g, t in enumerate(self.bt.block_tables):
            np.testing.assert_array_equal(t.tensor.numpy(), tables[g], err_msg=f"group {g}")
        np.testing.assert_array_equal(self.bt.num_blocks_device.numpy(), counts, err_msg="num_blocks_device")
        np.testing.assert_array_equal(self.bt.num_blocks, self.ref.num_blocks, err_msg="host num_blocks")


def _replay(bt: BlockTables) -> None:
    """What a replay of a graph that captured `bt.apply_staged_writes()` runs."""
    bt._graph.launch(-1)


def test_commit_then_replay_applies_exactly_that_batch_and_nothing_before():
    m = Model()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.stage(3, ([5], [], [6, 7]), True)
    assert m.commit() == 0
    m.check()  # committed, not yet replayed: the device tables are untouched (all zero)
    assert not m.bt[0].tensor.any()
    m.replay()
    m.check()
    assert m.bt[1].tensor[0, :2].tolist() == [6, 7]  # kernel block ids: 3 -> 6, 7
    assert m.bt._graph.consumed == 1 and m.bt._graph.idle_runs == 0


def test_inline_batches_are_checked_against_their_checksum_and_a_mismatch_is_read_again():
    """Decode-sized batches travel in their header entries with a checksum: a run that reads an entry while the
    host writes it (a replay issued before its commit) gets a mix of two batches, which the checksum catches, and
    reads the entry again, ordered after its sequence word. Here the checksum word itself is made wrong: the run
    must count one re-read and still apply exactly the batch (the re-read path's layout)."""
    from multiwrite.backends.triton_graph import ENTRY_WORDS, H_TOKEN

    m = Model()
    for step in range(6):  # the entries of a first lap: all read once, all matching
        m.stage(step % 4, ([step + 1, step + 2], [step + 3], [step + 4]), True)
        m.commit()
        m.replay()
        m.check()
    assert m.bt._graph.rereads == 0
    m.stage(2, ([41, 42, 43], [44], [45, 46]), True)
    m.stage(3, ([47], [], [48]), False)
    h = m.commit()
    assert m.bt._graph.headers[(h % m.bt._graph.depth) * ENTRY_WORDS.value + 6] < 0  # it went inline (sign bit)
    m.bt._graph.headers[(h % m.bt._graph.depth) * ENTRY_WORDS.value + H_TOKEN] += 1
    m.replay()
    m.check()
    assert m.bt._graph.rereads == 1 and m.bt._graph.consumed == 7
    assert m.bt[0].tensor[2, :3].tolist() == [41, 42, 43]


def test_two_commits_are_consumed_by_two_replays_in_commit_order():
    """commit A; commit B; replay; replay. The first replay applies A only: a replay queued before the host
    committed the next step (the normal pipelined case) must not apply that step's writes early. B, which
    overwrites A's cells, lands at the second replay: order kept, later wins."""
    m = Model()
    m.stage(0, ([1, 2, 3], [4], [5]), True)
    m.stage(1, ([9], [9], [9]), True)
    m.commit()
    m.stage(0, ([7], [8], []), True)  # row 0 reused by a new request: overwrites A's cells
    m.stage(1, ([10], [], [11]), False)
    m.commit()
    m.replay()
    m.check()
    assert m.bt[0].tensor[0, :3].tolist() == [1, 2, 3]
    m.replay()
    m.check()
    assert m.bt[0].tensor[0, :3].tolist() == [7, 2, 3] and int(m.bt.num_blocks_device[0, 0]) == 1


def test_a_replay_with_nothing_committed_does_nothing_and_keeps_the_count_in_step():
    m = Model()
    m.replay()
    m.check()
    assert m.bt._graph.idle_runs == 1 and m.bt._graph.consumed == 0
    m.stage(2, ([4], [5], [6]), True)
    m.commit()
    m.replay()
    m.check()
    m.replay()  # nothing new
    m.check()
    assert m.bt._graph.idle_runs == 2 and m.bt._graph.consumed == 1


def test_an_empty_commit_is_consumed_by_its_replay():
    m = Model()
    m.stage(2, ([4], [5], [6]), True)
    m.commit()
    m.commit()  # nothing staged: an empty batch, so the next replay stays paired with the next commit
    m.replay()
    m.replay()
    m.check()
    assert m.bt._graph.consumed == 2 and m.bt._graph.idle_runs == 0
    m.stage(2, ([1], [], []), False)
    m.commit()
    m.replay()
    m.check()


def test_eager_apply_between_replays_applies_every_committed_batch_in_order():
    m = Model()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.commit()
    m.replay()
    m.check()
    m.stage(0, ([5], [6], [7]), False)
    m.commit()  # committed for a replay that never comes: the eager apply below applies it first
    m.stage(0, ([8], [9], [10]), True)  # overwrites what the committed batch wrote
    m.eager_apply()
    m.check()
    assert m.bt[0].tensor[0, :3].tolist() == [8, 2, 5]
    m.replay()  # the replay after it finds nothing new
    m.check()
    m.stage(4, ([3], [3], [3]), True)
    m.commit()
    m.replay()
    m.check()
    m.bt.apply_staged_writes()  # nothing staged, nothing new committed: no launch, nothing changes
    m.check()


def test_overlapping_writes_in_one_batch_land_in_staging_order(staging):
    m = Model()
    m.stage(0, ([1, 2, 3], [4, 5], [6]), True)
    m.stage(0, ([7], [8], [9]), False)
    m.stage(0, ([10], [11], []), True)  # the same rows again: rounds
    m.stage(0, ([12], [], [13]), False)
    assert m.bt._arena.may_overlap
    m.commit()
    m.replay()
    m.check()


def test_clear_drops_only_the_uncommitted_writes():
    m = Model()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.commit()
    m.stage(0, ([5], [6], [7]), False)
    m.stage(1, ([8], [9], [10]), True)
    m.bt.clear_staged_writes()
    m.ref.clear_staged_writes()
    np.testing.assert_array_equal(m.bt.num_blocks, m.ref.num_blocks)
    m.replay()
    m.check()
    m.stage(0, ([11], [], []), False)  # appends after the committed counts, not the cleared ones
    m.commit()
    m.replay()
    m.check()
    assert m.bt[0].tensor[0, :3].tolist() == [1, 2, 11]


def test_a_full_ring_warns_then_raises_and_keeps_the_writes_staged():
    m = Model(ring_depth=2, wait_warn_s=0.05, wait_timeout_s=0.3)
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.stage(2, ([7], [8], [9]), True)
    m.commit()  # decode-sized batches travel in their header entries: two entries, both now unconsumed
    m.stage(1, ([4], [5], [6]), True)
    staged = m.bt._arena.num_writes
    with pytest.warns(triton_kernel.RingWaitWarning) as caught, pytest.raises(triton_kernel.RingStallError) as info:
        m.bt.commit_staged_writes()  # its entry holds the unconsumed first batch
    warning = str(caught[0].message)
    for part in ("graph-mode ring (depth 2; 2 header entries)", "2 committed batches have not been consumed",
                 "replay the captured graph", "apply_staged_writes()"):  # fmt: skip
        assert part in warning, part
    assert "Nothing was committed" in str(info.value)
    assert m.bt._arena.num_writes == staged and m.bt._graph.published == 2
    m.replay()  # consumes the first batch: the ring has room again
    m.check()
    m.commit()
    m.replay()
    m.check()


def test_a_commit_waits_for_a_late_replay_with_one_warning():
    m = Model(ring_depth=2, wait_warn_s=0.05, wait_timeout_s=20.0)
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.stage(2, ([7], [8], [9]), True)
    m.commit()  # both header entries hold unconsumed batches
    m.stage(1, ([4], [5], [6]), True)
    late = threading.Timer(0.3, lambda: _replay(m.bt))  # the replay runs while the commit waits
    late.start()
    try:
        with pytest.warns(triton_kernel.RingWaitWarning) as caught:
            m.commit()
    finally:
        late.join()
    assert len([c for c in caught if issubclass(c.category, triton_kernel.RingWaitWarning)]) == 1
    m.device = m.queue.pop(0)
    m.check()
    m.replay()
    m.check()


def test_capture_records_the_launch_and_commits_nothing(monkeypatch):
    """Inside a capture, apply_staged_writes records one launch with limit -1 (the next committed batch)
    and leaves the staged writes staged; the replays then consume commits one by one."""
    m = Model()
    m.stage(0, ([1], [2], [3]), True)
    staged = m.bt._arena.num_writes
    recorded = []
    monkeypatch.setattr(block_tables_module, "is_capturing", lambda device: True)
    monkeypatch.setattr(m.bt._graph, "launch", lambda limit: recorded.append(limit))
    m.bt.apply_staged_writes()
    assert recorded == [-1]
    assert m.bt._arena.num_writes == staged == 4 and m.bt._graph.published == 0  # 3 groups + the counts row
    m.bt.clear_staged_writes()  # graph mode: host work only, allowed while capturing
    m.ref.clear_staged_writes()
    monkeypatch.undo()
    m.stage(0, ([4], [5], [6]), True)
    m.commit()
    m.replay()
    m.check()


def test_without_the_flag_nothing_changes_and_commit_is_refused():
    bt = BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend="triton-cuda")
    assert bt._graph is None and "apply_staged_writes" not in vars(bt)  # the eager methods, untouched
    bt.append_block_ids(0, ([1], [2], [3]), True)
    with pytest.raises(StagedWriteError, match="cuda_graphs=True"):
        bt.commit_staged_writes()
    assert bt._arena.num_writes == 4
    bt.apply_staged_writes()
    assert bt[0].tensor[0, 0] == 1


def test_a_backend_without_a_graph_mode_is_refused_at_construction():
    with pytest.raises(BackendUnavailableError, match="torch-cpu.*no CUDA-graph mode"):
        BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend="torch-cpu", cuda_graphs=True)


def test_a_plain_writer_refuses_graph_mode_tables():
    m = Model()
    m.stage(0, ([1], [2], [3]), True)
    with pytest.raises(StagedWriteError, match="cuda_graphs=True"):
        FusedStagedWriter(CPU, backend="triton-cuda").apply(m.bt.block_tables)
    assert m.bt._arena.num_writes == 4
    m.commit()
    m.replay()
    m.check()


def test_random_orderings_against_the_reference(staging):
    """Random interleavings of staging, commits, replays (also with nothing committed), eager applies and
    clears over steps of the real trace workload (small trace), checked after every run."""
    rng = np.random.default_rng(10)
    trace = load_trace(Path(__file__).parent / "data" / "small_trace.csv")
    widths = max_blocks_per_group(BS)
    m = Model(ring_depth=4, reqs=8, widths=widths)
    steps = replay_steps(trace, BS, 8, 40)
    for calls in steps:
        for req, ids, overwrite in calls:
            m.stage(req, ids, overwrite)
        op = rng.random()
        if op < 0.05:
            m.bt.clear_staged_writes()
            m.ref.clear_staged_writes()
            m.check()
            break  # the trace's later steps assume the cleared writes: stop here
        if op < 0.15:
            m.eager_apply()
        else:
            if len(m.queue) < 3:
                m.commit()
            if rng.random() < 0.8:
                m.replay()
        m.check()
    while m.queue:
        m.replay()
        m.check()
    m.replay()  # nothing left: a no-op
    m.check()


def test_an_eager_apply_with_a_full_ring_applies_the_committed_batches_first_and_never_waits():
    m = Model(ring_depth=2, wait_warn_s=0.05, wait_timeout_s=0.3)
    m.stage(0, ([1], [2], [3]), True)
    m.commit()  # the ring (depth 2) now holds as many unconsumed batches as a commit allows
    m.stage(0, ([4], [5], [6]), False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", triton_kernel.RingWaitWarning)
        m.eager_apply()
    m.check()
    assert m.bt[0].tensor[0, :2].tolist() == [1, 4] and m.bt._graph.consumed == 2


@pytest.mark.parametrize("depth", [3, 5])
def test_a_ring_depth_that_is_not_a_power_of_two_wraps_exactly(depth):
    m = Model(ring_depth=depth)
    for step in range(3 * depth + 1):
        m.stage(step % REQS, ([step + 1], [step + 2], []), step % 2 == 0)
        m.commit()
        if step % 3 == 0:
            m.commit()  # an empty batch, then two replays
            m.replay()
        m.replay()
        m.check()
    assert m.bt._graph.consumed == m.bt._graph.published


def test_a_ring_of_one_slot_is_refused():
    with pytest.raises(BackendUnavailableError, match="ring depth of at least 2"):
        BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend=TritonCudaBackend(ring_depth=1), cuda_graphs=True)


def test_prepare_inputs_in_graph_mode_applies_the_committed_batches_first():
    from multiwrite.reference import compute_slot_mappings_reference, gather_block_tables_reference

    bt = BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend="triton-cuda", cuda_graphs=True, max_num_batched_tokens=8)
    ref = ReferenceBlockTables(BS, REQS, WIDTHS, KBS)
    for req, ids, ow in [(0, ([1, 2], [3], [4, 5]), True), (2, ([6], [7], [8]), True)]:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    bt.commit_staged_writes()  # committed, never replayed
    bt.append_block_ids(2, ([9], [], []), False)
    ref.append_block_ids(2, ([9], [], []), False)
    idx, qsl, pos = [2, 0], [0, 2, 3], [3, 17, 5]
    gathered, slots = bt.prepare_inputs(
        torch.tensor(idx), torch.tensor(qsl), torch.tensor(pos), num_reqs_padded=3, num_tokens_padded=4
    )
    want = gather_block_tables_reference(
        ref.tables, ref.num_blocks, idx, 3, [np.zeros_like(ref.tables[g]) for g in range(3)]
    )
    for g in range(3):
        np.testing.assert_array_equal(gathered[g].numpy(), want[g])
    want_slots = compute_slot_mappings_reference(ref.tables, KBS, idx, qsl, pos, 4)
    np.testing.assert_array_equal(slots.numpy(), want_slots)
    assert bt._graph.consumed == 2


def test_warnings_are_not_raised_in_a_normal_loop():
    m = Model(ring_depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", triton_kernel.RingWaitWarning)
        for step in range(6):
            m.stage(step % REQS, ([step + 1], [step + 2], []), True)
            m.commit()
            m.replay()
            m.check()


@pytest.mark.parametrize("requests", [63, 64, 65])
def test_batches_at_the_edge_of_the_one_load_path_land_exactly(requests):
    """The consume kernel loads a batch of one round with at most `FEW_WRITES` (256) writes and at most 256
    values whole, else tile by tile: 4 writes per request here (3 groups + the counts row), so 63 and 64
    requests take the one-load path and 65 the tiles; empty overwrites make writes outnumber nothing-values."""
    from multiwrite.backends.triton_graph import FEW_WRITES, PRELOADED_VALUES

    m = Model(reqs=70, widths=[3, 2, 3])
    for r in range(70):
        m.stage(r, ([r + 1], [r + 2], [r + 3, r + 4]), True)
    m.commit()
    m.replay()
    m.check()
    for r in range(requests):
        if r % 9 == 0:
            m.stage(r, ([r + 100], [r + 150], [r + 200]), False)  # appends: values beside the empty overwrites
        else:
            m.stage(r, ([], [], []), True)  # a freed row: 3 empty writes and its counts reset to 0
    w, v = m.bt._arena.num_writes, m.bt._arena.num_values
    assert w == 4 * requests and v <= PRELOADED_VALUES and not m.bt._arena.may_overlap
    assert (w <= FEW_WRITES) == (requests <= 64)
    m.commit()
    m.replay()
    m.check()
    assert m.bt.num_blocks_device[0, 1].item() == 0 and m.bt[0].tensor[9, :2].tolist() == [10, 109]


def test_a_batch_of_65536_overlap_rounds_is_published_with_all_its_rounds_and_not_inline():
    """65,536 writes to one cell form 65,536 overlap rounds. The counts word of the header must carry them all and
    must not read as an inline batch: with the INLINE flag at bit 48 (inside the rounds' bits) this header read as
    an inline batch of 0 rounds, and its run applied nothing (the last write, 4242, was lost). Decoded as the
    consume kernel decodes it; running those rounds through the interpreter takes minutes, so the replay itself
    runs on a GPU (tests/gpu/test_graphs.py)."""
    from multiwrite.backends.triton_graph import ENTRY_WORDS, H_COUNTS, H_META, H_NUM_VALUES, INLINE

    bt = BlockTables([16], 2, [4], CPU, [16], backend=TritonCudaBackend(ring_depth=2), cuda_graphs=True)
    n = 1 << 16
    table = bt.block_tables[0]
    for i in range(n - 1):
        table.stage_write(0, 0, [i % 1000 + 1])
    table.stage_write(0, 0, [4242])
    meta_addr = bt._arena.meta_addr
    h = bt.commit_staged_writes()
    g = bt._graph
    words = g.headers[(h % g.depth) * ENTRY_WORDS.value :][:8]
    counts = int(words[H_COUNTS])
    assert not counts & INLINE, "a batch of many rounds must not read as an inline batch"
    assert (counts & 0xFFFFFFFF, (counts & ~INLINE) >> 32) == (n, n)  # every write, every round
    assert int(words[H_META]) == meta_addr and int(words[H_NUM_VALUES]) == n
