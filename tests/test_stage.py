"""The gather and slot-mapping stage (`multiwrite/stage.py`): scenarios on every backend, input checks.

The first tests re-express vLLM's own block-table scenarios (tests/v1/worker/test_gpu_block_table.py in
vllm-project/vllm: fused groups, a single group, context parallelism, padding) with values derived by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.reference import PAD_SLOT_ID
from multiwrite.stage import StageInputError, _build

#: Input checks run on CPU tables; named so a $MULTIWRITE_BACKEND forcing a GPU backend (tox -e cuda) does not
#: apply to them.
CPU = "torch-cpu"

I32, I64 = torch.int32, torch.int64


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def vec(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_fused_groups_gather_and_slots(backend):
    """vLLM's fused-groups scenario, then the gather and slot mapping of a step over both requests."""
    bt = BlockTables([16, 32, 8], 4, [8, 8, 8], backend.device, backend=backend.name, max_num_batched_tokens=64)
    bt.append_block_ids(0, ([1, 2], [10, 11], []), overwrite=True)
    bt.append_block_ids(1, ([3], [12], [5, 6]), overwrite=True)
    # batch order: request 1 first (one decode token at position 12), then request 0 (a chunk at 29..31)
    gathered, slots = bt.prepare_inputs(vec([1, 0]), vec([0, 1, 4]), vec([12, 29, 30, 31], I64), 3, 5)
    assert [host(t)[:, :3].tolist() for t in gathered] == [
        [[3, 0, 0], [1, 2, 0], [0, 0, 0]],
        [[12, 0, 0], [10, 11, 0], [0, 0, 0]],
        [[5, 6, 0], [0, 0, 0], [0, 0, 0]],
    ]
    # request 0 holds no block of group 2 (say a sliding window passed): its cells there read 0
    assert host(slots).tolist() == [
        [3 * 16 + 12, 2 * 16 + 13, 2 * 16 + 14, 2 * 16 + 15, PAD_SLOT_ID],
        [12 * 32 + 12, 10 * 32 + 29, 10 * 32 + 30, 10 * 32 + 31, PAD_SLOT_ID],
        [6 * 8 + 4, 0 * 8 + 5, 0 * 8 + 6, 0 * 8 + 7, PAD_SLOT_ID],
    ]
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(gathered, bt.input_block_tables))
    assert slots.data_ptr() == bt.slot_mappings.data_ptr() and slots.dtype == torch.int64
    # appending to request 0 and gathering it alone: its row grows, the padding rows are zero again
    bt.append_block_ids(0, ([7], [13], [8]), overwrite=False)
    gathered, slots = bt.prepare_inputs(vec([0]), vec([0, 1]), vec([47], I64), 2, 1)
    assert [host(t)[:2, :3].tolist() for t in gathered] == [
        [[1, 2, 7], [0, 0, 0]],
        [[10, 11, 13], [0, 0, 0]],
        [[8, 6, 0], [0, 0, 0]],  # past request 0's one block, entry 0 keeps request 1's old 6
    ]
    assert host(slots)[:, 0].tolist() == [7 * 16 + 15, 11 * 32 + 15, 0 * 8 + 7]
    assert host(bt.slot_mappings)[:, 1:].max() == PAD_SLOT_ID  # last step's slots do not linger


def test_single_group_with_kernel_blocks(backend):
    bt = BlockTables([32], 2, [4], backend.device, [16], backend=backend.name, max_num_batched_tokens=16)
    bt.append_block_ids(1, ([1, 2],), overwrite=True)  # kernel blocks 2, 3, 4, 5
    bt.apply_staged_writes()
    (table,) = bt.gather_block_tables(vec([1]), 1)
    assert host(table).tolist() == [[2, 3, 4, 5, 0, 0, 0, 0]]
    slots = bt.compute_slot_mappings(vec([1]), vec([0, 4]), vec([0, 15, 16, 63], I64), 4)
    # kernel block size 16: position 16 is kernel column 1 (block 3), not manager block 1's first slot
    assert host(slots).tolist() == [[2 * 16, 2 * 16 + 15, 3 * 16, 5 * 16 + 15]]


def test_slot_mapping_with_padding_mask_and_padded_tokens(backend):
    bt = BlockTables([4], 3, [4], backend.device, backend=backend.name, max_num_batched_tokens=12)
    bt.append_block_ids(2, ([7, 8],), overwrite=True)
    bt.append_block_ids(0, ([3],), overwrite=True)
    bt.apply_staged_writes()
    is_padding = torch.tensor([False, True, False, False, True, False, False, False])
    # entry 0: request 2 at positions 1..4 (token 1 is padding: its position is junk); entry 1: request 0
    # (token 4 is padding); tokens 6 and 7 are past the last entry
    positions = vec([1, -99, 3, 4, 5, 2, 10**6, -5], I64)
    slots = bt.compute_slot_mappings(vec([2, 0]), vec([0, 4, 6]), positions, 8, is_padding=is_padding)
    expected = [[7 * 4 + 1, PAD_SLOT_ID, 7 * 4 + 3, 8 * 4 + 0, PAD_SLOT_ID, 3 * 4 + 2, -1, -1]]
    assert host(slots).tolist() == expected
    assert host(bt.slot_mappings)[0, 8:].tolist() == [PAD_SLOT_ID] * 4
    bt.slot_mappings.fill_(5)
    # the same through prepare_inputs (a backend's own stage, where it has one)
    _, slots = bt.prepare_inputs(vec([2, 0]), vec([0, 4, 6]), positions, 3, 8, is_padding=is_padding)
    assert host(slots).tolist() == expected
    assert host(bt.slot_mappings)[0, 8:].tolist() == [PAD_SLOT_ID] * 4


@pytest.mark.parametrize("cp_rank", range(4))
def test_context_parallel_ranks_share_out_tokens(backend, cp_rank):
    """vLLM's DCP scenario: 4 ranks, interleave 128, block size 128: rank r stores positions r*128.. of
    every 512 (one manager block per rank per 512 tokens)."""
    bt = BlockTables(
        [128, 128], 1, [2, 2], backend.device, [128, 64], backend=backend.name,
        max_num_batched_tokens=1024, cp_size=4, cp_rank=cp_rank, cp_interleave=128,
    )  # fmt: skip
    bt.append_block_ids(0, ([5, 9], [5, 9]), overwrite=True)
    positions = torch.arange(1024, dtype=I64)
    slots = host(bt.prepare_inputs(torch.zeros(1, dtype=I32), vec([0, 1024]), positions, 1, 1024)[1])
    expected = np.full(1024, PAD_SLOT_ID, dtype=np.int64)
    first = cp_rank * 128
    expected[first : first + 128] = np.arange(5 * 128, 6 * 128)
    expected[512 + first : 512 + first + 128] = np.arange(9 * 128, 10 * 128)
    assert slots[0].tolist() == expected.tolist()
    # group 1 holds the same blocks as kernel blocks of 64 (vllm-project/vllm PR #51031's case): a rank's
    # 128 tokens span two kernel blocks, and the slots are the same cells as with 128-token blocks
    assert slots[1].tolist() == expected.tolist()


def test_padding_rows_zeroed_and_stale_cells_kept(backend):
    bt = BlockTables([4], 4, [3], backend.device, backend=backend.name, max_num_batched_tokens=4)
    bt.append_block_ids(0, ([1, 2, 3],), overwrite=True)
    bt.append_block_ids(1, ([4],), overwrite=True)
    gathered = bt.prepare_inputs(vec([0, 1]), vec([0, 0, 0]), vec([], I64), 3, 0)[0]
    assert host(gathered[0]).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    # request 1 in batch entry 0 now: cells past its one block keep request 0's old ids (as in vLLM)
    gathered = bt.prepare_inputs(vec([1]), vec([0, 0]), vec([], I64), 2, 0)[0]
    assert host(gathered[0]).tolist() == [[4, 2, 3], [0, 0, 0]]


def test_backend_receives_the_stage_in_one_call(backend, monkeypatch):
    bt = BlockTables([16, 32], 2, [2, 2], backend.device, [16, 16], backend=backend.name, max_num_batched_tokens=8)
    real = bt.backend
    calls, applies = [], []
    original_prepare, original_apply = real.prepare_inputs, real.apply
    monkeypatch.setattr(real, "apply", lambda batches: (applies.append(len(batches)), original_apply(batches))[1])
    monkeypatch.setattr(
        real, "prepare_inputs", lambda batches, stage: (calls.append(stage), original_prepare(batches, stage))[1]
    )
    bt.append_block_ids(1, ([4], [5]), overwrite=True)
    _, slots = bt.prepare_inputs(vec([1]), vec([0, 1]), vec([1], I64), 1, 2)
    # the Triton backends apply inside their one fused launch; the others compose their apply with the stage
    fused = backend.name.startswith("triton-")
    assert len(calls) == 1 and applies == ([] if fused else [1])
    assert calls[0].num_reqs == 1 and calls[0].num_tokens_padded == 2 and calls[0].do_gather and calls[0].do_slots
    assert host(slots).tolist() == [[4 * 16 + 1, -1], [10 * 16 + 1, -1]]
    _, slots = bt.prepare_inputs(vec([1]), vec([0, 1]), vec([3], I64), 1, 1)  # nothing staged
    assert len(calls) == 2 and applies == ([] if fused else [1])
    assert host(slots).tolist() == [[4 * 16 + 3], [10 * 16 + 3]]
    assert bt.backend is real


def test_a_backend_may_implement_the_whole_stage(backend, monkeypatch):
    from multiwrite.stage import run_stage_torch

    bt = BlockTables([8], 2, [2], backend.device, backend=backend.name, max_num_batched_tokens=4)
    real = bt.backend
    seen = []

    def fused(batches, stage):  # a backend's own single-call version: here apply then generic, recorded
        seen.append([b.num_writes for b in batches])
        real.apply(batches)
        run_stage_torch(stage)

    monkeypatch.setattr(real, "prepare_inputs", fused)
    bt.append_block_ids(0, ([6],), overwrite=True)
    _, slots = bt.prepare_inputs(vec([0]), vec([0, 1]), vec([2], I64), 1, 1)
    assert seen == [[2]]  # the group write and the num_blocks write
    assert host(slots).tolist() == [[6 * 8 + 2]]
    assert bt[0].num_staged_writes == 0


def test_constructor_checks():
    with pytest.raises(ValueError, match="cp_rank 2 is outside"):
        BlockTables([16], 2, [2], "cpu", backend=CPU, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="group 1 block size 8 is not a multiple of cp_interleave 16"):
        BlockTables([16, 8], 2, [2, 2], "cpu", backend=CPU, cp_size=2, cp_interleave=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        BlockTables([16], 2, [2], "cpu", backend=CPU, max_num_batched_tokens=0)
    bt = BlockTables([16], 2, [2], "cpu", backend=CPU, cp_size=1, cp_interleave=3)  # interleave is unused without CP
    with pytest.raises(StageInputError, match="without max_num_batched_tokens"):
        bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([0]), 1)
    assert bt.input_block_tables[0].shape == (2, 2)


def _tables() -> BlockTables:
    bt = BlockTables([4, 8], 3, [2, 2], "cpu", [4, 4], backend=CPU, max_num_batched_tokens=6)
    bt.append_block_ids(1, ([1], [2]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(2, ([3], [4]), overwrite=True)  # staged, not applied
    return bt


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(idx_mapping=vec([[0]])), r"idx_mapping must be 1-D, got shape \(1, 1\)"),
        (dict(idx_mapping=vec([0.5], torch.float32)), "idx_mapping has dtype float32"),
        (dict(idx_mapping=vec([0, 1, 2, 0])), "idx_mapping has 4 batch entries, more than max_num_reqs=3"),
        (dict(idx_mapping=vec([1, 3])), r"idx_mapping\[1\]=3 is outside the tables' request rows \[0, 3\)"),
        (dict(idx_mapping=vec([-1])), r"idx_mapping\[0\]=-1 is outside"),
        (dict(num_reqs_padded=4), r"num_reqs_padded=4 is outside \[0, max_num_reqs=3\]"),
        (dict(num_reqs_padded=0), "num_reqs_padded=0 is less than num_reqs=1"),
        (dict(num_tokens_padded=7), r"num_tokens_padded=7 is outside \[0, max_num_batched_tokens=6\]"),
        (dict(num_tokens_padded=True), "must be a Python int"),
        (dict(query_start_loc=vec([0])), "query_start_loc has 1 entries, needs num_reqs \\+ 1 = 2"),
        (dict(query_start_loc=vec([1, 2])), r"query_start_loc\[0\]=1, must be 0"),
        (
            dict(idx_mapping=vec([1, 2]), num_reqs_padded=2, query_start_loc=vec([0, 2, 1])),
            "decreases at batch entry 1: 2 then 1",
        ),
        (dict(query_start_loc=vec([0, 5]), positions=vec(range(5), I64)), "5 tokens, more than num_tokens_padded=2"),
        (dict(positions=vec([1])), "positions has 1 entries for 2 scheduled tokens"),
        (dict(positions=vec([0, -3], I64)), r"positions\[1\]=-3 is negative"),
        (
            dict(positions=vec([0, 8], I64)),
            r"token 1 \(batch entry 0, request row 1\) at position 8 needs kernel block column 2 of group 0, "
            "past its row width 2",
        ),
        (dict(is_padding=torch.zeros(1, dtype=torch.bool)), "is_padding has 1 entries, needs num_tokens_padded = 2"),
        (dict(is_padding=vec([0, 0])), "is_padding has dtype int32"),
        (dict(positions=[0, 1]), "positions must be a torch.Tensor, got list"),
    ],
)
def test_bad_inputs_are_refused_and_nothing_is_applied(kwargs, message):
    bt = _tables()
    args = dict(idx_mapping=vec([1]), query_start_loc=vec([0, 2]), positions=vec([0, 1], I64))
    args.update(num_reqs_padded=1, num_tokens_padded=2, is_padding=None)
    args.update(kwargs)
    before = [host(t.tensor).copy() for t in bt.block_tables]
    with pytest.raises(StageInputError, match=message):
        bt.prepare_inputs(**args)
    assert [host(t.tensor).tolist() for t in bt.block_tables] == [b.tolist() for b in before]
    assert bt[0].num_staged_writes == 1 and bt[1].num_staged_writes == 1  # still staged
    assert host(bt.input_block_tables[0]).max() == 0 and host(bt.slot_mappings).max() == PAD_SLOT_ID
    bt.apply_staged_writes()
    assert host(bt[1].tensor)[2].tolist() == [8, 9, 0, 0] and bt.num_blocks[:, 2].tolist() == [1, 2]


def test_padding_tokens_and_other_ranks_tokens_are_not_checked():
    bt = BlockTables([4], 1, [1], "cpu", backend=CPU, max_num_batched_tokens=4, cp_size=2, cp_rank=0, cp_interleave=2)
    bt.append_block_ids(0, ([3],), overwrite=True)
    bt.apply_staged_writes()
    # rank 0 owns positions 0,1, 4,5, ...: its one block holds its first 4 tokens, positions 0..1 and 4..5;
    # position 6 is rank 1's (not read here); position 8 would be rank 0's 5th token: past the row.
    positions = vec([0, 5, 6, 99], I64)
    slots = bt.compute_slot_mappings(vec([0]), vec([0, 4]), positions, 4, is_padding=torch.tensor([0, 0, 0, 1]).bool())
    assert host(slots).tolist() == [[12, 15, -1, -1]]
    with pytest.raises(StageInputError, match="position 8 needs kernel block column 1 of group 0"):
        bt.compute_slot_mappings(vec([0]), vec([0, 1]), vec([8], I64), 1)


def test_unchecked_device_values_stay_inside_the_buffers(backend):
    """Values of device inputs are not read on the host (that would synchronize); bad ones may give wrong
    slots but must never write outside the output buffers or read outside the tables."""
    bt = BlockTables([4, 8], 2, [2, 2], backend.device, [4, 4], backend=backend.name, max_num_batched_tokens=4)
    bt.append_block_ids(1, ([1], [2]), overwrite=True)
    bt.apply_staged_writes()
    stage = _build(bt, "test", vec([1]), 2, vec([0, 1]), vec([0], I64), 4)  # valid, then spoiled:
    guarded = torch.full((2, 12), 77, dtype=torch.int64, device=backend.device)
    stage.slot_mappings = guarded[:, 2:6]  # each group's row between guard cells
    stage.idx_mapping = vec([9]).to(backend.device)  # past the tables' rows
    stage.query_start_loc = vec([-3, 11]).to(backend.device)  # before the first token, past the last
    stage.positions = vec([5], I64).to(backend.device)  # fewer positions than the tokens claimed
    bt.backend.prepare_inputs([], stage)
    assert (host(guarded)[:, :2] == 77).all() and (host(guarded)[:, 6:] == 77).all()
    assert host(bt.input_block_tables[0]).shape == (2, 2) and (host(bt.input_block_tables[0])[1] == 0).all()
