"""Bugs found by trying to break the library, each pinned by a test that failed before its fix."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, StagedWriteTensor, apply_writes
from multiwrite.reference import ReferenceBlockTables


def test_staging_that_grows_in_the_middle_of_a_call_loses_nothing(staging, backend):
    # 1,000 ids overflow the initial staging arrays inside one call, then again across calls.
    bt = BlockTables([16, 32], 3, [1024, 600], backend.device, [16, 16], backend=backend.name)
    ref = ReferenceBlockTables([16, 32], 3, [1024, 600], [16, 16])
    calls = [
        (0, (np.arange(1000), list(range(1, 300))), True),
        (1, (list(range(500, 600)), np.arange(7, 9)), True),
        (2, ([np.int64(5)] * 3, []), True),
        (1, (list(range(9)), [3]), False),
    ]
    for call in calls:
        bt.append_block_ids(*call)
        ref.append_block_ids(*call)
    bt.apply_staged_writes()
    for g in range(2):
        np.testing.assert_array_equal(bt[g].tensor.cpu().numpy(), ref.tables[g], err_msg=f"group {g}")
    np.testing.assert_array_equal(bt.num_blocks_device.cpu().numpy(), ref.num_blocks)


def test_a_mutated_list_is_not_mistaken_for_the_last_one(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    a = StagedWriteTensor((2, 2), torch.int32, backend.device, name="a")
    b = StagedWriteTensor((2, 2), torch.int32, backend.device, name="b")
    tables = [a]
    a.stage_write(0, 0, [1])
    writer.apply(tables)
    tables[0] = b
    b.stage_write(0, 0, [2])
    a.stage_write(1, 0, [3])
    writer.apply(tables)
    assert b.tensor.tolist() == [[2, 0], [0, 0]] and b.num_staged_writes == 0
    assert a.tensor.tolist() == [[1, 0], [0, 0]] and a.num_staged_writes == 1  # not asked for: still staged


def test_resize_in_place_is_caught_on_the_repeat_path_too(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor((4, 8), torch.int32, backend.device, name="c")
    tables = [t]
    t.stage_write(0, 0, [1])
    writer.apply(tables)
    t.stage_write(3, 0, [7] * 4)
    t.tensor.resize_(2, 4)
    with pytest.raises(StagedWriteError, match="does not fit shape"):
        writer.apply(tables)
    assert t.num_staged_writes == 1


def test_growing_in_place_widens_the_checks(backend):
    t = StagedWriteTensor((4, 16), torch.int32, backend.device, name="grown")
    t.tensor.resize_(4, 32)
    t.stage_write(0, 20, [1])  # past the old width, inside the new one
    FusedStagedWriter(backend.device, backend.name).apply([t])
    assert t.tensor[0, 20] == 1


@pytest.mark.parametrize(
    "values", [[1.5] * 9, ["1"] * 9, [np.float64(5.5)] * 9, [True, 2.5] * 5], ids=["float", "str", "np-float", "mixed"]
)
def test_long_lists_are_checked_like_short_ones(values):
    t = StagedWriteTensor((2, 16), torch.int32, name="long")
    with pytest.raises(StagedWriteError, match="long .*row 0, start 0"):
        t.stage_write(0, 0, values)
    assert t.num_staged_writes == 0


def test_float_tables_cannot_expand_kernel_blocks():
    with pytest.raises(StagedWriteError, match="needs an integer table"):
        StagedWriteTensor((2, 4), torch.float32, kernel_blocks_per_block=2)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: StagedWriteTensor((2.5, 3)), "size must be integers"),
        (lambda: StagedWriteTensor((2, 3), kernel_blocks_per_block=1.5), "must be an integer"),
        (lambda: BlockTables([16.7], 2, [4], "cpu"), "block_sizes must be integers"),
        (lambda: BlockTables([16], 2.5, [4], "cpu"), "max_num_reqs must be an integer, got 2.5"),
        (lambda: BlockTables([16], 2, [0], "cpu"), "max_num_blocks_per_group must be >= 1"),
        (lambda: BlockTables([16], 2, [-1], "cpu"), "max_num_blocks_per_group must be >= 1"),
    ],
)
def test_sizes_are_integers_not_truncated_floats(make, fragment):
    with pytest.raises(StagedWriteError, match=fragment):
        make()


def test_numpy_integer_size_is_fine():
    assert StagedWriteTensor(np.int64(4)).tensor.shape == (4,)


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        (torch.ones(2, dtype=torch.bfloat16), "dtype torch.bfloat16"),
        ({1, 2}, "ordered sequence, got a set"),
        ({1: 2}, "ordered sequence, got a dict"),
    ],
)
def test_unsupported_value_containers(values, fragment):
    t = StagedWriteTensor((2, 4), torch.int32, name="kinds")
    with pytest.raises(StagedWriteError, match=fragment):
        t.stage_write(0, 0, values)


def test_replacement_must_be_a_tensor():
    t = StagedWriteTensor((2, 4), torch.int32)
    with pytest.raises(StagedWriteError, match="must be a torch.Tensor, got str"):
        t.tensor = "x"


def test_bool_rows_are_rejected(staging, backend):
    bt = BlockTables([16, 16], 2, [4, 4], backend.device, backend=backend.name)
    with pytest.raises(StagedWriteError, match="not a bool"):
        bt.append_block_ids(True, ([9], []), True)
    t = StagedWriteTensor((2, 4), torch.int32, backend.device)
    with pytest.raises(StagedWriteError, match=r"a bool \(True\), not an integer"):
        t.stage_write(True, 0, [1])
    assert bt.num_blocks.sum() == 0 and t.num_staged_writes == 0


def test_generator_of_groups_is_accepted(staging, backend):
    bt = BlockTables([16, 16], 2, [4, 4], backend.device, backend=backend.name)
    bt.append_block_ids(1, (ids for ids in ([1], [2, 3])), True)
    bt.apply_staged_writes()
    assert bt.num_blocks[:, 1].tolist() == [1, 2] and bt[1].tensor[1, :2].tolist() == [2, 3]
    assert bt.num_blocks_device[:, 1].tolist() == [1, 2]


def test_applied_tables_are_not_kept_alive(backend):
    t = StagedWriteTensor((64, 64), torch.int32, backend.device)
    t.stage_write(0, 0, [1])
    apply_writes(t)
    table = weakref.ref(t.tensor)
    del t
    gc.collect()
    assert table() is None
    bt = BlockTables([16], 8, [8], backend.device, backend=backend.name)
    bt.append_block_ids(0, ([1],), True)
    bt.apply_staged_writes()
    bt.apply_staged_writes()
    group = weakref.ref(bt[0].tensor)
    del bt
    gc.collect()
    assert group() is None


def test_overlap_flag_follows_the_writes_of_a_batch(staging):
    """Backends that write in parallel (the Triton kernel) rely on this flag to keep staging order."""
    bt = BlockTables([16, 32], 4, [8, 8], "cpu", [16, 16], backend="torch-cpu")
    bt.append_block_ids(0, ([1], [2]), True)
    bt.append_block_ids(1, ([3], []), True)
    bt.append_block_ids(2, ([], [4]), False)
    assert not bt._arena.may_overlap  # distinct rows
    bt.append_block_ids(1, ([5], []), False)  # row 1 again in the same batch
    assert bt._arena.may_overlap
    bt.apply_staged_writes()
    assert not bt._arena.may_overlap
    bt.append_block_ids(1, ([6], []), False)  # a new batch: row 1 is free again
    assert not bt._arena.may_overlap
    bt.clear_staged_writes()
    bt.append_block_ids(1, ([6], []), False)
    assert not bt._arena.may_overlap
    bt[0].stage_write(3, 0, [9])  # a direct write into a group: assumed to overlap
    assert bt._arena.may_overlap
    bt.apply_staged_writes()
    assert bt[0].tensor[:, :3].tolist() == [[1, 0, 0], [3, 5, 6], [0, 0, 0], [9, 0, 0]]
