"""Graph mode's protocol (`BlockTables(..., cuda_graphs=True)`): every ordering of commits, replays of a captured
`apply_staged_writes()` and eager applies lands exactly what `tests/graph/model.py` says the device must hold,
checked against `multiwrite.reference` after every step. Triton's interpreter on CPU, simulated captures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter
from multiwrite.errors import BackendUnavailableError, StagedWriteError
from multiwrite.reference import compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.staging.headers import H_COUNTS, INLINE_VALUES, INLINE_WRITES
from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps
from tests.graph.model import BS, CPU, KBS, REQS, WIDTHS, GraphModel, graph_tables, report_one_replay_without_commit
from tests.support.tables import host

TRACE = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "small_trace.csv"


def test_a_commit_changes_nothing_and_its_replay_applies_exactly_that_batch():
    m = GraphModel()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.stage(3, ([5], [], [6, 7]), True)
    assert m.commit() == 0
    m.check("after the commit")
    assert not m.bt[0].tensor.any() and not m.bt.num_blocks_device.any()  # host work only
    m.replay()
    m.check("after the replay")
    assert m.bt[1].tensor[0, :2].tolist() == [6, 7]  # kernel block ids: 3 -> 6, 7
    assert m.bt.num_blocks_device[:, 3].tolist() == [1, 0, 2]


def test_two_commits_are_applied_by_two_replays_in_commit_order():
    """commit A; commit B; replay; replay. The first replay applies A only (a replay queued before the host
    committed the next step must not apply that step early); B, which overwrites A's cells, at the second."""
    m = GraphModel()
    m.stage(0, ([1, 2, 3], [4], [5]), True)
    m.stage(1, ([9], [9], [9]), True)
    m.commit()
    m.stage(0, ([7], [8], []), True)  # row 0 reused by a new request: overwrites A's cells
    m.stage(1, ([10], [], [11]), False)
    m.commit()
    m.replay()
    m.check("replay 1")
    assert m.bt[0].tensor[0, :3].tolist() == [1, 2, 3]
    m.replay()
    m.check("replay 2")
    assert m.bt[0].tensor[0, :3].tolist() == [7, 2, 3] and int(m.bt.num_blocks_device[0, 0]) == 1


def test_an_empty_commit_is_the_batch_of_its_replay():
    m = GraphModel()
    m.stage(2, ([4], [5], [6]), True)
    m.commit()
    m.commit()  # nothing staged: an empty batch, so the replays stay paired with the commits
    m.replay()
    m.replay()
    m.check("two replays")
    assert m.bt.graph.ring.idle_runs == 0
    m.stage(2, ([1], [], []), False)
    m.commit()
    m.replay()
    m.check("third")
    assert m.bt[0].tensor[2, :2].tolist() == [4, 1]


def test_a_replay_without_a_commit_applies_nothing():
    m = GraphModel()
    m.stage(2, ([4], [5], [6]), True)
    m.replay()  # its ticket is not published: it applies nothing, even with writes staged
    m.check("idle replay")
    assert m.bt.graph.ring.idle_runs == 1 and not m.bt[0].tensor.any()


def test_a_warm_up_replay_is_reported_at_the_next_commit_and_the_commits_pair_with_the_replays_after_it():
    """A replay before the first commit (a warm-up) applies nothing, and is a mis-pairing: the next commit raises
    GraphProtocolError naming replay 0 and publishes nothing; the same commit then pairs with the next replay. (It
    was silent before.)"""
    m = GraphModel()
    m.replay()  # warm-up: nothing committed yet
    m.stage(0, ([1], [2], [3]), True)
    report_one_replay_without_commit(m, 0)
    assert m.bt[0].tensor[0, 0].item() == 1, "the replay after the commit did not apply the committed batch"


def test_an_eager_apply_applies_every_published_batch_then_the_staged_writes():
    """A commit whose replay is not issued before an eager apply: the eager apply applies its batch, then the staged
    writes (which overwrite it); that commit is a mis-pairing (an extra commit, or an eager call between a commit
    and its replay), reported once by the next commit, after which commits and replays pair again."""
    m = GraphModel()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.commit()
    m.replay()
    m.check("first replay")
    m.stage(0, ([5], [6], [7]), False)
    m.commit()  # no replay is issued for it before the eager apply below, which applies it first
    m.stage(0, ([8], [9], [10]), True)  # overwrites what the committed batch wrote
    m.eager_apply()
    m.check("eager apply")
    assert m.bt[0].tensor[0, :3].tolist() == [8, 2, 5]
    err = m.expect_report()
    assert (err.commits_without_replay, err.first_commit, err.replays_without_commit) == (1, 1, 0)
    assert "commit 1 (counting commits from 0), header 1, had no replay issued before the eager" in str(err)
    m.stage(4, ([3], [3], [3]), True)
    m.commit()
    m.replay()
    m.check("third commit")
    m.eager_apply()  # nothing staged, nothing new published: no launch, nothing changes
    m.check("empty eager apply")


def test_overlapping_writes_in_one_batch_land_in_staging_order(staging):
    m = GraphModel(staging=staging)
    m.stage(0, ([1, 2, 3], [4, 5], [6]), True)
    m.stage(0, ([7], [8], [9]), False)
    m.stage(0, ([10], [11], []), True)  # the same rows again: overlap rounds
    m.stage(0, ([12], [], [13]), False)
    m.commit()
    m.replay()
    m.check()
    assert m.bt[0].tensor[0, :3].tolist() == [10, 12, 3] and m.bt.num_blocks_device[:, 0].tolist() == [2, 2, 1]


def test_decode_batches_travel_inline_and_bigger_ones_stay_in_their_slot():
    """A batch of one round with at most INLINE_WRITES writes and INLINE_VALUES values is copied into its header
    entry (the sign bit of its counts word); one write or value more, or a second round, and it stays in its staging
    slot. Every kind lands exactly."""
    assert (INLINE_WRITES, INLINE_VALUES) == (256, 1024)  # (the cases below are written for these limits)
    m = GraphModel(reqs=72, widths=[160, 40, 80])
    entry = m.bt.graph.ring.entry
    rng = np.random.default_rng(3)

    def rows_of(values: int) -> None:  # 8 calls of 4 writes (group 0's ids, two empty overwrites, the counts row)
        ids = values - 8 * 3
        for r in range(8):
            m.stage(r, (rng.integers(1, 999, ids // 8 + (r < ids % 8)).tolist(), [], []), True)

    def freed(rows: int) -> None:  # `rows` calls of 3 empty writes and the counts row: 4 writes, 3 values each
        for r in range(rows):
            m.stage(r, ([], [], []), True)

    cases = [  # (what, stage it, inline?)
        ("1024 values", lambda: rows_of(1024), True),
        ("1025 values", lambda: rows_of(1025), False),
        ("256 writes", lambda: freed(64), True),
        ("260 writes", lambda: freed(65), False),
        ("two rounds", lambda: (rows_of(100), m.stage(5, ([77], [], [78]), False)), False),
        ("decode step", lambda: [m.stage(r, ([r + 1], [r + 2], []), False) for r in (1, 3)], True),
    ]
    for what, stage, inline in cases:
        stage()
        h = m.commit()
        assert (int(entry(h)[H_COUNTS]) < 0) == inline, f"{what}: inline should be {inline}"
        m.replay()
        m.check(what)


@pytest.mark.parametrize("config", ["G3", "G11", "G20"])
def test_every_decode_step_of_the_trace_travels_in_its_header(config):
    """The inline limits hold the decode steps engines commit: every decode step of the trace's schedule at C=256 in
    the bench's configurations (the largest, G20's, carries 163 writes and 604 values) fits in a header entry, so
    its commit stays one compiled call. With 256 values 40% of G11's and G20's did not (measured on the H200: their
    commits took twice G3's). Staged on compiled-cpu tables: the batch sizes do not depend on the backend."""
    from multiwrite.bench.groups import STAGE_CONFIGS
    from multiwrite.workload import replay_schedule

    bs, kbs = STAGE_CONFIGS[config]
    bt = BlockTables(bs, 256, max_blocks_per_group(bs), CPU, kbs, backend="compiled-cpu")
    largest = (0, 0)
    for step in replay_schedule(load_trace(), bs, 256, 300):
        for req, ids, overwrite in step.calls:
            bt.append_block_ids(req, ids, overwrite)
        if step.is_decode:
            largest = max(largest, (bt.num_staged_values, bt.num_staged_writes))
            assert bt.num_staged_writes <= INLINE_WRITES and bt.num_staged_values <= INLINE_VALUES, (
                f"{config}: a decode step of {bt.num_staged_writes} writes, {bt.num_staged_values} values"
            )
        bt.apply_staged_writes()
    assert largest[0] > {"G3": 200, "G11": 400, "G20": 600}[config]  # (the schedule reaches the sizes named above)


def test_clear_drops_only_the_writes_staged_since_the_last_commit():
    m = GraphModel()
    m.stage(0, ([1, 2], [3], [4]), True)
    m.commit()
    m.stage(0, ([5], [6], [7]), False)
    m.stage(1, ([8], [9], [10]), True)
    m.clear()
    np.testing.assert_array_equal(m.bt.num_blocks, m.ref.num_blocks)
    m.replay()
    m.check("after the clear")
    m.stage(0, ([11], [], []), False)  # appends after the committed counts, not the cleared ones
    m.commit()
    m.replay()
    m.check("next commit")
    assert m.bt[0].tensor[0, :3].tolist() == [1, 2, 11]


@pytest.mark.parametrize("ring_depth", [3, 5])
def test_the_rings_wrap_exactly(ring_depth):
    """Staging rings of 3 and 5 slots (header rings of 4 and 8 entries), with empty commits: several laps."""
    m = GraphModel(ring_depth=ring_depth)
    for step in range(2 * ring_depth + 3):
        big = step % 4 == 1  # a batch that stays in its slot: the staging ring wraps too
        m.stage(step % REQS, ([step + 1], [step + 2], []), True)
        if big:
            for r in range(REQS):
                m.stage(r, ([step + 3] * 5, [1] * 2, [2] * 6), True)
        m.commit()
        if step % 3 == 0:
            m.commit()  # an empty batch
            m.replay()
        m.replay()
        m.check(f"step {step}")


def test_random_orderings_over_trace_steps_equal_the_model(staging):
    """Random interleavings of staging, commits, queued replays, eager applies and clears over the steps of the
    small trace, checked after every step; the host runs up to three commits ahead of the replays. An eager apply
    while commits wait for their replay is a mis-pairing: the next call raises GraphProtocolError (expected)."""
    rng = np.random.default_rng(16)
    widths = max_blocks_per_group(BS, 512)
    m = GraphModel(ring_depth=4, reqs=8, widths=widths, staging=staging)
    for i, calls in enumerate(replay_steps(load_trace(TRACE), BS, 8, 40)):
        for req, ids, overwrite in calls:
            m.stage(req, ids, overwrite)
        op = rng.random()
        if m.report_due():  # an eager apply found commits whose replay had not run: the next call reports it
            m.expect_report("eager" if op < 0.2 else "commit")
        if op < 0.05 and i > 5:
            m.clear()
            m.check(f"step {i}: clear")
            break  # the trace's later steps assume the cleared writes: stop here
        if op < 0.2:
            m.eager_apply()
        else:
            while not m.can_commit():
                m.replay()
            m.commit()
        while m.runs < len(m.tickets) and rng.random() < 0.6:
            m.replay()
        m.check(f"step {i}")
    while m.runs < len(m.tickets):
        m.replay()
        m.check("draining")
    assert m.applied == len(m.headers) > len(m.tickets) > 10  # (eager applies publish headers without tickets)
    assert m.extra > 0 and not m.report_due()


def test_an_eager_prepare_inputs_applies_the_published_batches_then_the_staged_ones():
    from multiwrite.reference import ReferenceBlockTables

    bt = graph_tables(max_num_batched_tokens=8)
    ref = ReferenceBlockTables(BS, REQS, WIDTHS, KBS)
    for req, ids, ow in [(0, ([1, 2], [3], [4, 5]), True), (2, ([6], [7], [8]), True)]:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    bt.commit_staged_writes()  # committed, never replayed
    bt.append_block_ids(2, ([9], [], []), False)
    ref.append_block_ids(2, ([9], [], []), False)
    idx, qsl, pos = [2, 0], [0, 2, 3], [3, 7, 5]  # (row 2 holds one block of group 2: positions below 8)
    gathered, slots = bt.prepare_inputs(torch.tensor(idx), torch.tensor(qsl), torch.tensor(pos), 3, 4)
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, 3, [np.zeros_like(t) for t in ref.tables])
    for g in range(3):
        np.testing.assert_array_equal(host(gathered[g]), want[g])
    np.testing.assert_array_equal(host(slots), compute_slot_mappings_reference(ref.tables, KBS, idx, qsl, pos, 4))
    assert bt.graph.ring.applied == bt.graph.ring.published == 2 and bt.graph.recordings == []  # ran at once


def test_without_the_flag_a_commit_is_refused_and_the_writes_stay_staged():
    bt = BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend="triton-cuda")
    assert bt.graph is None and not bt.cuda_graphs
    bt.append_block_ids(0, ([1], [2], [3]), True)
    with pytest.raises(StagedWriteError, match=r"cuda_graphs=True.*Nothing was committed"):
        bt.commit_staged_writes()
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]
    bt.apply_staged_writes()
    assert bt[0].tensor[0, 0] == 1 and bt.num_blocks_device[:, 0].tolist() == [1, 2, 1]


@pytest.mark.parametrize("name", ["torch-cpu", "torch-generic"])
def test_a_backend_without_a_graph_mode_is_refused_at_construction(name):
    with pytest.raises(BackendUnavailableError, match=rf"{name}.*no graph mode"):
        BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend=name, cuda_graphs=True)


def test_a_staging_ring_of_one_slot_is_refused():
    from multiwrite.backends.triton.backend import TritonCudaBackend

    with pytest.raises(ValueError, match=r"ring_depth=1 \(must be >= 2"):
        BlockTables(BS, REQS, WIDTHS, CPU, KBS, backend=TritonCudaBackend(ring_depth=1), cuda_graphs=True)


def test_a_plain_writer_refuses_graph_mode_tables_and_the_writes_stay_staged():
    m = GraphModel()
    m.stage(0, ([1], [2], [3]), True)
    with pytest.raises(StagedWriteError, match="cuda_graphs=True"):
        FusedStagedWriter(CPU, backend="triton-cuda").apply(m.bt.block_tables)
    assert [t.num_staged_writes for t in m.bt.block_tables] == [1, 1, 1]
    m.commit()
    m.replay()
    m.check()
