"""The rest of a step's block-table stage: `gather_block_tables`, `compute_slot_mappings` and `prepare_inputs`.

The first tests re-express vLLM's own block-table scenarios (tests/v1/worker/test_gpu_block_table.py in
vllm-project/vllm: fused groups, a single group, context parallelism, padding) with values derived by hand, on
every backend. Then every input check (`StageInputError` naming the argument and the value): a host position past
the blocks its request holds is refused naming token, request and group (`prepare_inputs` counts the staged
blocks, `compute_slot_mappings` alone those of the last apply), and a refused call applies nothing and keeps every
staged write. Then how `BlockTables` hands each job to its backend's plan, and device values (never checked, never
read on the host) that stay inside the buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import Backend, BlockTables, StagedWriteError, StageInputError, TablesPlan, select_backend
from multiwrite.reference import PAD_SLOT_ID, compute_slot_mappings_reference
from multiwrite.stage.layout import TablesLayout
from multiwrite.stage.step import StepInputs
from multiwrite.staging.arena import StagingArena
from tests.support.tables import CPU, host

I32, I64 = torch.int32, torch.int64


def vec(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# -- vLLM's scenarios, on every backend ------------------------------------------------------------------------
def test_fused_groups_gather_and_slots(backend):
    """vLLM's fused-groups scenario, then the gather and slot mapping of a step over both requests."""
    bt = BlockTables([16, 32, 8], 4, [8, 8, 8], backend.device, backend=backend.name, max_num_batched_tokens=64)
    bt.append_block_ids(0, ([1, 2], [10, 11], [0, 0, 0, 4]), overwrite=True)  # group 2: a window, null blocks first
    bt.append_block_ids(1, ([3], [12], [5, 6]), overwrite=True)
    # batch order: request 1 first (one decode token at position 12), then request 0 (a chunk at 29..31)
    gathered, slots = bt.prepare_inputs(vec([1, 0]), vec([0, 1, 4]), vec([12, 29, 30, 31], I64), 3, 5)
    assert [host(t)[:, :4].tolist() for t in gathered] == [
        [[3, 0, 0, 0], [1, 2, 0, 0], [0, 0, 0, 0]],
        [[12, 0, 0, 0], [10, 11, 0, 0], [0, 0, 0, 0]],
        [[5, 6, 0, 0], [0, 0, 0, 4], [0, 0, 0, 0]],
    ]
    assert host(slots).tolist() == [
        [3 * 16 + 12, 2 * 16 + 13, 2 * 16 + 14, 2 * 16 + 15, PAD_SLOT_ID],
        [12 * 32 + 12, 10 * 32 + 29, 10 * 32 + 30, 10 * 32 + 31, PAD_SLOT_ID],
        [6 * 8 + 4, 4 * 8 + 5, 4 * 8 + 6, 4 * 8 + 7, PAD_SLOT_ID],
    ]
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(gathered, bt.input_block_tables))
    assert slots.data_ptr() == bt.slot_mappings.data_ptr() and slots.dtype == I64
    # appending to request 0 and gathering it alone: its row grows, the padding row is zero again
    bt.append_block_ids(0, ([7], [13], [8]), overwrite=False)
    gathered, slots = bt.prepare_inputs(vec([0]), vec([0, 1]), vec([39], I64), 2, 1)
    assert [host(t)[:2, :5].tolist() for t in gathered] == [
        [[1, 2, 7, 0, 0], [0, 0, 0, 0, 0]],
        [[10, 11, 13, 0, 0], [0, 0, 0, 0, 0]],
        [[0, 0, 0, 4, 8], [0, 0, 0, 0, 0]],
    ]
    assert host(slots)[:, 0].tolist() == [7 * 16 + 7, 11 * 32 + 7, 8 * 8 + 7]
    assert (host(bt.slot_mappings)[:, 1:] == PAD_SLOT_ID).all()  # the last step's slots do not linger


def test_a_single_group_with_kernel_blocks(backend):
    bt = BlockTables([32], 2, [4], backend.device, [16], backend=backend.name, max_num_batched_tokens=16)
    bt.append_block_ids(1, ([1, 2],), overwrite=True)  # kernel blocks 2, 3, 4, 5
    bt.apply_staged_writes()
    (table,) = bt.gather_block_tables(vec([1]), 1)
    assert host(table).tolist() == [[2, 3, 4, 5, 0, 0, 0, 0]]
    slots = bt.compute_slot_mappings(vec([1]), vec([0, 4]), vec([0, 15, 16, 63], I64), 4)
    # kernel block size 16: position 16 is kernel column 1 (block 3), not manager block 1's first slot
    assert host(slots).tolist() == [[2 * 16, 2 * 16 + 15, 3 * 16, 5 * 16 + 15]]


def test_padding_and_tokens_past_the_last_entry_map_to_no_slot(backend):
    bt = BlockTables([4], 3, [4], backend.device, backend=backend.name, max_num_batched_tokens=12)
    bt.append_block_ids(2, ([7, 8],), overwrite=True)
    bt.append_block_ids(0, ([3],), overwrite=True)
    bt.apply_staged_writes()
    is_padding = torch.tensor([False, True, False, False, True, False, False, False])
    # entry 0: request 2 at positions 1..4 (token 1 is padding: its position is junk, never read); entry 1: request 0
    # (token 4 is padding); tokens 6 and 7 are past the last entry
    positions = vec([1, -99, 3, 4, 10**6, 2, 10**6, -5], I64)
    slots = bt.compute_slot_mappings(vec([2, 0]), vec([0, 4, 6]), positions, 8, is_padding=is_padding)
    expected = [[7 * 4 + 1, PAD_SLOT_ID, 7 * 4 + 3, 8 * 4 + 0, PAD_SLOT_ID, 3 * 4 + 2, PAD_SLOT_ID, PAD_SLOT_ID]]
    assert host(slots).tolist() == expected
    assert host(bt.slot_mappings)[0, 8:].tolist() == [PAD_SLOT_ID] * 4
    bt.slot_mappings.fill_(5)
    _, slots = bt.prepare_inputs(vec([2, 0]), vec([0, 4, 6]), positions, 3, 8, is_padding=is_padding)
    assert host(slots).tolist() == expected
    assert host(bt.slot_mappings)[0, 8:].tolist() == [PAD_SLOT_ID] * 4


@pytest.mark.parametrize("cp_rank", range(4))
def test_context_parallel_ranks_share_out_the_tokens(backend, cp_rank):
    """vLLM's DCP scenario: 4 ranks, interleave 128, block size 128: rank r stores positions r*128.. of every 512
    (one manager block per rank per 512 tokens)."""
    bt = BlockTables(
        [128, 128], 1, [2, 2], backend.device, [128, 64], backend=backend.name,
        max_num_batched_tokens=1024, cp_size=4, cp_rank=cp_rank, cp_interleave=128,
    )  # fmt: skip
    bt.append_block_ids(0, ([5, 9], [5, 9]), overwrite=True)
    slots = host(bt.prepare_inputs(torch.zeros(1, dtype=I32), vec([0, 1024]), torch.arange(1024), 1, 1024)[1])
    expected = np.full(1024, PAD_SLOT_ID, dtype=np.int64)
    first = cp_rank * 128
    expected[first : first + 128] = np.arange(5 * 128, 6 * 128)
    expected[512 + first : 512 + first + 128] = np.arange(9 * 128, 10 * 128)
    assert slots[0].tolist() == expected.tolist()
    # group 1 holds the same blocks as kernel blocks of 64 (vllm-project/vllm PR #51031's case): a rank's 128 tokens
    # span two kernel blocks, and the slots are the same cells as with 128-token blocks
    assert slots[1].tolist() == expected.tolist()


def test_padding_rows_are_zeroed_and_cells_past_a_requests_blocks_keep_what_they_held(backend):
    bt = BlockTables([4], 4, [3], backend.device, backend=backend.name, max_num_batched_tokens=4)
    bt.append_block_ids(0, ([1, 2, 3],), overwrite=True)
    bt.append_block_ids(1, ([4],), overwrite=True)
    gathered = bt.prepare_inputs(vec([0, 1]), vec([0, 0, 0]), vec([], I64), 3, 0)[0]
    assert host(gathered[0]).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    # request 1 in batch entry 0 now: cells past its one block keep request 0's old ids (as in vLLM)
    gathered = bt.prepare_inputs(vec([1]), vec([0, 0]), vec([], I64), 2, 0)[0]
    assert host(gathered[0]).tolist() == [[4, 2, 3], [0, 0, 0]]


@pytest.mark.parametrize("which", ["idx_mapping", "query_start_loc", "positions", "is_padding"])
def test_a_strided_view_as_an_input_is_read_as_torch_reads_it(backend, which):
    bt = BlockTables([4, 8], 3, [2, 2], backend.device, [4, 4], backend=backend.name, max_num_batched_tokens=6)
    bt.append_block_ids(0, ([1, 2], [3]), overwrite=True)
    bt.append_block_ids(2, ([4], [5]), overwrite=True)
    args = dict(idx_mapping=vec([2, 0]), query_start_loc=vec([0, 2, 4]), positions=vec([1, 3, 0, 6], I64),
                is_padding=torch.tensor([False, True, False, False, True, True]))  # fmt: skip
    dense = {k: v.to(backend.device) for k, v in args.items()}
    strided = dict(dense)
    wide = torch.stack([dense[which], torch.zeros_like(dense[which])], dim=1).reshape(-1)
    strided[which] = wide[::2]  # every other element of a bigger tensor: a view with stride 2
    assert not strided[which].is_contiguous() and torch.equal(strided[which], dense[which])
    results = []
    for inputs in (dense, strided):
        gathered, slots = bt.prepare_inputs(inputs["idx_mapping"], inputs["query_start_loc"], inputs["positions"], 3,
                                            6, inputs["is_padding"])  # fmt: skip
        results.append(([host(g).tolist() for g in gathered], host(slots).tolist()))
    assert results[0] == results[1]
    assert results[0][1] == [[4 * 4 + 1, PAD_SLOT_ID, 1 * 4 + 0, 2 * 4 + 2, PAD_SLOT_ID, PAD_SLOT_ID],
                             [10 * 4 + 1, PAD_SLOT_ID, 6 * 4 + 0, 7 * 4 + 2, PAD_SLOT_ID, PAD_SLOT_ID]]  # fmt: skip


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_group_context_parallelism_does_not_shard_may_have_a_block_size_the_interleave_does_not_divide(
    backend, cp_rank
):
    """Issue 23, item 7: such a group (a Mamba group, whose block size vLLM sets to max_model_len) was refused; it
    never uses the interleave: every rank maps each of its tokens from the plain position. Group 0 (16 tokens,
    sharded) is dealt to the 2 ranks in chunks of 4 over virtual blocks of 32 tokens; group 1 (10 tokens) is not."""
    bt = BlockTables([16, 10], 2, [2, 4], backend.device, backend=backend.name, max_num_batched_tokens=8, cp_size=2,
                     cp_rank=cp_rank, cp_interleave=4, dcp_sharded=[True, False])  # fmt: skip
    bt.append_block_ids(1, ([5, 6], [7, 8, 9, 2]), overwrite=True)
    positions = vec([0, 3, 4, 9, 10, 25, 31, 33], I64)
    P = PAD_SLOT_ID
    sharded = {
        0: [5 * 16 + 0, 5 * 16 + 3, P, 5 * 16 + 5, 5 * 16 + 6, 5 * 16 + 13, P, 6 * 16 + 1],
        1: [P, P, 5 * 16 + 0, P, P, P, 5 * 16 + 15, P],
    }[cp_rank]
    unsharded = [7 * 10 + 0, 7 * 10 + 3, 7 * 10 + 4, 7 * 10 + 9, 8 * 10 + 0, 9 * 10 + 5, 2 * 10 + 1, 2 * 10 + 3]
    _, slots = bt.prepare_inputs(vec([1]), vec([0, 8]), positions, 1, 8)
    assert host(slots).tolist() == [sharded, unsharded]
    bt.slot_mappings.fill_(5)
    assert host(bt.compute_slot_mappings(vec([1]), vec([0, 8]), positions, 8)).tolist() == [sharded, unsharded]
    tables = [host(t.tensor) for t in bt.block_tables]
    want = compute_slot_mappings_reference(tables, [16, 10], [1], [0, 8], host(positions).tolist(), 8, None, 2,
                                           cp_rank, 4, dcp_sharded=[True, False])  # fmt: skip
    assert want.tolist() == [sharded, unsharded]


# -- persistent outputs and constructor checks -----------------------------------------------------------------
def test_the_outputs_are_views_of_the_persistent_buffers_made_once_per_size():
    bt = BlockTables([16, 32], 6, [4, 4], "cpu", [16, 16], backend=CPU, max_num_batched_tokens=32)
    bt.append_block_ids(2, ([1, 2], [3]), overwrite=True)
    bt.append_block_ids(4, ([5], [6, 7]), overwrite=True)
    args = (vec([4, 2]), vec([0, 1, 3], I64), vec([7, 20, 21], I64))
    g1, s1 = bt.prepare_inputs(*args, 4, 8)
    g2, s2 = bt.prepare_inputs(*args, 4, 8)
    assert g1 is g2 and s1 is s2 and bt.gather_block_tables(args[0], 4) is g1  # one view per size serves every call
    assert bt.compute_slot_mappings(*args, 8) is s1
    for view, table in zip(g1, bt.input_block_tables):
        fresh = table[:4]
        assert (view.data_ptr(), view.shape, view.stride()) == (fresh.data_ptr(), fresh.shape, fresh.stride())
    fresh = bt.slot_mappings[:, :8]
    assert (s1.data_ptr(), s1.shape, s1.stride()) == (fresh.data_ptr(), fresh.shape, fresh.stride())
    g3, s3 = bt.prepare_inputs(*args, 3, 5)
    assert [v.shape[0] for v in g3] == [3, 3] and s3.shape == (2, 5) and g3 is not g1
    assert (
        host(s3).tolist()
        == host(bt.slot_mappings[:, :5]).tolist()
        == [
            [5 * 16 + 7, 2 * 16 + 4, 2 * 16 + 5, -1, -1],
            [12 * 16 + 7, 7 * 16 + 4, 7 * 16 + 5, -1, -1],
        ]
    )


def test_the_constructor_checks_the_stage_sizes():
    with pytest.raises(StagedWriteError, match=r"cp_rank 2 is outside \[0, cp_size=2\)"):
        BlockTables([16], 2, [2], "cpu", backend=CPU, cp_size=2, cp_rank=2)
    with pytest.raises(StagedWriteError, match="group 1 block size 8 is not a multiple of cp_interleave 16"):
        BlockTables([16, 8], 2, [2, 2], "cpu", backend=CPU, cp_size=2, cp_interleave=16)
    with pytest.raises(StagedWriteError, match="group 0 block size 10 is not a multiple of cp_interleave 4"):
        BlockTables([10, 10], 2, [2, 2], "cpu", backend=CPU, cp_size=2, cp_interleave=4, dcp_sharded=[True, False])
    BlockTables([16, 10], 2, [2, 2], "cpu", backend=CPU, cp_size=2, cp_interleave=4, dcp_sharded=[True, False])
    with pytest.raises(StagedWriteError, match="max_num_batched_tokens must be >= 1, got 0"):
        BlockTables([16], 2, [2], "cpu", backend=CPU, max_num_batched_tokens=0)
    with pytest.raises(StagedWriteError, match="cp_size must be >= 1, got 0"):
        BlockTables([16], 2, [2], "cpu", backend=CPU, cp_size=0)
    bt = BlockTables([16], 2, [2], "cpu", backend=CPU, cp_size=1, cp_interleave=3)  # unused without CP
    with pytest.raises(StageInputError, match="built without max_num_batched_tokens, so they have no slot_mappings"):
        bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([0]), 1)
    with pytest.raises(StageInputError, match="built without max_num_batched_tokens"):
        bt.prepare_inputs(vec([0]), vec([0, 1]), vec([0]), 1, 1)
    assert bt.input_block_tables[0].shape == (2, 2) and bt.slot_mappings is None


# -- input checks ---------------------------------------------------------------------------------------------
def checked_tables() -> BlockTables:
    """Row 1 applied (group 0: 1 kernel block of 4 tokens, group 1: 2 kernel blocks of 4), row 2 staged alike."""
    bt = BlockTables([4, 8], 3, [2, 2], "cpu", [4, 4], backend=CPU, max_num_batched_tokens=6)
    bt.append_block_ids(1, ([1], [2]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(2, ([3], [4]), overwrite=True)
    return bt


def call(bt: BlockTables, job: str, args: dict):
    if job == "prepare_inputs":
        return bt.prepare_inputs(**args)
    if job == "gather_block_tables":
        return bt.gather_block_tables(args["idx_mapping"], args["num_reqs_padded"])
    return bt.compute_slot_mappings(args["idx_mapping"], args["query_start_loc"], args["positions"],
                                    args["num_tokens_padded"], args["is_padding"])  # fmt: skip


def assert_nothing_changed(bt: BlockTables, before: list[np.ndarray]) -> None:
    assert [host(t.tensor).tolist() for t in bt.block_tables] == [b.tolist() for b in before]
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1] and bt.num_blocks[:, 2].tolist() == [1, 2]
    assert host(bt.num_blocks_device)[:, 2].tolist() == [0, 0]
    assert host(bt.input_block_tables[0]).max() == 0 and (host(bt.slot_mappings) == PAD_SLOT_ID).all()


G, S, P = "gather_block_tables", "compute_slot_mappings", "prepare_inputs"
BAD_INPUTS = [
    # (the inputs changed, the calls that take them, what the message says after "<call>: ")
    (dict(idx_mapping=vec([[1]])), (G, S, P), r"idx_mapping must be 1-D, got shape \(1, 1\)"),
    (dict(idx_mapping=vec([0.5], torch.float32)), (G, S, P),
     r"idx_mapping has dtype float32 \(accepted: int32, int64\)"),
    (dict(idx_mapping=[1]), (G, S, P), "idx_mapping must be a torch.Tensor, got list"),
    (dict(idx_mapping=vec([1, 2, 0, 1])), (G, S, P), "idx_mapping has 4 batch entries, more than max_num_reqs=3"),
    (dict(idx_mapping=vec([1, 3]), num_reqs_padded=2, query_start_loc=vec([0, 1, 2])), (G, S, P),
     r"idx_mapping\[1\]=3 is outside the tables' request rows \[0, 3\)"),
    (dict(idx_mapping=vec([-2])), (G, S, P), r"idx_mapping\[0\]=-2 is outside"),
    (dict(num_reqs_padded=4), (G, P), r"num_reqs_padded=4 is outside \[0, max_num_reqs=3\]"),
    (dict(num_reqs_padded=0), (G, P), r"num_reqs_padded=0 is less than num_reqs=1 \(idx_mapping's length\)"),
    (dict(num_reqs_padded=1.0), (G, P), "num_reqs_padded must be an integer, got 1.0"),
    (dict(num_reqs_padded=torch.tensor(1)), (G, P), "num_reqs_padded must be a Python int, got tensor"),
    (dict(num_tokens_padded=7), (S, P), r"num_tokens_padded=7 is outside \[0, max_num_batched_tokens=6\]"),
    (dict(num_tokens_padded=True), (S, P), "num_tokens_padded must be a Python int, got True"),
    (dict(query_start_loc=vec([0])), (S, P), r"query_start_loc has 1 entries, needs num_reqs \+ 1 = 2"),
    (dict(query_start_loc=vec([1, 2])), (S, P), r"query_start_loc\[0\]=1, must be 0"),
    (dict(idx_mapping=vec([1, 1]), num_reqs_padded=2, query_start_loc=vec([0, 2, 1])), (S, P),
     "query_start_loc decreases at batch entry 1: 2 then 1"),
    (dict(query_start_loc=vec([0, 5]), positions=vec(range(5), I64)), (S, P),
     r"query_start_loc\[num_reqs=1\]=5 tokens, more than num_tokens_padded=2"),
    (dict(positions=vec([1])), (S, P), "positions has 1 entries for 2 scheduled tokens"),
    (dict(positions=vec([0, -3], I64)), (S, P), r"positions\[1\]=-3 is negative"),
    (dict(positions=vec([0, 8], I64)), (S, P), r"token 1 \(batch entry 0, request row 1\) at position 8 needs kernel "
                                               r"block column 2 of group 0, past its row width 2 \(kernel block "
                                               r"size 4\)"),
    (dict(positions=vec([0, 5], I64)), (S, P), r"token 1 \(batch entry 0, request row 1\) at position 5 needs kernel "
                                               "block column 1 of group 0, but request row 1 holds 1 kernel blocks of "
                                               r"group 0 \(kernel block size 4\)"),
    (dict(positions=vec([0], I64), query_start_loc=vec([0, 1]), idx_mapping=vec([0])), (S, P),
     r"token 0 \(batch entry 0, request row 0\) at position 0 needs kernel block column 0 of group 0, but request "
     "row 0 holds 0 kernel blocks of group 0"),
    (dict(is_padding=torch.zeros(1, dtype=torch.bool)), (S, P),
     "is_padding has 1 entries, needs num_tokens_padded = 2"),
    (dict(is_padding=vec([0, 0])), (S, P), r"is_padding has dtype int32 \(accepted: bool\)"),
    (dict(is_padding=torch.zeros(2, 2, dtype=torch.bool)), (S, P), r"is_padding must be 1-D, got shape \(2, 2\)"),
    (dict(positions=np.array([0, 1])), (S, P), "positions must be a torch.Tensor, got ndarray"),
    (dict(query_start_loc=torch.zeros(2, dtype=I32, device="meta")), (S, P),
     "query_start_loc is on meta; the tables are on cpu"),
]  # fmt: skip
CASES = [(kwargs, job, message) for kwargs, jobs, message in BAD_INPUTS for job in jobs]


@pytest.mark.parametrize(("kwargs", "job", "message"), CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_a_bad_input_is_refused_naming_it_and_the_call_changes_nothing(kwargs, job, message):
    bt = checked_tables()
    args = dict(idx_mapping=vec([1]), query_start_loc=vec([0, 2]), positions=vec([0, 1], I64), num_reqs_padded=1,
                num_tokens_padded=2, is_padding=None)  # fmt: skip
    args.update(kwargs)
    before = [host(t.tensor).copy() for t in bt.block_tables]
    with pytest.raises(StageInputError, match=f"^{job}: {message}"):
        call(bt, job, args)
    assert_nothing_changed(bt, before)
    bt.apply_staged_writes()  # every staged write is still there and lands
    assert host(bt[1].tensor)[2].tolist() == [8, 9, 0, 0] and bt.num_blocks[:, 2].tolist() == [1, 2]


def test_prepare_inputs_counts_the_staged_blocks_and_compute_slot_mappings_those_of_the_last_apply():
    bt = checked_tables()  # row 2's blocks are staged, not applied
    before = [host(t.tensor).copy() for t in bt.block_tables]
    row2 = dict(idx_mapping=vec([2]), query_start_loc=vec([0, 2]), positions=vec([1, 3], I64), is_padding=None)
    with pytest.raises(StageInputError, match=r"compute_slot_mappings: token 0 \(batch entry 0, request row 2\) at "
                                              "position 1 needs kernel block column 0 of group 0, but request row 2 "
                                              "holds 0 kernel blocks of group 0"):  # fmt: skip
        bt.compute_slot_mappings(num_tokens_padded=2, **row2)
    assert_nothing_changed(bt, before)
    _, slots = bt.prepare_inputs(num_reqs_padded=1, num_tokens_padded=2, **row2)  # applies first: its blocks count
    assert host(slots).tolist() == [[3 * 4 + 1, 3 * 4 + 3], [8 * 4 + 1, 8 * 4 + 3]]
    assert host(bt.num_blocks_device)[:, 2].tolist() == [1, 2]
    slots = bt.compute_slot_mappings(num_tokens_padded=2, **row2)  # applied now
    assert host(slots).tolist() == [[3 * 4 + 1, 3 * 4 + 3], [8 * 4 + 1, 8 * 4 + 3]]


def test_a_position_past_the_staged_blocks_is_refused_by_prepare_inputs_and_one_past_the_applied_by_the_slots():
    bt = BlockTables([4, 8], 3, [2, 2], "cpu", [4, 4], backend=CPU, max_num_batched_tokens=6)
    bt.append_block_ids(1, ([1, 2], [3]), overwrite=True)  # group 0: 2 kernel blocks (8 tokens), group 1: 2
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([4], []), overwrite=True)  # staged: row 1 shrinks to 1 kernel block of group 0
    step = dict(idx_mapping=vec([1]), query_start_loc=vec([0, 2]), positions=vec([2, 6], I64), is_padding=None)
    before = [host(t.tensor).copy() for t in bt.block_tables]
    slots = bt.compute_slot_mappings(num_tokens_padded=2, **step)  # as the tables are now: 2 blocks
    assert host(slots).tolist() == [[1 * 4 + 2, 2 * 4 + 2], [6 * 4 + 2, 7 * 4 + 2]]
    with pytest.raises(StageInputError, match=r"prepare_inputs: token 1 \(batch entry 0, request row 1\) at position "
                                              "6 needs kernel block column 1 of group 0, but request row 1 holds 1 "
                                              r"kernel blocks of group 0 \(kernel block size 4\)"):  # fmt: skip
        bt.prepare_inputs(num_reqs_padded=1, num_tokens_padded=2, **step)
    # refused before anything was applied: the tables, the counts and the staged write as they were
    assert [host(t.tensor).tolist() for t in bt.block_tables] == [b.tolist() for b in before]
    assert bt[0].num_staged_writes == 1 and bt.num_blocks[:, 1].tolist() == [1, 0]
    assert host(bt.num_blocks_device)[:, 1].tolist() == [2, 2] and host(slots)[0, 1] == 2 * 4 + 2
    bt.clear_staged_writes()  # the counts of the last apply again: prepare_inputs takes the step
    _, slots = bt.prepare_inputs(num_reqs_padded=1, num_tokens_padded=2, **step)
    assert host(slots).tolist() == [[1 * 4 + 2, 2 * 4 + 2], [6 * 4 + 2, 7 * 4 + 2]]


def test_only_the_tokens_this_rank_stores_are_checked():
    bt = BlockTables([4], 2, [2], "cpu", backend=CPU, max_num_batched_tokens=4, cp_size=2, cp_rank=0, cp_interleave=2)
    bt.append_block_ids(0, ([3],), overwrite=True)  # rank 0 stores positions 0, 1, 4, 5 of its first virtual block
    bt.apply_staged_writes()
    padding = torch.tensor([False, False, False, True])
    # position 6 is rank 1's (not checked), 99 is padding; 5 is this rank's 4th token: in its one block
    slots = bt.compute_slot_mappings(vec([0]), vec([0, 4]), vec([0, 5, 6, 99], I64), 4, is_padding=padding)
    assert host(slots).tolist() == [[12, 15, -1, -1]]
    with pytest.raises(StageInputError, match=r"token 0 \(batch entry 0, request row 0\) at position 8 needs kernel "
                                              "block column 1 of group 0, but request row 0 holds 1 kernel blocks of "
                                              r"group 0 \(kernel block size 4, cp_size 2\)"):  # fmt: skip
        bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([8], I64), 1)  # its 5th token: past its one block
    slots = bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([10], I64), 1)  # rank 1's: no slot here, no check
    assert host(slots).tolist() == [[-1]]


# -- how BlockTables hands each job to the backend's plan -----------------------------------------------------
class PlanRecorder(Backend):
    """A backend whose plan records every job `BlockTables` hands it (then runs the default plan's job)."""

    NAME = "plan-recorder"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        self.jobs: list[tuple] = []
        self.inner = select_backend("cpu", CPU)

    def apply(self, batches):
        self.jobs.append(("backend.apply", [b.num_writes for b in batches]))
        self.inner.apply(batches)

    def plan(self, layout, arena):
        jobs = self.jobs

        class Recording(TablesPlan):
            def apply(self):
                jobs.append(("apply",))
                super().apply()

            def stage(self, step):
                jobs.append(("stage", step.num_reqs, step.num_reqs_padded, step.num_tokens_padded, step.do_gather,
                             step.do_slots))  # fmt: skip
                super().stage(step)

            def prepare(self, step):
                jobs.append(("prepare", step.num_reqs, step.num_reqs_padded, step.num_tokens_padded, step.do_gather,
                             step.do_slots))  # fmt: skip
                super().prepare(step)

        return Recording(self, layout, arena)


def test_each_job_is_one_call_of_the_backends_plan():
    backend = PlanRecorder()
    bt = BlockTables([8], 3, [2], "cpu", backend=backend, max_num_batched_tokens=4)
    bt.append_block_ids(0, ([6],), overwrite=True)
    _, slots = bt.prepare_inputs(vec([0]), vec([0, 1]), vec([2], I64), 2, 3)
    assert backend.jobs == [("prepare", 1, 2, 3, True, True), ("apply",), ("backend.apply", [2]),
                            ("stage", 1, 2, 3, True, True)]  # fmt: skip
    assert host(slots).tolist() == [[6 * 8 + 2, -1, -1]] and bt[0].num_staged_writes == 0
    backend.jobs.clear()
    bt.gather_block_tables(vec([0, 0]), 3)
    bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([3], I64), 1)
    bt.apply_staged_writes()  # nothing staged: no job
    assert backend.jobs == [("stage", 2, 3, 0, True, False), ("stage", 1, 1, 1, False, True)]


def test_unchecked_device_values_stay_inside_the_buffers(backend):
    """Values of device inputs are not read on the host (that would synchronize), so nothing checks them: bad ones
    may give wrong slots but never write outside the output buffers nor read outside the tables.

    White-box by necessity: on CPU tables every input is a host input (checked), so the backend's plan is driven
    directly with the `StepInputs` a GPU's device inputs become (no value checks), over a `TablesLayout` whose two
    output buffers are placed between guard cells."""
    dev = backend.device
    layout = TablesLayout.build([4, 8], 2, [2, 2], dev, [4, 4], max_num_batched_tokens=8)
    slot_memory = torch.full((8 + 2 * 8 + 8,), 77, dtype=I64, device=dev)
    layout.slot_mappings = slot_memory[8:24].view(2, 8).fill_(PAD_SLOT_ID)
    gather_memory = torch.full((8 + 2 * 2 * 2 + 2 * 2 * 4 + 8,), 77, dtype=I32, device=dev)
    layout.input_block_tables = [gather_memory[8:12].view(2, 2), gather_memory[12:20].view(2, 4)]
    plan = select_backend(dev, backend.name).plan(layout, StagingArena(np.int32))
    layout.tables[0][1, :2] = torch.tensor([1, 7], dtype=I32)
    layout.tables[1][1, :4] = torch.tensor([2, 3, 4, 5], dtype=I32)
    layout.num_blocks[:, 1] = torch.tensor([2, 4], dtype=I32)
    tables = [host(t).copy() for t in layout.tables]
    bad = [
        (vec([9]), vec([-3, 11]), vec([5], I64), 4),  # a row past the tables; tokens before 0 and past the padded count
        (vec([1]), vec([0, 30]), vec([5], I64), 8),  # more tokens than positions and than the buffer holds
        (vec([1]), vec([0, 3]), vec([1, -2, 10**6], I64), 8),  # a negative position, one far past the row
        (vec([-5, 1]), vec([0, 1, 2]), vec([0, 1], I64), 8),  # a negative row
    ]
    for idx, qsl, pos, tokens in bad:
        plan.stage(StepInputs(idx.to(dev), qsl.to(dev), pos.to(dev), None, 2, tokens, True, True))
        assert (host(slot_memory)[:8] == 77).all() and (host(slot_memory)[24:] == 77).all()
        assert (host(gather_memory)[:8] == 77).all() and (host(gather_memory)[20:] == 77).all()
        assert [host(t).tolist() for t in layout.tables] == [t.tolist() for t in tables]
        slots = host(layout.slot_mappings)
        assert ((slots == PAD_SLOT_ID) | ((slots >= 0) & (slots < 8 * 4))).all(), slots  # a slot of an id held
