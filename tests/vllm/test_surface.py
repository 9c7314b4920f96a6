"""`multiwrite.vllm.BlockTables`: vLLM 0.33's surface (constructor order, attributes and their types, shapes and
addresses), its own policies (an apply at once, the deprecated `defer_apply`, the null-block redirect, zero
groups), and its errors (a write past a row is a `RuntimeError` that stages nothing for any group), on every backend."""

from __future__ import annotations

import enum
import inspect
import warnings

import numpy as np
import pytest
import torch

from multiwrite import StageInputError, TableMovedError
from multiwrite.vllm import BlockTables
from tests.support.tables import host

VLLM_033_PARAMETERS = [
    "block_sizes", "max_num_reqs", "max_num_batched_tokens", "max_num_blocks_per_group", "device", "cp_size",
    "cp_rank", "cp_interleave", "slot_mapping_enabled", "dcp_sharded", "sliding_window_reach",
]  # fmt: skip


def tables(backend, **kwargs) -> BlockTables:
    return BlockTables([16, 32], 4, 64, [4, 2], backend.device, backend=backend.name, **kwargs)


def vec(values, device, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=device)


def test_the_constructor_takes_vllm_033_parameters_in_order_and_ours_only_as_keywords():
    params = list(inspect.signature(BlockTables).parameters.values())
    assert [p.name for p in params[: len(VLLM_033_PARAMETERS)]] == VLLM_033_PARAMETERS
    assert [p.default for p in params[5:11]] == [1, 0, 1, None, None, None]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(VLLM_033_PARAMETERS) :])
    assert BlockTables.redirect_writes_to_null_block is False


def test_the_attributes_vllm_reads_have_its_types_shapes_and_addresses(backend):
    d = backend.device
    bt = BlockTables([16, 32], 4, 64, [4, 2], d, 2, 1, 8, [True, False], [False, True], [7, 0], backend=backend.name)
    assert (bt.num_kv_cache_groups, bt.max_num_reqs, bt.max_num_batched_tokens) == (2, 4, 64)
    assert (bt.cp_size, bt.cp_rank, bt.cp_interleave, bt.block_sizes) == (2, 1, 8, [16, 32])
    for g, width in enumerate([4, 2]):
        t = bt.block_tables[g].gpu
        assert t.shape == (4, width) and t.dtype == torch.int32 and t.is_contiguous() and t.device == d
        assert t.data_ptr() % 16 == 0  # (vLLM's kernels assume 16-byte aligned table addresses)
        assert bt.input_block_tables[g].shape == (4, width) and bt.input_block_tables[g].dtype == torch.int32
    assert bt.slot_mappings.shape == (2, 64) and bt.slot_mappings.dtype == torch.int64
    assert bt.num_blocks.np.shape == (2, 4) and bt.num_blocks.np.dtype == np.int32 and bt.num_blocks.gpu.device == d
    assert host(bt.block_table_ptrs).tolist() == [t.gpu.data_ptr() for t in bt.block_tables]
    assert bt.block_table_ptrs.dtype == torch.uint64 and bt.input_block_table_ptrs.dtype == torch.uint64
    assert host(bt.input_block_table_ptrs).tolist() == [t.data_ptr() for t in bt.input_block_tables]
    assert host(bt.block_table_strides).tolist() == [4, 2] and bt.block_table_strides.dtype == torch.int64
    assert host(bt.block_sizes_tensor).tolist() == [16, 32] and bt.block_sizes_tensor.dtype == torch.int32
    assert host(bt.slot_mapping_enabled).tolist() == [True, False] and host(bt.dcp_sharded).tolist() == [False, True]
    # vLLM 0.33 disables the sliding-window cut under context parallelism
    assert host(bt.sliding_window_reach).tolist() == [0, 0] and not bt.has_sliding_window_groups
    before = bt.block_table_ptrs
    bt.init_block_table_layout_tensors()
    assert bt.block_table_ptrs is not before and host(bt.block_table_ptrs).tolist() == host(before).tolist()


def test_a_write_past_a_row_is_a_runtime_error_naming_request_group_and_capacity_and_stages_nothing(backend):
    bt = tables(backend)
    bt.append_block_ids(2, ([1, 2], [3]), True)
    with pytest.raises(RuntimeError, match=r"request 2.*group 1.*past the row width 2") as err:
        bt.append_block_ids(2, ([4, 5], [6, 7]), False)  # group 0 fits (4 of 4), group 1 would need 3 of 2
    assert isinstance(err.value, ValueError)  # (also multiwrite's StagedWriteError)
    assert bt.num_blocks.np[:, 2].tolist() == [2, 1] and bt.core.num_staged_writes == 3  # group 0's 2 blocks not kept
    bt.apply_staged_writes()
    out = bt.gather_block_tables(vec([2], backend.device), 1)
    assert host(out[0]).tolist() == [[1, 2, 0, 0]] and host(out[1]).tolist() == [[3, 0]]


def test_an_apply_lands_at_once_as_vllms_does(backend):
    """Issue 23, item 3: the apply was deferred into the next gather or slot mapping; a kernel (or a CUDA graph
    replay) reading the tables in between saw them without the step's writes. Read here through the core, which
    never ran a deferred apply."""
    bt = tables(backend)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    bt.apply_staged_writes()
    assert bt.core.num_staged_writes == 0
    assert host(bt.core[0].tensor)[0].tolist() == [1, 2, 0, 0] and host(bt.core[1].tensor)[0].tolist() == [3, 0]
    assert host(bt.core.num_blocks_device)[:, 0].tolist() == [2, 1]
    bt.append_block_ids(0, ([4], [5]), False)  # staged, not applied: the device tables do not change
    assert host(bt.block_tables[0].gpu)[0].tolist() == [1, 2, 0, 0] and host(bt.num_blocks.gpu)[:, 0].tolist() == [2, 1]
    bt.apply_staged_writes()
    assert host(bt.core[0].tensor)[0].tolist() == [1, 2, 4, 0] and host(bt.core[1].tensor)[0].tolist() == [3, 5]
    assert bt.num_blocks.gpu is bt.core.num_blocks_device and bt.block_tables[0].gpu is bt.core[0].tensor


@pytest.mark.parametrize("defer_apply", [True, False])
def test_defer_apply_is_deprecated_and_changes_nothing(backend, defer_apply):
    with pytest.warns(DeprecationWarning, match=r"defer_apply=.*no effect.*applies at once"):
        bt = BlockTables([4], 2, 8, [2], backend.device, backend=backend.name, defer_apply=defer_apply)
    bt.append_block_ids(0, ([1, 2],), True)
    bt.apply_staged_writes()
    assert bt.core.num_staged_writes == 0 and host(bt.core[0].tensor)[0].tolist() == [1, 2]


def test_no_warning_without_defer_apply(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BlockTables([4], 2, 8, [2], backend.device, backend=backend.name)


class Row(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize(
    "row", [np.int64(1), np.int32(1), Row.ONE, torch.tensor(1)], ids=["np.int64", "np.int32", "IntEnum", "0-d"]
)
def test_a_row_of_any_integer_type_after_an_apply_stays_staged_until_the_next_apply(backend, row):
    """Issue 23, item 3 (b): a row that is not a Python int skipped the flush of the deferred apply and joined its
    batch, so that a read of the tables before the next apply showed its writes."""
    d = backend.device
    bt = tables(backend)
    bt.append_block_ids(1, ([1, 2], [3]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(row, ([4], [5]), False)
    assert [host(t.gpu)[1].tolist() for t in bt.block_tables] == [[1, 2, 0, 0], [3, 0]]  # as the first apply left it
    assert host(bt.num_blocks.gpu)[:, 1].tolist() == [2, 1] and bt.num_blocks.np[:, 1].tolist() == [3, 2]
    bt.apply_staged_writes()
    assert [host(t.gpu)[1].tolist() for t in bt.block_tables] == [[1, 2, 4, 0], [3, 5]]
    assert host(bt.num_blocks.gpu)[:, 1].tolist() == [3, 2]
    gathered = bt.gather_block_tables(vec([1], d), 1)
    assert host(gathered[0]).tolist() == [[1, 2, 4, 0]] and host(gathered[1]).tolist() == [[3, 5]]
    slots = bt.compute_slot_mappings(vec([1], d), vec([0, 2], d), vec([33, 40], d, torch.int64), 2)
    assert host(slots).tolist() == [[4 * 16 + 1, 4 * 16 + 8], [5 * 32 + 1, 5 * 32 + 8]]


def test_the_null_block_redirect_stages_zeros_and_still_counts(backend):
    bt = tables(backend)
    bt.redirect_writes_to_null_block = True
    bt.append_block_ids(1, ([5, 6, 7], [8]), True)
    bt.redirect_writes_to_null_block = False
    bt.append_block_ids(1, ([9], []), False)
    bt.apply_staged_writes()
    out = bt.gather_block_tables(vec([1], backend.device), 1)
    assert host(out[0]).tolist() == [[0, 0, 0, 9]] and host(out[1]).tolist() == [[0, 0]]
    assert bt.num_blocks.np[:, 1].tolist() == [4, 1]


def test_gather_and_slot_mappings_into_the_callers_buffers(backend):
    d = backend.device
    bt = tables(backend)
    bt.append_block_ids(3, ([1, 2], [3]), True)
    bt.apply_staged_writes()
    outs = [torch.full((3, 4), 9, dtype=torch.int32, device=d), torch.full((3, 2), 9, dtype=torch.int32, device=d)]
    ptrs = torch.tensor([t.data_ptr() for t in outs], dtype=torch.uint64, device=d)
    got = bt.gather_block_tables(vec([3], d), 2, out=outs, out_ptrs=ptrs)
    assert got[0].data_ptr() == outs[0].data_ptr() and host(outs[0]).tolist() == [[1, 2, 9, 9], [0] * 4, [9] * 4]
    assert host(bt.input_block_tables[0]).sum() == 0  # the persistent tables are not touched
    sm = torch.zeros((2, 5), dtype=torch.int64, device=d)
    got = bt.compute_slot_mappings(vec([3], d), vec([0, 2], d), vec([0, 17], d), 3, out=sm)
    assert got.data_ptr() == sm.data_ptr() and host(sm).tolist() == [[16, 33, -1, -1, -1], [96, 113, -1, -1, -1]]
    with pytest.raises(StageInputError, match=r"out\[1\] must be an int32 \[>= 2, 2\]"):
        bt.gather_block_tables(vec([3], d), 2, out=[outs[0], outs[0]])


def test_dummies_zero_and_pad_at_the_persistent_addresses(backend):
    d = backend.device
    bt = tables(backend)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    bt.apply_staged_writes()
    bt.gather_block_tables(vec([0, 0, 0], d), 3)
    bt.compute_slot_mappings(vec([0], d), vec([0, 1], d), vec([0], d), 1)
    dummy = bt.get_dummy_block_tables(2)
    assert dummy[0].data_ptr() == bt.input_block_tables[0].data_ptr() and host(bt.input_block_tables[0]).sum() == 0
    slots = bt.get_dummy_slot_mappings(7)
    assert slots.shape == (2, 7) and (host(bt.slot_mappings) == -1).all()


def test_zero_kv_cache_groups_work(backend):
    bt = BlockTables([], 4, 16, [], backend.device, backend=backend.name)
    bt.append_block_ids(0, (), True)
    bt.apply_staged_writes()
    assert bt.gather_block_tables(torch.tensor([0]), 1) == () and bt.get_dummy_block_tables(2) == ()
    assert bt.compute_slot_mappings(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]), 3).shape == (0, 3)
    assert bt.get_dummy_slot_mappings(5).shape == (0, 5) and bt.block_table_ptrs.numel() == 0
    assert bt.num_kv_cache_groups == 0 and bt.input_block_tables == [] and bt.block_tables == []


def test_a_host_entry_below_minus_one_or_past_the_rows_is_refused_and_nothing_applied(backend):
    bt = tables(backend)
    bt.append_block_ids(0, ([1], [2]), True)
    bt.apply_staged_writes()
    for bad, value in (([0, -2], -2), ([4], 4)):
        with pytest.raises(StageInputError, match=rf"idx_mapping\[\d\]={value} is outside"):
            bt.gather_block_tables(torch.tensor(bad), 2)
    assert host(bt.gather_block_tables(torch.tensor([0]), 1)[0]).tolist() == [[1, 0, 0, 0]]


def test_the_tables_cannot_be_copied_or_pickled(backend):
    """Issue 23, item 11: built on a hard-coded CPU device, this failed in a run forcing a GPU backend."""
    import copy
    import pickle

    bt = BlockTables([4], 2, 8, [4], backend.device, backend=backend.name)
    for action in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            action(bt)


def test_a_refused_append_to_a_bad_row_stages_nothing(backend):
    bt = tables(backend)
    bt.append_block_ids(0, ([1], [2]), True)
    staged = bt.core.num_staged_writes
    with pytest.raises(RuntimeError, match="request row 9"):
        bt.append_block_ids(9, ([3], [4]), True)
    assert bt.core.num_staged_writes == staged and bt.num_blocks.np.sum() == 2
    bt.apply_staged_writes()
    assert host(bt.gather_block_tables(vec([0], backend.device), 1)[0]).tolist() == [[1, 0, 0, 0]]


def test_check_addresses_is_passed_to_the_core_and_a_re_pointed_table_is_refused_naming_its_group(backend, monkeypatch):
    monkeypatch.delenv("MULTIWRITE_CHECK_ADDRESSES", raising=False)
    bt = tables(backend, check_addresses=True)
    assert bt.core.checks_addresses and not tables(backend).core.checks_addresses
    bt.append_block_ids(1, ([4, 5], [6]), True)
    gpu = bt.block_tables[1].gpu
    saved, old = gpu.data, gpu.data_ptr()
    gpu.data = torch.zeros_like(gpu)
    with pytest.raises(TableMovedError, match=rf"^BlockTables.apply_staged_writes: group 1 of a BlockTables was "
                                              rf"re-pointed to other memory .*its address was {old:#x}"):  # fmt: skip
        bt.apply_staged_writes()
    with pytest.raises(TableMovedError, match="BlockTables.refresh_layout: group 1"):  # (also with checking off)
        bt.init_block_table_layout_tensors()
    gpu.data = saved
    assert bt.core.num_staged_writes == 3
    bt.apply_staged_writes()
    out = bt.gather_block_tables(vec([1], backend.device), 1)
    assert host(out[0]).tolist() == [[4, 5, 0, 0]] and host(out[1]).tolist() == [[6, 0]]
