"""Bad input: a clear error naming the table, row, start, length and shape; nothing staged or lost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, StagedWriteTensor


@pytest.mark.parametrize(
    ("dtype", "row", "start", "values", "fragment"),
    [
        (torch.int32, 4, 0, [1], "row 4 is outside [0, 4)"),
        (torch.int32, -1, 0, [1], "row -1 is outside"),
        (torch.int32, 1, -2, [1], "start is negative"),
        (torch.int32, 1, 5, [1, 2, 3, 4], "ends at column 9 past the row width 8"),
        (torch.int32, 1, 0, [2**31], "value 2147483648 does not fit int32"),
        (torch.int32, 1, 0, [-(2**31) - 1], "does not fit int32"),
        (torch.int32, 1, 0, [1, 2.5], "float value cannot go into an integer table"),
        (torch.int64, 1, 0, [2**63], "does not fit int64"),
        (torch.int64, 1, 0, np.array([1.0]), "float64 cannot go into an integer table"),
        (torch.int32, 1, 0, np.array([2**40]), "does not fit int32"),
        (torch.int32, 1, 0, [None], "not integers"),
        (torch.int32, 1, 0, np.zeros((2, 2), dtype=np.int32), "must be 1-D"),
        (torch.float32, 1, 0, [1e39], "overflows float32"),
        (torch.float32, 1, 0, ["x"], "not numbers"),
    ],
)
def test_stage_write_rejects_and_names_everything(backend, dtype, row, start, values, fragment):
    t = StagedWriteTensor((4, 8), dtype, backend.device, name="blocks")
    t.stage_write(2, 1, [7, 8])
    with pytest.raises(StagedWriteError) as info:
        t.stage_write(row, start, values)
    message = str(info.value)
    assert fragment in message
    for part in ("blocks", f"row {row}", f"start {start}", "length", "shape (4, 8)"):
        assert part in message
    # nothing staged by the rejected write; the earlier one is intact and still lands
    assert t.num_staged_writes == 1
    FusedStagedWriter(backend.device, backend.name).apply([t])
    assert t.tensor[2].tolist()[:3] == [0, 7, 8]
    assert int(t.tensor.abs().sum()) == 15


def test_error_is_a_value_error():
    assert issubclass(StagedWriteError, ValueError)


def test_unsupported_dtype_and_size():
    with pytest.raises(StagedWriteError, match="dtype=torch.float16"):
        StagedWriteTensor((2, 2), torch.float16)
    with pytest.raises(StagedWriteError, match="size must be"):
        StagedWriteTensor((2, 2, 2))


def test_expanded_ids_must_fit_int32():
    t = StagedWriteTensor((2, 8), torch.int32, kernel_blocks_per_block=2, name="g1")
    with pytest.raises(StagedWriteError, match="expanded to 2 kernel blocks"):
        t.stage_write(0, 0, [2**30])
    with pytest.raises(StagedWriteError, match=r"ends at column 10 past the row width 8 \(5 values x 2"):
        t.stage_write(0, 0, [1, 2, 3, 4, 5])
    assert t.num_staged_writes == 0


def tables(backend) -> BlockTables:
    return BlockTables([16, 32, 8], 4, [4, 4, 4], backend.device, kernel_block_sizes=[16, 16, 8], backend=backend.name)


@pytest.mark.parametrize(
    ("req", "ids", "overwrite", "fragment"),
    [
        (0, ([1], [2]), False, "got block ids for 2 KV-cache groups, the tables have 3"),
        (4, ([1], [2], [3]), False, "request row 4 is outside [0, 4)"),
        (1.5, ([1], [2], [3]), False, "is not an integer"),
        (0, ([1], [2, 3, 4, 5], [3]), False, "group 1"),  # 2 held + 4 new x 2 kernel blocks > width 8
        (0, ([1], [2], [-3]), False, "negative"),
        (0, ([1], [2**30], [3]), False, "overflow int32"),
        (0, ([1], [2], [3.0]), False, "float value"),
        (0, ([1], [2], [2**31]), True, "block id 2147483648 is too large: it does not fit int32"),
        (0, ([1], [2], np.array([1.5])), True, "cannot go into an integer table"),
        (0, ([1, 2, 3, 4, 5], [], []), True, "end at column 5, past the row width 4"),
    ],
)
def test_append_block_ids_rejects_without_staging_anything(staging, backend, req, ids, overwrite, fragment):
    bt = tables(backend)
    bt.append_block_ids(0, ([9], [8], [7]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([5], [6], []), overwrite=True)
    before = bt.num_blocks.copy()
    with pytest.raises(StagedWriteError) as info:
        bt.append_block_ids(req, ids, overwrite)
    assert fragment in str(info.value)
    np.testing.assert_array_equal(bt.num_blocks, before)
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]  # an overwrite stages every group
    bt.apply_staged_writes()
    assert bt[0].tensor[:2, 0].tolist() == [9, 5]
    assert bt[1].tensor[:2, :2].tolist() == [[16, 17], [12, 13]]
    assert bt[2].tensor[:2, 0].tolist() == [7, 0]
    assert bt.num_blocks_device[:, :2].tolist() == [[1, 1], [2, 2], [1, 0]]


def test_block_size_must_divide():
    with pytest.raises(
        StagedWriteError, match="group 1 block size 24 is not a positive multiple of its kernel block size 16"
    ):
        BlockTables([16, 24], 2, [4, 4], "cpu", kernel_block_sizes=[16, 16])
    with pytest.raises(StagedWriteError, match="kernel_block_sizes has 1 entries for 2"):
        BlockTables([16, 32], 2, [4, 4], "cpu", kernel_block_sizes=[16])


def test_apply_on_another_device_writes_nothing_and_keeps_writes(backend):
    on_cpu = StagedWriteTensor((2, 4), torch.int32, backend.device, name="local")
    elsewhere = StagedWriteTensor((2, 4), torch.int32, "meta", name="remote")
    on_cpu.stage_write(0, 0, [1, 2])
    elsewhere.stage_write(1, 1, [3])
    with pytest.raises(
        StagedWriteError, match=r"remote \(shape \(2, 4\), int32\) is on meta.*1 staged writes stay staged"
    ):
        FusedStagedWriter(backend.device, backend.name).apply([on_cpu, elsewhere])
    assert on_cpu.tensor.sum() == 0
    assert on_cpu.num_staged_writes == 1 and elsewhere.num_staged_writes == 1
    FusedStagedWriter(backend.device, backend.name).apply([on_cpu])
    assert on_cpu.tensor[0].tolist() == [1, 2, 0, 0]


def test_shrunk_table_is_caught_before_writing(backend):
    t = StagedWriteTensor((4, 4), torch.int32, backend.device, name="shrinking")
    t.stage_write(3, 0, [1])
    with pytest.raises(StagedWriteError, match="does not fit shape"):
        t.tensor = torch.zeros(2, 4, dtype=torch.int32, device=backend.device)
    with pytest.raises(StagedWriteError, match="replacement tensor must be 2-D int32"):
        t.tensor = torch.zeros(4, 4, dtype=torch.int64, device=backend.device)
    t.tensor.resize_(2, 4)  # in place, behind the library's back
    with pytest.raises(StagedWriteError, match="does not fit shape"):
        FusedStagedWriter(backend.device, backend.name).apply([t])
    assert t.num_staged_writes == 1


def test_clear_staged_writes_restores_num_blocks(staging, backend):
    bt = tables(backend)
    bt.append_block_ids(0, ([1], [2], [3]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(0, ([4], [], []), overwrite=False)
    assert bt.num_blocks[0, 0] == 2
    bt.clear_staged_writes()
    assert bt.num_blocks[:, 0].tolist() == [1, 2, 1]
    bt.apply_staged_writes()
    assert bt[0].tensor[0].tolist() == [1, 0, 0, 0]
