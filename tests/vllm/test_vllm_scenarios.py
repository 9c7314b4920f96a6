"""The scenarios vLLM's own tests check of its v2 `BlockTables` (tests/v1/worker/test_gpu_block_table.py upstream),
re-expressed with concrete expected values, plus the other cases of the contract multiwrite's class keeps.

Each test runs on `multiwrite.vllm.BlockTables` and, where the oracle is located (`tox -e vllm`), on vLLM 0.33's own
class too, which so confirms the expected values. Tests of what multiwrite does beyond vLLM run on ours alone.
"""

from __future__ import annotations

import pytest
import torch

PAD = -1


@pytest.fixture(params=["multiwrite", "vllm"])
def make(request, device):
    """`make(*args, **kwargs)`: a `BlockTables` (multiwrite's or vLLM's) on the test device."""
    if request.param == "vllm":
        oracle = request.getfixturevalue("oracle")
        return lambda *a, **kw: oracle.make(*a, device=device, **kw)
    from multiwrite.vllm import BlockTables

    return lambda *a, **kw: BlockTables(*a, device=device, **kw)


@pytest.fixture
def ours(device):
    from multiwrite.vllm import BlockTables

    return lambda *a, **kw: BlockTables(*a, device=device, **kw)


@pytest.fixture
def t(device):
    """`t(values, dtype=torch.int32)`: a tensor on the test device."""
    return lambda values, dtype=torch.int32: torch.tensor(values, dtype=dtype, device=device)


def rows(x: torch.Tensor) -> list:
    return x.cpu().tolist()


def test_multi_group_writes_apply_together_then_append(make):
    bt = make(block_sizes=[16, 32, 8], max_num_reqs=4, max_num_batched_tokens=64, max_num_blocks_per_group=[8, 8, 8])
    bt.append_block_ids(req_index=0, new_block_ids=([4, 5], [20, 21], []), overwrite=True)
    bt.append_block_ids(req_index=2, new_block_ids=([6], [22], [30, 31]), overwrite=True)
    assert bt.num_blocks.np.tolist() == [[2, 0, 1, 0], [2, 0, 1, 0], [0, 0, 2, 0]]  # counted at once, on the host
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu[[0, 2], :3]) == [[4, 5, 0], [6, 0, 0]]
    assert rows(bt.block_tables[1].gpu[[0, 2], :3]) == [[20, 21, 0], [22, 0, 0]]
    assert rows(bt.block_tables[2].gpu[[0, 2], :3]) == [[0, 0, 0], [30, 31, 0]]
    assert rows(bt.num_blocks.gpu) == [[2, 0, 1, 0], [2, 0, 1, 0], [0, 0, 2, 0]]
    bt.append_block_ids(req_index=0, new_block_ids=([9], [23], [32]), overwrite=False)
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu[0, :4]) == [4, 5, 9, 0]
    assert rows(bt.block_tables[1].gpu[0, :4]) == [20, 21, 23, 0]
    assert rows(bt.block_tables[2].gpu[0, :2]) == [32, 0]
    assert bt.num_blocks.np[:, 0].tolist() == [3, 3, 1]
    assert rows(bt.num_blocks.gpu[:, 0]) == [3, 3, 1]
    bt.apply_staged_writes()  # nothing staged: nothing changes
    assert rows(bt.block_tables[0].gpu[0, :4]) == [4, 5, 9, 0]


def test_single_group_and_overwrite_of_a_reused_row(make):
    bt = make(block_sizes=[16], max_num_reqs=2, max_num_batched_tokens=16, max_num_blocks_per_group=[4])
    bt.append_block_ids(1, ([3, 4, 5],), overwrite=True)
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu) == [[0, 0, 0, 0], [3, 4, 5, 0]]
    bt.append_block_ids(1, ([8],), overwrite=True)  # a new request in the row: counts restart at 0
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu[1, :1]) == [8]
    assert bt.num_blocks.np.tolist() == [[0, 1]]
    bt.append_block_ids(1, ([],), overwrite=True)
    assert bt.num_blocks.np.tolist() == [[0, 0]]


def test_disabled_slot_mapping_group_is_pad(make, t):
    bt = make([8, 262144], 1, 4, [1, 1], slot_mapping_enabled=[False, True])
    bt.append_block_ids(0, ([7], [11]), overwrite=True)
    bt.apply_staged_writes()
    sm = bt.compute_slot_mappings(t([0]), t([0, 2]), t([150001, 170003], torch.int64), num_tokens_padded=2)
    assert rows(sm) == [[PAD, PAD], [11 * 262144 + 150001, 11 * 262144 + 170003]]
    assert rows(bt.slot_mappings) == [[PAD] * 4, [11 * 262144 + 150001, 11 * 262144 + 170003, PAD, PAD]]


@pytest.mark.parametrize("cp_rank", range(4))
def test_dcp_shards_only_sharded_groups(make, t, cp_rank, device):
    bt = make([128, 128], 1, 1024, [2, 8], cp_size=4, cp_rank=cp_rank, cp_interleave=128, dcp_sharded=[True, False])
    bt.append_block_ids(0, ([3, 6], list(range(20, 28))), overwrite=True)
    bt.apply_staged_writes()
    positions = torch.arange(1024, device=device)
    sm = bt.compute_slot_mappings(t([0]), t([0, 1024]), positions, num_tokens_padded=1024)
    # sharded: a virtual block of 4 x 128 tokens per entry, rank r owns its r-th 128 tokens
    expected = [PAD] * 1024
    for entry, block in enumerate([3, 6]):
        first = entry * 512 + cp_rank * 128
        expected[first : first + 128] = range(block * 128, block * 128 + 128)
    assert rows(sm[0]) == expected
    # replicated: every rank maps every token, from the unsharded position
    assert rows(sm[1]) == [(20 + p // 128) * 128 + p % 128 for p in range(1024)]


@pytest.mark.parametrize("cp_rank", range(2))
def test_dcp_leaves_an_unsharded_group_of_any_block_size_whole(make, t, cp_rank, device):
    """A Mamba group (vLLM sets its block size to max_model_len, here 100) that context parallelism does not shard:
    cp_interleave 8 need not divide its block size (issue 23, item 7: multiwrite refused it); every rank maps every
    token from the plain position."""
    bt = make([16, 100], 2, 100, [4, 1], cp_size=2, cp_rank=cp_rank, cp_interleave=8, dcp_sharded=[True, False])
    bt.append_block_ids(1, ([3, 4, 5, 6], [12]), overwrite=True)
    bt.apply_staged_writes()
    sm = bt.compute_slot_mappings(t([1]), t([0, 100]), torch.arange(100, device=device), num_tokens_padded=100)
    assert rows(sm[1]) == [12 * 100 + p for p in range(100)]
    # sharded: an entry is a virtual block of 2 x 16 tokens, dealt in chunks of 8: rank r owns chunks r, r + 2, ...
    expected = []
    for p in range(100):
        entry, within = divmod(p, 32)
        local = (within // 16) * 8 + within % 8
        expected.append([3, 4, 5, 6][entry] * 16 + local if (within // 8) % 2 == cp_rank else PAD)
    assert rows(sm[0]) == expected
    hand = {
        0: {0: 3 * 16, 8: PAD, 16: 3 * 16 + 8, 32: 4 * 16, 99: 6 * 16 + 3},
        1: {0: PAD, 8: 3 * 16, 24: 3 * 16 + 8, 99: PAD},
    }
    assert {p: expected[p] for p in hand[cp_rank]} == hand[cp_rank]


@pytest.mark.parametrize(
    "cp_rank, expected",
    [
        (0, [28, PAD, 29, PAD, 30, PAD, 31, PAD, 36, PAD, 37, PAD]),
        (1, [PAD, 28, PAD, 29, PAD, 30, PAD, 31, PAD, 36, PAD, 37]),
    ],
)
def test_dcp_interleave_one(make, t, cp_rank, expected):
    """cp 2, interleave 1, block size 4: rank r owns the tokens p with p % 2 == r, 4 of every 8 per entry."""
    bt = make([4], 1, 16, [2], cp_size=2, cp_rank=cp_rank)
    bt.append_block_ids(0, ([7, 9],), overwrite=True)
    bt.apply_staged_writes()
    sm = bt.compute_slot_mappings(t([0]), t([0, 12]), t(list(range(12)), torch.int64), num_tokens_padded=12)
    assert rows(sm[0]) == expected


def test_dummy_block_tables_are_zeroed_at_the_persistent_address(make, t):
    bt = make([16], 4, 64, [8])
    bt.append_block_ids(0, ([1, 2],), overwrite=True)
    bt.append_block_ids(3, ([5],), overwrite=True)
    bt.apply_staged_writes()
    bt.gather_block_tables(t([0, 3, 0]), num_reqs_padded=3)
    assert rows(bt.input_block_tables[0][:3, :2]) == [[1, 2], [5, 0], [1, 2]]
    (dummy,) = bt.get_dummy_block_tables(num_reqs=1)
    assert rows(dummy) == [[0] * 8]
    assert dummy.data_ptr() == bt.input_block_tables[0].data_ptr()
    assert not bt.input_block_tables[0][:3].any()  # all three rows of the last gather, not only the one asked


def test_dummy_request_slot_mapping_is_pad(make, t):
    bt = make([4], 2, 16, [4])
    bt.append_block_ids(0, ([7, 8],), overwrite=True)
    bt.apply_staged_writes()
    qsl, positions = t([0, 3]), t([1, 2, 3], torch.int64)
    assert rows(bt.compute_slot_mappings(t([0]), qsl, positions, 3)[0]) == [29, 30, 31]
    assert rows(bt.compute_slot_mappings(t([-1]), qsl, positions, 3)[0]) == [PAD] * 3
    mixed = bt.compute_slot_mappings(t([-1, 0]), t([0, 2, 5]), t([0, 9, 3, 4, 5, 0], torch.int64), 6)
    assert rows(mixed[0]) == [PAD, PAD, 31, 32, 33, PAD]


def test_gather_clears_padding_and_the_previous_batch_rows(make, t):
    bt = make([4], 4, 16, [3])
    for row, ids in enumerate(([1, 2, 3], [4], [5, 6], [7])):
        bt.append_block_ids(row, (ids,), overwrite=True)
    bt.apply_staged_writes()
    (got,) = bt.gather_block_tables(t([2, 0, 3]), num_reqs_padded=4)
    assert rows(got) == [[5, 6, 0], [1, 2, 3], [7, 0, 0], [0, 0, 0]]
    (got,) = bt.gather_block_tables(t([1]), num_reqs_padded=2)
    assert rows(got[0, :1]) == [4] and rows(got[1]) == [0, 0, 0]  # vLLM leaves got[0, 1:] as the last gather did
    assert rows(bt.input_block_tables[0][1:]) == [[0, 0, 0]] * 3  # row 2 of the previous batch too
    assert got.data_ptr() == bt.input_block_tables[0].data_ptr()


def test_gather_into_the_callers_tables(make, t, device):
    bt = make([4, 8], 3, 16, [3, 2])
    bt.append_block_ids(0, ([1, 2], [9]), overwrite=True)
    bt.append_block_ids(2, ([3], [10, 11]), overwrite=True)
    bt.apply_staged_writes()
    out = tuple(torch.full((4, w), 77, dtype=torch.int32, device=device) for w in (3, 2))
    ptrs = torch.tensor([o.data_ptr() for o in out], dtype=torch.uint64, device=device)
    got = bt.gather_block_tables(t([2, 0]), num_reqs_padded=3, out=out, out_ptrs=ptrs)
    assert [g.data_ptr() for g in got] == [o.data_ptr() for o in out]
    assert [tuple(g.shape) for g in got] == [(3, 3), (3, 2)]
    # each batch row's first num_blocks cells (vLLM leaves the others as they were), the padded row cleared
    assert (rows(got[0][0, :1]), rows(got[0][1, :2]), rows(got[0][2])) == ([3], [1, 2], [0, 0, 0])
    assert (rows(got[1][0, :2]), rows(got[1][1, :1]), rows(got[1][2])) == ([10, 11], [9], [0, 0])
    assert rows(out[0][3]) == [77, 77, 77]  # past num_reqs_padded: untouched
    assert not bt.input_block_tables[0].any() and not bt.input_block_tables[1].any()


def test_sliding_window_nulls_the_blocks_below_the_window(make, t):
    bt = make([4, 4], 2, 16, [4, 4], sliding_window_reach=[5, 0])
    bt.append_block_ids(1, ([11, 12, 13, 14], [21, 22, 23, 24]), overwrite=True)
    bt.apply_staged_writes()
    # first scheduled token 13: the window reaches back to 8, so entries 0 and 1 (tokens 0-7) are unreachable
    got = bt.gather_block_tables(t([1]), 1, num_computed_tokens=t([400, 13]))
    assert rows(got[0]) == [[0, 0, 13, 14]] and rows(got[1]) == [[21, 22, 23, 24]]
    got = bt.gather_block_tables(t([1]), 1, num_computed_tokens=t([400, 12]))
    assert rows(got[0]) == [[0, 12, 13, 14]]
    got = bt.gather_block_tables(t([1]), 1)
    assert rows(got[0]) == [[11, 12, 13, 14]]
    assert rows(bt.block_tables[0].gpu[1]) == [11, 12, 13, 14]  # the request's own row is untouched


def test_sliding_window_is_off_with_context_parallelism(make, t):
    bt = make([4], 1, 16, [4], cp_size=2, sliding_window_reach=[1])
    bt.append_block_ids(0, ([11, 12, 13],), overwrite=True)
    bt.apply_staged_writes()
    assert rows(bt.gather_block_tables(t([0]), 1, num_computed_tokens=t([20]))[0]) == [[11, 12, 13, 0]]


def test_slot_mappings_pad_to_the_end_of_the_buffer(make, t):
    bt = make([4], 2, 10, [4])
    bt.append_block_ids(0, ([2, 3, 5],), overwrite=True)
    bt.apply_staged_writes()
    bt.compute_slot_mappings(t([0]), t([0, 9]), t(list(range(9)), torch.int64), 9)
    assert rows(bt.slot_mappings[0]) == [8, 9, 10, 11, 12, 13, 14, 15, 20, PAD]
    got = bt.compute_slot_mappings(t([0]), t([0, 2, 2]), t([9, 10, 0, 0], torch.int64), 4)  # one padded request
    assert rows(got) == [[21, 22, PAD, PAD]]
    assert rows(bt.slot_mappings[0]) == [21, 22] + [PAD] * 8  # no stale slots from the longer chunk before
    assert got.data_ptr() == bt.slot_mappings.data_ptr()
    out = torch.full((1, 6), 5, dtype=torch.int64, device=got.device)
    got = bt.compute_slot_mappings(t([0]), t([0, 1]), t([4, 0], torch.int64), 2, out=out)
    assert rows(out) == [[12, PAD, PAD, PAD, PAD, PAD]] and got.data_ptr() == out.data_ptr()
    assert rows(bt.slot_mappings[0]) == [21, 22] + [PAD] * 8  # out= leaves the own buffer alone


def test_dummy_slot_mappings_fill_the_whole_buffer(make, t):
    bt = make([4, 4], 1, 6, [2, 2])
    bt.append_block_ids(0, ([1, 2], [3, 4]), overwrite=True)
    bt.apply_staged_writes()
    bt.compute_slot_mappings(t([0]), t([0, 6]), t(list(range(6)), torch.int64), 6)
    got = bt.get_dummy_slot_mappings(2)
    assert tuple(got.shape) == (2, 2) and got.data_ptr() == bt.slot_mappings.data_ptr()
    assert rows(bt.slot_mappings) == [[PAD] * 6] * 2


def test_zero_groups(make, t):
    bt = make([], 2, 8, [])
    bt.append_block_ids(0, (), overwrite=True)
    bt.apply_staged_writes()
    assert bt.gather_block_tables(t([0]), 2) == ()
    assert bt.get_dummy_block_tables(1) == ()
    assert tuple(bt.compute_slot_mappings(t([0]), t([0, 3]), t([0, 1, 2], torch.int64), 3).shape) == (0, 3)
    assert tuple(bt.get_dummy_slot_mappings(5).shape) == (0, 5)
    assert bt.num_kv_cache_groups == 0


def test_redirect_writes_to_null_block(make):
    bt = make([4], 2, 8, [4])
    bt.redirect_writes_to_null_block = True
    bt.append_block_ids(1, ([5, 6],), overwrite=True)
    bt.redirect_writes_to_null_block = False
    bt.append_block_ids(1, ([7],), overwrite=False)
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu[1]) == [0, 0, 7, 0] and bt.num_blocks.np.tolist() == [[0, 3]]
    assert type(getattr(bt, "inner", bt)).redirect_writes_to_null_block is False  # a class attribute, untouched


def test_attributes_and_layout_tensors(make, device):
    bt = make(
        [16, 8],
        3,
        32,
        [5, 7],
        cp_size=2,
        cp_rank=1,
        cp_interleave=4,
        slot_mapping_enabled=[True, False],
        dcp_sharded=[False, True],
    )
    assert (bt.block_sizes, bt.num_kv_cache_groups, bt.max_num_reqs, bt.max_num_batched_tokens) == ([16, 8], 2, 3, 32)
    assert (bt.cp_size, bt.cp_rank, bt.cp_interleave) == (2, 1, 4)
    assert [tuple(b.gpu.shape) for b in bt.block_tables] == [(3, 5), (3, 7)]
    assert all(b.gpu.dtype == torch.int32 and b.gpu.device.type == device.type for b in bt.block_tables)
    assert [tuple(x.shape) for x in bt.input_block_tables] == [(3, 5), (3, 7)]
    assert tuple(bt.slot_mappings.shape) == (2, 32) and bt.slot_mappings.dtype == torch.int64
    assert tuple(bt.num_blocks.np.shape) == (2, 3)
    bt.init_block_table_layout_tensors()
    assert rows(bt.block_table_ptrs) == [b.gpu.data_ptr() for b in bt.block_tables]
    assert rows(bt.input_block_table_ptrs) == [x.data_ptr() for x in bt.input_block_tables]
    assert rows(bt.block_table_strides) == [5, 7] and rows(bt.block_sizes_tensor) == [16, 8]
    assert rows(bt.slot_mapping_enabled) == [True, False] and rows(bt.dcp_sharded) == [False, True]


# -- beyond vLLM: multiwrite's class alone ---------------------------------------------------------------------------
def test_a_write_past_a_row_stages_nothing_of_the_call(ours):
    bt = ours([4, 4], 2, 8, [4, 2])
    bt.append_block_ids(0, ([1], [2]), overwrite=True)
    bt.apply_staged_writes()
    with pytest.raises(RuntimeError) as e:
        bt.append_block_ids(0, ([3], [4, 5]), overwrite=False)  # group 1 would end at 3 > 2
    msg = str(e.value)
    assert "request 0" in msg and "group 1" in msg and "2" in msg
    assert bt.num_blocks.np.tolist() == [[1, 0], [1, 0]]
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu[0]) == [1, 0, 0, 0] and rows(bt.block_tables[1].gpu[0]) == [2, 0]


def test_vllm_stages_the_groups_before_a_write_past_a_row(oracle, device):
    """Why the oracle comparison never feeds vLLM a refused write: vLLM keeps what it staged before the failing
    group."""
    bt = oracle.make([4, 4], 2, 8, [4, 2], device=device)
    bt.append_block_ids(0, ([1], [2]), overwrite=True)
    with pytest.raises(RuntimeError, match=r"request 0, group 1 exceeds row capacity \(3 > 2\)"):
        bt.append_block_ids(0, ([3], [4, 5]), overwrite=False)
    assert bt.num_blocks.np.tolist() == [[2, 0], [1, 0]]


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda bt, t: bt.gather_block_tables(t([0, -2]), 2), ["idx_mapping", "-2"]),
        (lambda bt, t: bt.gather_block_tables(t([0, 3]), 2), ["idx_mapping", "3"]),
        (lambda bt, t: bt.compute_slot_mappings(t([-3]), t([0, 1]), t([0], torch.int64), 1), ["idx_mapping", "-3"]),
        (lambda bt, t: bt.compute_slot_mappings(t([5]), t([0, 1]), t([0], torch.int64), 1), ["idx_mapping", "5"]),
    ],
    ids=["gather-below-minus-one", "gather-past-rows", "slots-below-minus-one", "slots-past-rows"],
)
def test_bad_request_rows_are_refused_naming_them(ours, call, names):
    """Host inputs (CPU tensors, whatever the tables' device) are checked; the refused call applies nothing staged.
    (Issue 23, item 11: these tables were built on a hard-coded CPU device, which a run forcing a GPU backend fails.)
    """
    bt = ours([4], 3, 8, [2])
    bt.append_block_ids(0, ([1],), overwrite=True)
    with pytest.raises(ValueError) as e:
        call(bt, lambda values, dtype=torch.int32: torch.tensor(values, dtype=dtype))
    for name in names:
        assert name in str(e.value)
    assert rows(bt.block_tables[0].gpu) == [[0, 0]] * 3  # still staged, not applied
    bt.apply_staged_writes()
    assert rows(bt.block_tables[0].gpu) == [[1, 0], [0, 0], [0, 0]]


def test_slots_past_two_to_the_31_are_exact(ours, t):
    bt = ours([2048], 1, 4, [1])
    bt.append_block_ids(0, ([2**20 + 3],), overwrite=True)
    bt.apply_staged_writes()
    assert rows(bt.compute_slot_mappings(t([0]), t([0, 1]), t([5], torch.int64), 1)) == [[(2**20 + 3) * 2048 + 5]]


def test_vllm_wraps_slots_past_two_to_the_31(oracle, device, t):
    """Why the oracle comparison keeps block id x block size below 2**31: vLLM multiplies them in int32."""
    bt = oracle.make([2048], 1, 4, [1], device=device)
    bt.append_block_ids(0, ([2**20 + 3],), overwrite=True)
    bt.apply_staged_writes()
    assert rows(bt.compute_slot_mappings(t([0]), t([0, 1]), t([5], torch.int64), 1)) == [
        [(2**20 + 3) * 2048 + 5 - 2**32]
    ]
