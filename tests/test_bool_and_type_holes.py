"""Bools and text never pass for integers (found by a new user, 2026-11-30): a one-element bool tensor or
`numpy.bool_` as a row, `True` as a table size or request count, bytes or str as values. Each was accepted
and silently meant 1 (or the bytes' codes); each must be a `StagedWriteError` that stages nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, StagedWriteError, StagedWriteTensor

BOOLS = [True, np.bool_(True), torch.tensor(True), np.array(True)]


@pytest.mark.parametrize("flag", BOOLS, ids=["bool", "np.bool_", "tensor", "ndarray"])
def test_a_bool_is_no_row_or_start(flag):
    t = StagedWriteTensor((3, 4), torch.int32)
    with pytest.raises(StagedWriteError, match="bool"):
        t.stage_write(flag, 0, [1])
    with pytest.raises(StagedWriteError, match="bool"):
        t.stage_write(0, flag, [1])
    assert t.num_staged_writes == 0


@pytest.mark.parametrize("flag", BOOLS, ids=["bool", "np.bool_", "tensor", "ndarray"])
def test_a_bool_is_no_request_row(staging, flag):
    bt = BlockTables([16], 3, [4], "cpu", backend="torch-cpu")
    with pytest.raises(StagedWriteError, match="integer"):
        bt.append_block_ids(flag, ([1],), overwrite=True)
    assert bt[0].num_staged_writes == 0 and bt.num_blocks.tolist() == [[0, 0, 0]]


def test_a_bool_is_no_size():
    with pytest.raises(StagedWriteError, match=r"size must be integers .* got \(True, 2\)"):
        StagedWriteTensor((True, 2), torch.int32)
    with pytest.raises(StagedWriteError, match="max_num_reqs must be an integer, got True"):
        BlockTables([16], True, [10], "cpu", backend="torch-cpu")
    with pytest.raises(StagedWriteError, match=r"block_sizes must be integers, got \[True\]"):
        BlockTables([True], 2, [10], "cpu", backend="torch-cpu")


def test_text_is_no_sizes_and_messages_show_what_was_passed():
    with pytest.raises(StagedWriteError, match=r"block_sizes must be a sequence of integers, got '16'"):
        BlockTables("16", 4, [10], "cpu", backend="torch-cpu")
    with pytest.raises(StagedWriteError, match=r"max_num_reqs must be an integer, got 4\.0"):
        BlockTables([16], 4.0, [10], "cpu", backend="torch-cpu")


@pytest.mark.parametrize("values", [b"\x01\x02", bytearray(b"\x01"), "12", memoryview(b"\x05")])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_bytes_and_str_are_no_values(values, dtype):
    t = StagedWriteTensor((2, 4), dtype)
    t.stage_write(1, 0, [7])
    with pytest.raises(StagedWriteError, match="values must be numbers"):
        t.stage_write(0, 0, values)
    assert t.num_staged_writes == 1  # the earlier write stays staged, nothing of this one
