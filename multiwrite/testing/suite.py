"""The conformance suite: what every backend must satisfy, through multiwrite's public API only.

Each test is one property of the contract in `docs/backends.md`, checked against the plain sequential
semantics of `multiwrite.reference` with values a wrong backend would get wrong (overlapping writes where
only "later wins" gives the expected table, strided views where a backend ignoring strides writes the
wrong cells). The fixtures come from `multiwrite.testing.plugin`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, StagedWriteError
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from multiwrite.testing.staging import block_tables_class

DTYPES = [torch.int32, torch.int64, torch.float32]
_NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


@pytest.fixture
def kit(multiwrite_kit):
    """The `Kit` under test (backend name, device, tensor factory, `to_host`); see `multiwrite_kit`."""
    return multiwrite_kit


def _block_tables(kit, staging, block_sizes, reqs, widths, kernel=None) -> BlockTables:
    """`BlockTables` on the backend under test, staging through `staging` (the `multiwrite_staging` fixture)."""
    return kit.block_tables(block_sizes, reqs, widths, kernel, staging=staging)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_overlapping_empty_and_full_width_writes(kit, dtype):
    """Every dtype; where writes overlap the later one wins; empty writes are no-ops; full-width rows."""
    a, b = kit.table((3, 6), dtype, name="a"), kit.table((2, 4), dtype, name="b")
    writes_a = [
        (0, 0, [1, 2, 3, 4, 5, 6]),
        (0, 2, [70, 80]),
        (1, 5, []),
        (2, 1, [9, 9, 9]),
        (2, 2, [-4]),
        (0, 5, [66]),
        (2, 0, [11, 12, 13, 14, 15, 16]),
        (2, 5, [99]),
    ]
    writes_b = [(1, 0, [3, 4, 5, 6]), (0, 3, [8]), (1, 1, [])]
    for w in writes_a:
        a.stage_write(*w)
    for w in writes_b:
        b.stage_write(*w)
    kit.writer().apply([a, b])
    np_dtype = _NP[dtype]
    np.testing.assert_array_equal(kit.host(a.tensor), apply_writes_reference(np.zeros((3, 6), np_dtype), writes_a))
    np.testing.assert_array_equal(kit.host(b.tensor), apply_writes_reference(np.zeros((2, 4), np_dtype), writes_b))
    assert kit.host(a.tensor)[2].tolist() == [11, 12, 13, 14, 15, 99]
    assert a.num_staged_writes == 0 and b.num_staged_writes == 0


def test_overlapping_writes_later_wins_across_applies_and_rows(kit):
    """Many writes to one cell in one apply: only the last staged value may remain."""
    t = kit.table((2, 3), torch.int32, name="hot")
    for v in range(1, 41):
        t.stage_write(v % 2, 0, [v, v + 100, v + 200])
    t.stage_write(0, 1, [-7])
    kit.writer().apply([t])
    assert kit.host(t.tensor).tolist() == [[40, -7, 240], [39, 139, 239]]


def test_mixed_dtypes_in_one_apply(kit):
    """int32, int64 (beyond 32 bits) and float32 tables in one apply keep their exact values."""
    tables = [kit.table((2, 5), d, name=str(d)) for d in DTYPES]
    tables[0].stage_write(1, 1, [2**31 - 1, -(2**31)])
    tables[1].stage_write(0, 0, [2**62, -(2**62), 7])
    tables[2].stage_write(1, 3, [1.5, -2.25])
    kit.writer().apply(tables)
    assert kit.host(tables[0].tensor)[1].tolist() == [0, 2**31 - 1, -(2**31), 0, 0]
    assert kit.host(tables[1].tensor)[0].tolist() == [2**62, -(2**62), 7, 0, 0]
    assert kit.host(tables[2].tensor)[1].tolist() == [0.0, 0.0, 0.0, 1.5, -2.25]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_strided_and_offset_views(kit, dtype):
    """Tables that are views (a storage offset, a row stride past the width, a column stride > 1, two
    views of one storage) are written exactly at their cells, and nothing else of the storage changes."""
    base = kit.tensor((7, 10), dtype)
    offset_view = base[1:5, 2:9]  # offset 12, row stride 10, 7 columns
    column_view = base[5:7].t()  # 10 x 2, row stride 1, column stride 10
    t1, t2 = kit.table((4, 7), dtype, name="offset"), kit.table((10, 2), dtype, name="columns")
    t1.tensor, t2.tensor = offset_view, column_view
    writes1 = [(0, 0, [1, 2, 3, 4, 5, 6, 7]), (3, 5, [8, 9]), (2, 1, [10]), (0, 3, [11])]
    writes2 = [(9, 0, [12, 13]), (0, 1, [14]), (4, 0, [15, 16])]
    for w in writes1:
        t1.stage_write(*w)
    for w in writes2:
        t2.stage_write(*w)
    kit.writer().apply([t1, t2])
    expected = np.zeros((7, 10), _NP[dtype])
    apply_writes_reference(expected[1:5, 2:9], writes1)
    apply_writes_reference(expected[5:7].T, writes2)
    np.testing.assert_array_equal(kit.host(base), expected)


def test_one_dimensional_tables(kit):
    """A 1-D table is written as rows of one column; later writes win."""
    vec = kit.table(5, torch.int32, name="vec")
    vec.stage_write_elem(3, 42)
    vec.stage_write_elem(0, -1)
    vec.stage_write_elem(3, 43)
    counts = kit.table(4, torch.int64, name="counts")
    counts.stage_write(2, 0, [2**40])
    kit.writer().apply([vec, counts])
    assert tuple(vec.tensor.shape) == (5,)
    assert kit.host(vec.tensor).tolist() == [-1, 0, 0, 43, 0]
    assert kit.host(counts.tensor).tolist() == [0, 0, 2**40, 0]


def test_many_tables_in_one_apply(kit):
    """Forty tables of varied shapes in one apply, each written where its own writes say."""
    rng = np.random.default_rng(9)
    shapes = [(int(rng.integers(1, 6)), int(rng.integers(1, 9))) for _ in range(40)]
    tables = [kit.table(s, torch.int32, name=f"t{i}") for i, s in enumerate(shapes)]
    expected = [np.zeros(s, np.int32) for s in shapes]
    for _ in range(300):
        i = int(rng.integers(0, 40))
        rows, cols = shapes[i]
        n = int(rng.integers(0, cols + 1))
        w = (int(rng.integers(0, rows)), int(rng.integers(0, cols - n + 1)), rng.integers(-999, 999, n).tolist())
        tables[i].stage_write(*w)
        apply_writes_reference(expected[i], [w])
    kit.writer().apply(tables)
    for t, exp in zip(tables, expected):
        np.testing.assert_array_equal(kit.host(t.tensor), exp, err_msg=t.name)


def test_kernel_block_expansion(kit):
    """`kernel_blocks_per_block=k` writes each value v as v*k + j, j < k."""
    t = kit.table((2, 8), torch.int32, kernel_blocks_per_block=4)
    t.stage_write(1, 2, [5])
    t.stage_write(0, 0, [0, 1])
    kit.writer().apply([t])
    assert kit.host(t.tensor).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 20, 21, 22, 23, 0, 0]]


def test_block_tables_with_kernel_block_sizes(kit, multiwrite_staging):
    """Three KV-cache groups, kernel block sizes 16/16/8: ids expanded, num_blocks on host and device."""
    bt = _block_tables(kit, multiwrite_staging, [16, 32, 8], 4, [8, 8, 8], [16, 16, 8])
    assert bt.backend.NAME == kit.backend
    bt.append_block_ids(0, ([1, 2], [10, 11], []), overwrite=True)
    bt.append_block_ids(1, ([3], [12], [5, 6]), overwrite=True)
    bt.apply_staged_writes()
    assert kit.host(bt[1].tensor)[0].tolist() == [20, 21, 22, 23] + [0] * 12
    assert kit.host(bt[1].tensor)[1, :3].tolist() == [24, 25, 0]
    assert kit.host(bt[0].tensor)[0, :3].tolist() == [1, 2, 0]
    assert kit.host(bt[2].tensor)[1, :3].tolist() == [5, 6, 0]
    assert kit.host(bt.num_blocks_device)[:, :2].tolist() == [[2, 1], [4, 2], [0, 2]]
    bt.append_block_ids(0, ([7], [13], [8]), overwrite=False)
    bt.append_block_ids(1, ([9], [14], []), overwrite=True)  # a new request in row 1, same step
    bt.apply_staged_writes()
    assert kit.host(bt[1].tensor)[0, :8].tolist() == [20, 21, 22, 23, 26, 27, 0, 0]
    assert kit.host(bt[1].tensor)[1, :3].tolist() == [28, 29, 0]
    assert kit.host(bt[2].tensor)[1, :3].tolist() == [5, 6, 0]  # stale ids after the count stay
    assert kit.host(bt.num_blocks_device)[:, :2].tolist() == [[3, 1], [6, 2], [1, 0]]
    assert bt.num_blocks[:, :2].tolist() == [[3, 1], [6, 2], [1, 0]]


def test_block_tables_restaged_row_in_one_step(kit, multiwrite_staging):
    """One row staged three times before one apply (admitted, preempted, re-admitted): the last wins,
    in the ids and in num_blocks."""
    bt = _block_tables(kit, multiwrite_staging, [16, 16], 2, [4, 4])
    ref = ReferenceBlockTables([16, 16], 2, [4, 4])
    calls = [(0, ([1, 2, 3], [4]), True), (0, ([5], [6, 7, 8]), True), (0, ([9], [10]), False), (1, ([11], []), True)]
    for call in calls:
        bt.append_block_ids(*call)
        ref.append_block_ids(*call)
    bt.apply_staged_writes()
    for g in range(2):
        np.testing.assert_array_equal(kit.host(bt[g].tensor), ref.tables[g], err_msg=f"group {g}")
    np.testing.assert_array_equal(kit.host(bt.num_blocks_device), ref.num_blocks)
    assert kit.host(bt[0].tensor)[0].tolist() == [5, 9, 3, 0]


def test_partial_apply_keeps_the_other_groups_staged(kit, multiwrite_staging):
    """Applying some tables of a shared staging arena leaves the others' writes staged, then lands them."""
    bt = _block_tables(kit, multiwrite_staging, [16, 32, 8], 4, [8, 8, 8], [16, 16, 8])
    bt.append_block_ids(0, ([1], [2], [3]), overwrite=True)
    kit.writer().apply([bt[1]])
    assert kit.host(bt[1].tensor)[0, :2].tolist() == [4, 5]
    assert kit.host(bt[0].tensor)[0, 0] == 0 and bt[0].num_staged_writes == 1
    bt.apply_staged_writes()
    assert kit.host(bt[0].tensor)[0, 0] == 1 and kit.host(bt[2].tensor)[0, 0] == 3
    assert kit.host(bt.num_blocks_device)[:, 0].tolist() == [1, 2, 1]


def test_replaced_table_is_written_not_the_old_one(kit):
    """After `t.tensor = new`, writes land in the new storage only."""
    t = kit.table((2, 3), torch.int32)
    writer = kit.writer()
    t.stage_write(0, 0, [1, 2, 3])
    writer.apply([t])
    old = t.tensor
    t.tensor = kit.tensor((4, 3), torch.int32)
    t.stage_write(3, 1, [7, 8])
    t.stage_write(0, 2, [9])
    writer.apply([t])
    assert kit.host(old).tolist() == [[1, 2, 3], [0, 0, 0]]
    assert kit.host(t.tensor).tolist() == [[0, 0, 9], [0, 0, 0], [0, 0, 0], [0, 7, 8]]


def test_error_contract_rejected_write_loses_nothing(kit):
    """A bad write raises StagedWriteError naming table, row, start, length and shape, stages nothing,
    and the writes staged before it still land."""
    t = kit.table((4, 8), torch.int32, name="blocks")
    t.stage_write(2, 1, [7, 8])
    with pytest.raises(StagedWriteError) as info:
        t.stage_write(1, 5, [1, 2, 3, 4])
    for part in ("blocks", "row 1", "start 5", "length", "shape (4, 8)"):
        assert part in str(info.value)
    with pytest.raises(StagedWriteError):
        t.stage_write(0, 0, [2**31])
    assert t.num_staged_writes == 1
    kit.writer().apply([t])
    assert kit.host(t.tensor)[2, :4].tolist() == [0, 7, 8, 0]
    assert int(np.abs(kit.host(t.tensor)).sum()) == 15


def test_error_contract_table_on_another_device(kit):
    """A table on another device than the writer's is refused before anything is written; its writes
    stay staged and land once it is applied on its own device."""
    other = torch.device("meta") if kit.device.type == "cpu" else torch.device("cpu")
    here = kit.table((2, 2), torch.int32, name="here")
    there = kit.table((2, 2), torch.int32, name="there")
    there.tensor = torch.zeros(2, 2, dtype=torch.int32, device=other)
    here.stage_write(0, 0, [1, 2])
    there.stage_write(1, 0, [3])
    with pytest.raises(StagedWriteError, match="there"):
        kit.writer().apply([here, there])
    assert here.num_staged_writes == 1 and there.num_staged_writes == 1
    assert kit.host(here.tensor).tolist() == [[0, 0], [0, 0]]
    kit.writer().apply([here])
    assert kit.host(here.tensor).tolist() == [[1, 2], [0, 0]]


def test_replay_with_overlapping_writes_matches_reference(kit, multiwrite_staging):
    """The trace replay with requests preempted and re-admitted within a step (overlapping writes to one
    row, in the ids and in num_blocks) matches the reference; a backend where the earlier write wins
    fails here."""
    from multiwrite.replay import run_replay
    from multiwrite.workload import load_trace

    result = run_replay(
        load_trace(None),
        [16, 32, 8],
        [16, 16, 8],
        6,
        80,
        kit.device,
        kit.backend,
        check_every=20,
        overlap_rate=0.25,
        tables_class=block_tables_class(multiwrite_staging),
    )
    assert result.overlapping_writes > 20
    assert result.checks >= 4
    assert result.mismatches == 0


def test_a_hand_built_batch_outside_its_table_is_refused(kit):
    """A `WriteBatch` multiwrite did not stage (`checked` false) with a write running past its row: the backend
    refuses it with `StagedWriteError` before writing anything of any batch (`WriteBatch.check_bounds`); clipping
    it silently is a failure."""
    from multiwrite import WriteBatch, select_backend

    backend = select_backend(kit.device, kit.backend)
    good, bad = kit.tensor((3, 4), torch.int32), kit.tensor((3, 4), torch.int32)
    meta_good = np.array([(0, 0, 0, 2, 0)], np.int32)
    meta_bad = np.array([(0, 2, 1, 2, 0), (0, 1, 2, 3, 2)], np.int32)  # write 1 ends at column 5 of 4
    batches = [
        WriteBatch([good], meta_good, np.array([7, 8], np.int32), False, values_in_order=True, checked=False),
        WriteBatch([bad], meta_bad, np.arange(1, 6, dtype=np.int32), False, values_in_order=True, checked=False),
    ]
    with pytest.raises(StagedWriteError):
        backend.apply(batches)
    assert not kit.host(good).any() and not kit.host(bad).any(), "a refused apply wrote cells"


@pytest.mark.parametrize("inputs", ["host", "device"])
def test_the_block_table_stage_matches_the_reference(kit, multiwrite_staging, inputs):
    """`prepare_inputs`, `gather_block_tables` and `compute_slot_mappings` (the plan's stage: gather into batch
    order, zero padding rows, slots with kernel block sizes, -1 for padding tokens and past the scheduled tokens)
    equal `multiwrite.reference`, inputs on the host or on the tables' device."""
    from multiwrite.reference import compute_slot_mappings_reference, gather_block_tables_reference

    bs, kbs, widths, reqs, budget = [16, 32, 8], [16, 16, 8], [5, 4, 6], 6, 24
    bt = kit.block_tables(bs, reqs, widths, kbs, staging=multiwrite_staging, max_num_batched_tokens=budget)
    ref = ReferenceBlockTables(bs, reqs, widths, kbs)
    ref_inputs = [np.zeros((reqs, w * (b // k)), np.int32) for w, b, k in zip(widths, bs, kbs)]
    device = kit.device if inputs == "device" else torch.device("cpu")
    steps = [  # (calls, idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding)
        ([(2, ([1, 2], [3], [4, 5, 14]), True), (4, ([6], [7], [8]), True)], [2, 4], [0, 20, 21], [*range(20), 0],
         3, 22, None),
        ([(2, ([9], [], [10]), False), (5, ([11], [12], [13]), True)], [4, 2, 5], [0, 1, 2, 3], [1, 20, 15], 4, 4,
         [False, False, True, False]),
    ]  # fmt: skip
    for calls, idx, qsl, pos, padded, tokens, pad in steps:
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        t = {k: torch.tensor(v, dtype=dt, device=device) for k, v, dt in
             (("idx", idx, torch.int32), ("qsl", qsl, torch.int32), ("pos", pos, torch.int64))}  # fmt: skip
        t_pad = None if pad is None else torch.tensor(pad + [True] * (tokens - len(pad)), device=device)
        gathered, slots = bt.prepare_inputs(t["idx"], t["qsl"], t["pos"], padded, tokens, t_pad)
        ref.apply_staged_writes()
        pad_list = None if t_pad is None else t_pad.cpu().tolist()
        want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, padded, ref_inputs)
        want_slots = compute_slot_mappings_reference(ref.tables, kbs, idx, qsl, pos, tokens, pad_list)
        for g in range(len(bs)):
            np.testing.assert_array_equal(kit.host(gathered[g]), want[g], err_msg=f"group {g} gathered")
        np.testing.assert_array_equal(kit.host(slots), want_slots, err_msg="slot mappings")
        # the same through the two separate calls
        again = bt.gather_block_tables(t["idx"], padded)
        slots_again = bt.compute_slot_mappings(t["idx"], t["qsl"], t["pos"], tokens, t_pad)
        for g in range(len(bs)):
            np.testing.assert_array_equal(kit.host(again[g]), want[g], err_msg=f"group {g} gather_block_tables")
        np.testing.assert_array_equal(kit.host(slots_again), want_slots, err_msg="compute_slot_mappings")


@pytest.mark.parametrize("kind", ["values", "tensors", "addresses"])
def test_device_sourced_writes_match_the_reference(kit, kind):
    """The optional capability `Backend.apply_device_writes` for each source kind in `DEVICE_WRITE_SOURCES` (skipped
    for the others): two sets per call, with and without host copies, disjoint and overlapping (the later wins),
    empty writes and full rows, equal to `multiwrite.reference.apply_device_writes_reference`; a bad write with host
    copies refused before anything is written, one without skipped whole and counted in the fault record."""
    from multiwrite import DeviceWriteFaults, DeviceWrites, HostCopies, apply_device_writes, select_backend
    from multiwrite.testing.device_writes import draw_sets

    if kind not in select_backend(kit.device, kit.backend).DEVICE_WRITE_SOURCES:
        pytest.skip(f"{kit.backend} does not declare device-sourced writes from {kind}")
    rng = np.random.default_rng(len(kind))
    for bs, host, overlap in ((1, True, False), (40, False, False), (25, False, True), (130, True, False)):
        table = kit.tensor((bs + 1, 24), torch.int32)
        drawn = draw_sets(rng, (bs + 1, 24), kit.device, bs=bs, kind=kind, host=host, overlap=overlap, sets=2)
        expected = drawn.reference(table)
        apply_device_writes(table, drawn.sets, backend=kit.backend)
        np.testing.assert_array_equal(kit.host(table), expected, err_msg=f"bs {bs}, host {host}, overlap {overlap}")
    dev = kit.device
    table = kit.tensor((3, 4), torch.int32)
    r, s, n = [0, 1, 2], [0, 3, 0], [2, 2, 1]  # write 1 runs past its row
    bad = [torch.tensor(x, device=dev) for x in (r, s, n)]
    with pytest.raises(StagedWriteError, match="request 1"):
        apply_device_writes(table, DeviceWrites(*bad, values=torch.arange(1, 6, dtype=torch.int32, device=dev),
                                                host=HostCopies(r, s, n)), backend=kit.backend)  # fmt: skip
    assert not kit.host(table).any(), "a refused call wrote cells"
    faults = DeviceWriteFaults(dev)
    apply_device_writes(table, DeviceWrites(*bad, values=torch.arange(1, 6, dtype=torch.int32, device=dev)),
                        backend=kit.backend, faults=faults)  # fmt: skip
    assert kit.host(table).tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0]], "a bad write was not skipped whole"
    with pytest.raises(StagedWriteError, match="1 bad write"):
        faults.check()
