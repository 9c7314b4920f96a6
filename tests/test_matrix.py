"""Scenario tests run against every available backend (the `backend` fixture of conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference

DTYPES = [torch.int32, torch.int64, torch.float32]


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def seed_tables(backend) -> BlockTables:
    return BlockTables([16, 32, 8], 4, [8, 8, 8], backend.device, kernel_block_sizes=[16, 16, 8], backend=backend.name)


def test_seed_scenario_three_groups(staging, backend):
    bt = seed_tables(backend)
    assert bt.backend.NAME == backend.name
    assert [t.tensor.shape[1] for t in bt.block_tables] == [8, 16, 8]
    bt.append_block_ids(0, ([1, 2], [10, 11], []), overwrite=True)
    bt.append_block_ids(1, ([3], [12], [5, 6]), overwrite=True)
    bt.apply_staged_writes()
    assert host(bt[1].tensor)[0, :4].tolist() == [20, 21, 22, 23]
    assert host(bt[1].tensor)[0, 4:].tolist() == [0] * 12
    assert host(bt[1].tensor)[1, :2].tolist() == [24, 25]
    assert host(bt[0].tensor)[0, :3].tolist() == [1, 2, 0]
    assert host(bt[2].tensor)[1, :3].tolist() == [5, 6, 0]
    assert bt.num_blocks[:, :2].tolist() == [[2, 1], [4, 2], [0, 2]]
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[2, 1], [4, 2], [0, 2]]
    assert all(t.num_staged_writes == 0 for t in bt.block_tables)
    bt.append_block_ids(0, ([7], [13], [8]), overwrite=False)
    bt.apply_staged_writes()
    assert host(bt[1].tensor)[0, :8].tolist() == [20, 21, 22, 23, 26, 27, 0, 0]
    assert host(bt[0].tensor)[0, :4].tolist() == [1, 2, 7, 0]
    assert host(bt[2].tensor)[0, :2].tolist() == [8, 0]
    assert host(bt.num_blocks_device)[:, 0].tolist() == [3, 6, 1]


def test_single_group(staging, backend):
    bt = BlockTables([16], 3, [5], backend.device, backend=backend.name)
    bt.append_block_ids(2, ([4, 9, 11],), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(2, ([12, 13],), overwrite=False)
    bt.append_block_ids(0, ([1],), overwrite=True)
    bt.apply_staged_writes()
    assert host(bt[0].tensor).tolist() == [[1, 0, 0, 0, 0], [0] * 5, [4, 9, 11, 12, 13]]
    assert host(bt.num_blocks_device).tolist() == [[1, 0, 5]]
    # A new request reusing row 2 overwrites from column 0 (stale ids after its count stay, as in vLLM).
    bt.append_block_ids(2, ([7],), overwrite=True)
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[2].tolist() == [7, 9, 11, 12, 13]
    assert bt.num_blocks[0, 2] == 1


def test_multi_group_apply_reaches_backend_as_one_call(staging, backend, monkeypatch):
    bt = BlockTables([16, 32, 8, 16], 4, [4, 4, 4, 4], backend.device, [16, 16, 8, 16], backend=backend.name)
    calls = []
    original = bt.backend.apply
    monkeypatch.setattr(bt.backend, "apply", lambda batches: (calls.append(list(batches)), original(batches))[1])
    for req in range(4):
        bt.append_block_ids(req, ([req + 1], [req + 10], [req + 20, req + 21], [req + 30]), overwrite=True)
    bt.apply_staged_writes()
    assert len(calls) == 1
    assert len(calls[0]) == 1  # one dtype, so one batch
    batch = calls[0][0]
    assert len(batch.tables) == 5  # four groups and num_blocks
    # per request: one write per group, and its new num_blocks column, all in the same backend call
    assert batch.num_writes == 4 * 4 + 4
    assert host(bt.num_blocks_device)[:, 3].tolist() == [1, 2, 2, 1]
    assert host(bt[3].tensor)[:, 0].tolist() == [30, 31, 32, 33]
    bt.apply_staged_writes()  # nothing staged: the backend is not called at all
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_overlapping_empty_and_full_width_writes(backend, dtype):
    a = StagedWriteTensor((3, 6), dtype, backend.device, name="a")
    b = StagedWriteTensor((2, 4), dtype, backend.device, name="b")
    writes_a = [
        (0, 0, [1, 2, 3, 4, 5, 6]),  # full width
        (0, 2, [70, 80]),  # overlaps: later wins
        (1, 5, []),  # empty: no-op
        (2, 1, [9, 9, 9]),
        (2, 2, [-4]),  # overlaps the previous one in the middle
        (0, 5, [66]),
        (2, 0, [11, 12, 13, 14, 15, 16]),  # full width again, last of row 2
        (2, 5, [99]),
    ]
    writes_b = [(1, 0, [3, 4, 5, 6]), (0, 3, [8]), (1, 1, [])]
    for w in writes_a:
        a.stage_write(*w)
    for w in writes_b:
        b.stage_write(*w)
    assert a.num_staged_writes == len(writes_a) and b.num_staged_writes == len(writes_b)
    FusedStagedWriter(backend.device, backend.name).apply([a, b])
    np_dtype = host(a.tensor).dtype
    expected_a = apply_writes_reference(np.zeros((3, 6), np_dtype), writes_a)
    expected_b = apply_writes_reference(np.zeros((2, 4), np_dtype), writes_b)
    np.testing.assert_array_equal(host(a.tensor), expected_a)
    np.testing.assert_array_equal(host(b.tensor), expected_b)
    assert host(a.tensor)[0].tolist() == [1, 2, 70, 80, 5, 66]
    assert a.num_staged_writes == 0 and b.num_staged_writes == 0


def test_mixed_dtypes_one_backend_call(backend, monkeypatch):
    tables = [StagedWriteTensor((2, 5), d, backend.device, name=str(d)) for d in DTYPES]
    writer = FusedStagedWriter(backend.device, backend.name)
    calls = []
    original = writer.backend.apply
    monkeypatch.setattr(writer.backend, "apply", lambda batches: (calls.append(len(batches)), original(batches))[1])
    tables[0].stage_write(1, 1, [2**31 - 1, -(2**31)])
    tables[1].stage_write(0, 0, [2**62, -(2**62), 7])
    tables[2].stage_write(1, 3, [1.5, -2.25])
    writer.apply(tables)
    assert calls == [3]
    assert host(tables[0].tensor)[1].tolist() == [0, 2**31 - 1, -(2**31), 0, 0]
    assert host(tables[1].tensor)[0].tolist() == [2**62, -(2**62), 7, 0, 0]
    assert host(tables[2].tensor)[1].tolist() == [0.0, 0.0, 0.0, 1.5, -2.25]


def test_value_kinds_and_one_dimensional_tensor(backend):
    t = StagedWriteTensor((3, 4), torch.int64, backend.device)
    t.stage_write(0, 0, np.array([1, 2], dtype=np.int16))
    t.stage_write(1, 1, torch.tensor([3, 4, 5]))
    t.stage_write(2, 2, (6, 7))
    t.stage_write(2, 0, iter([8]))
    vec = StagedWriteTensor(5, torch.int32, backend.device, name="vec")
    vec.stage_write_elem(3, 42)
    vec.stage_write_elem(0, -1)
    vec.stage_write_elem(3, 43)
    FusedStagedWriter(backend.device, backend.name).apply([t, vec])
    assert host(t.tensor).tolist() == [[1, 2, 0, 0], [0, 3, 4, 5], [8, 0, 6, 7]]
    assert vec.tensor.shape == (5,)
    assert host(vec.tensor).tolist() == [-1, 0, 0, 43, 0]


def test_kernel_block_expansion_in_plain_tensor(backend):
    t = StagedWriteTensor((2, 8), torch.int32, backend.device, kernel_blocks_per_block=4)
    t.stage_write(1, 2, [5])
    t.stage_write(0, 0, [0, 1])
    FusedStagedWriter(backend.device, backend.name).apply([t])
    assert host(t.tensor).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 20, 21, 22, 23, 0, 0]]


def test_replaced_table_is_written_not_the_old_one(backend):
    t = StagedWriteTensor((2, 3), torch.int32, backend.device)
    writer = FusedStagedWriter(backend.device, backend.name)
    t.stage_write(0, 0, [1, 2, 3])
    writer.apply([t])
    old = t.tensor
    t.tensor = torch.zeros(4, 3, dtype=torch.int32, device=backend.device)
    t.stage_write(3, 1, [7, 8])
    t.stage_write(0, 2, [9])
    writer.apply([t])
    assert host(old).tolist() == [[1, 2, 3], [0, 0, 0]]
    assert host(t.tensor).tolist() == [[0, 0, 9], [0, 0, 0], [0, 0, 0], [0, 7, 8]]


def test_partial_apply_of_shared_staging_keeps_other_groups(backend):
    bt = seed_tables(backend)
    bt.append_block_ids(0, ([1], [2], [3]), overwrite=True)
    FusedStagedWriter(backend.device, backend.name).apply([bt[1]])
    assert host(bt[1].tensor)[0, :2].tolist() == [4, 5]
    assert host(bt[0].tensor)[0, 0] == 0
    assert bt[0].num_staged_writes == 1 and bt[1].num_staged_writes == 0
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0, 0] == 1 and host(bt[2].tensor)[0, 0] == 3
    assert host(bt.num_blocks_device)[:, 0].tolist() == [1, 2, 1]


def test_replay_of_a_trace_matches_reference(staging, backend):
    from multiwrite.replay import count_mismatches
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    trace = load_trace("tests/data/small_trace.csv")
    block_sizes, kernel = [16, 32, 8], [16, 16, 8]
    widths = max_blocks_per_group(block_sizes, 1024)
    bt = BlockTables(block_sizes, 3, widths, backend.device, kernel, backend=backend.name)
    ref = ReferenceBlockTables(block_sizes, 3, widths, kernel)
    steps = 0
    for calls in replay_steps(trace, block_sizes, concurrency=3, num_steps=60, token_budget=64):
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        bt.apply_staged_writes()
        steps += 1
    assert steps > 10
    assert ref.num_blocks.sum() > 0
    assert count_mismatches(bt, ref) == 0
