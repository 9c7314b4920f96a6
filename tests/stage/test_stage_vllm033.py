"""The stage semantics vLLM 0.33 added, against the sequential references on every backend: dummy batch entries
(-1: PAD for their tokens, a zero gathered row), rows a previous gather left zeroed by the next one, the
sliding-window cut (`num_computed_tokens`, `sliding_window_reach`), groups without slot mappings and groups that
context parallelism does not shard. `prepare_inputs` and the separate calls (`apply_staged=True` or not) agree with
the references over the whole persistent buffers, step after step."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multiwrite import BlockTables
from multiwrite.reference import compute_slot_mappings_reference, gather_block_tables_reference
from tests.stage.test_stage_properties import SETTINGS, configs, reference, step, to_input, write_round
from tests.support.tables import examples, host


@st.composite
def vllm_step(draw, groups, counts: np.ndarray, cp_size: int, interleave: int):
    """An engine step (`step`) with dummy entries (-1, with junk tokens) spliced in, `num_computed_tokens` per row,
    and per group a `dcp_sharded` that is False only where every live token's unsharded column is held."""
    s = draw(step(groups, counts, cp_size, interleave))
    idx, qsl, positions = list(s["idx"]), list(s["qsl"][: len(s["idx"]) + 1]), list(s["positions"])
    n = len(idx)
    for _ in range(draw(st.integers(0, 2))):
        if n >= counts.shape[1]:
            break
        b = draw(st.integers(0, n))
        length = draw(st.integers(0, 2))
        at = qsl[b]
        positions[at:at] = [draw(st.sampled_from([0, 3, 10**6])) for _ in range(length)]
        idx.insert(b, -1)
        qsl = qsl[: b + 1] + [q + length for q in qsl[b:]]
        n += 1
        if s["is_padding"] is not None:
            s["is_padding"][at:at] = [False] * length
    tail = s["num_tokens_padded"] - s["qsl"][len(s["idx"])]
    s.update(
        idx=idx,
        qsl=qsl + [qsl[-1]] * draw(st.integers(0, 1)),
        positions=positions,
        num_tokens_padded=qsl[-1] + tail,
        num_reqs_padded=min(max(s["num_reqs_padded"], n), counts.shape[1]),
    )
    if s["is_padding"] is not None:
        s["is_padding"] = (s["is_padding"] + [False] * s["num_tokens_padded"])[: s["num_tokens_padded"]]
    sharded = []
    for g, (_, kbs, _) in enumerate(groups):
        held = all(int(positions[i]) // kbs < counts[g, r] for b, r in enumerate(idx) if r >= 0
                   for i in range(qsl[b], qsl[b + 1]) if s["is_padding"] is None or not s["is_padding"][i])  # fmt: skip
        sharded.append(draw(st.booleans()) if held and cp_size > 1 else True)
    s["dcp_sharded"] = sharded
    s["num_computed_tokens"] = draw(st.lists(st.integers(0, 40), min_size=counts.shape[1], max_size=counts.shape[1]))
    return s


@st.composite
def vllm_cases(draw):
    config = draw(configs((1, 2, 4)))
    groups, rows, cp_size, _, interleave = config
    enabled = draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    reach = draw(st.lists(st.sampled_from([0, 0, 1, 3, 8]), min_size=len(groups), max_size=len(groups)))
    held = np.zeros((len(groups), rows), dtype=np.int64)
    k = np.asarray([bs // kbs for bs, kbs, _ in groups])[:, None]
    rounds, steps = [], []
    for _ in range(draw(st.integers(1, 3))):
        rounds.append(draw(write_round(groups, held)))
        steps.append(draw(vllm_step(groups, held * k, cp_size, interleave)))
    # one dcp_sharded per tables: the groups every step can leave unsharded
    sharded = [any(s["dcp_sharded"][g] for s in steps) for g in range(len(groups))]
    return config, enabled, sharded, reach, rounds, steps


def make(backend, config, enabled, sharded, reach, max_tokens):
    groups, rows, cp_size, rank, interleave = config
    return BlockTables(
        [bs for bs, _, _ in groups], rows, [m for _, _, m in groups], backend.device, [kbs for _, kbs, _ in groups],
        backend=backend.name, max_num_batched_tokens=max_tokens, cp_size=cp_size, cp_rank=rank,
        cp_interleave=interleave, slot_mapping_enabled=enabled, dcp_sharded=sharded, sliding_window_reach=reach,
    )  # fmt: skip


def test_the_vllm_033_semantics_equal_the_references_over_whole_buffers(backend):
    @settings(max_examples=examples(backend, 50, 6), **SETTINGS)
    @given(vllm_cases(), st.sampled_from(["prepare", "separate", "apply_staged"]))
    def check(case, how):
        config, enabled, sharded, reach, rounds, steps = case
        groups, rows, cp_size, rank, interleave = config
        kbs = [k for _, k, _ in groups]
        max_tokens = max(s["num_tokens_padded"] for s in steps) + 2
        bt = make(backend, config, enabled, sharded, reach, max_tokens)
        ref = reference(config)
        ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
        dirty = 0
        window = [0] * len(groups) if cp_size > 1 else reach  # (vLLM 0.33: no cut under context parallelism)
        for calls, s in zip(rounds, steps):
            for call in calls:
                bt.append_block_ids(*call)
                ref.append_block_ids(*call)
            d, place = backend.device, s["place"]
            idx = to_input(s["idx"], s["idx_dtype"], d, place)
            qsl = to_input(s["qsl"], torch.int32, d, place)
            pos = to_input(s["positions"], s["pos_dtype"], d, place)
            pad = None if s["is_padding"] is None else to_input(s["is_padding"], torch.bool, d, place)
            nct = to_input(s["num_computed_tokens"], torch.int32, d, place)
            padded, T = s["num_reqs_padded"], s["num_tokens_padded"]
            if how == "prepare":
                gathered, slots = bt.prepare_inputs(idx, qsl, pos, padded, T, pad, num_computed_tokens=nct)
            else:
                staged = how == "apply_staged"
                if not staged:
                    bt.apply_staged_writes()
                gathered = bt.gather_block_tables(idx, padded, num_computed_tokens=nct, apply_staged=staged)
                slots = bt.compute_slot_mappings(idx, qsl, pos, T, pad)
            ref.apply_staged_writes()
            want = gather_block_tables_reference(
                ref.tables, ref.num_blocks, s["idx"], padded, ref_inputs, num_rows=dirty,
                num_computed_tokens=s["num_computed_tokens"], sliding_window_reach=window, kernel_block_sizes=kbs,
            )  # fmt: skip
            dirty = len(s["idx"])
            want_slots = compute_slot_mappings_reference(
                ref.tables, kbs, s["idx"], s["qsl"], s["positions"], T, s["is_padding"], cp_size, rank, interleave,
                slot_mapping_enabled=enabled, dcp_sharded=sharded,
            )  # fmt: skip
            for g in range(len(groups)):
                np.testing.assert_array_equal(host(gathered[g]), want[g])
                np.testing.assert_array_equal(host(bt.input_block_tables[g]), ref_inputs[g])  # every row
            np.testing.assert_array_equal(host(slots), want_slots)
            assert (host(bt.slot_mappings)[:, T:] == -1).all()

    check()


def test_a_dummy_entry_gets_pad_and_a_zero_row_and_its_row_is_never_read(backend):
    """Row 0 holds blocks; a -1 entry before and after it: PAD for its tokens, zeros in its gathered row, and the
    real entries unchanged."""
    bt = BlockTables([4], 3, [3], backend.device, backend=backend.name, max_num_batched_tokens=8)
    bt.append_block_ids(0, [[5, 6]], True)
    bt.append_block_ids(1, [[9, 9, 9]], True)
    bt.apply_staged_writes()
    d = backend.device
    bt.gather_block_tables(torch.tensor([1, 1], device=d), 2)  # rows 0, 1 of input_block_tables hold [9, 9, 9]
    gathered, slots = bt.prepare_inputs(
        torch.tensor([-1, 0, -1], device=d), torch.tensor([0, 2, 4, 5], device=d),
        torch.tensor([0, 1, 6, 7, 2], device=d), 3, 6,
    )  # fmt: skip
    assert host(gathered[0]).tolist() == [[0, 0, 0], [5, 6, 9], [0, 0, 0]]
    assert host(slots).tolist() == [[-1, -1, 26, 27, -1, -1]]


def test_rows_a_larger_gather_left_are_zeroed_by_the_next_one(backend):
    bt = BlockTables([4, 8], 4, [2, 1], backend.device, backend=backend.name)
    for r in range(4):
        bt.append_block_ids(r, [[r + 1, r + 1], [r + 10]], True)
    bt.apply_staged_writes()
    d = backend.device
    bt.gather_block_tables(torch.tensor([0, 1, 2, 3], device=d), 4)
    out = bt.gather_block_tables(torch.tensor([3], device=d), 2)
    assert host(out[0]).tolist() == [[4, 4], [0, 0]] and host(out[1]).tolist() == [[13], [0]]
    # rows 2 and 3, past this gather's padded rows, were left by the larger one: zeroed too (vLLM 0.33)
    assert host(bt.input_block_tables[0]).tolist() == [[4, 4], [0, 0], [0, 0], [0, 0]]
    dummy = bt.get_dummy_block_tables(3)
    assert dummy[0].data_ptr() == bt.input_block_tables[0].data_ptr() and host(dummy[0]).sum() == 0
    dummy[0][:, 0] = 7  # a caller writes ids into the dummy rows; the next gather zeroes what it does not fill
    out = bt.gather_block_tables(torch.tensor([1], device=d), 1)
    assert host(bt.input_block_tables[0]).tolist() == [[2, 2], [0, 0], [0, 0], [0, 0]]


def test_the_sliding_window_cut_nulls_the_blocks_wholly_before_the_window(backend):
    """Group 0 (kernel blocks of 4, reach 5): a request whose first scheduled token is 14 needs tokens from 9 on, so
    kernel blocks 0 and 1 (tokens 0-7) become 0 and block 2 (8-11) stays; group 1 has no window."""
    bt = BlockTables([4, 4], 2, [5, 5], backend.device, backend=backend.name, sliding_window_reach=[5, 0])
    bt.append_block_ids(1, [[1, 2, 3, 4], [5, 6, 7, 8]], True)
    bt.apply_staged_writes()
    d = backend.device
    nct = torch.tensor([0, 14], dtype=torch.int32, device=d)
    out = bt.gather_block_tables(torch.tensor([1], device=d), 1, num_computed_tokens=nct)
    assert host(out[0]).tolist() == [[0, 0, 3, 4, 0]] and host(out[1]).tolist() == [[5, 6, 7, 8, 0]]
    assert host(bt[0].tensor)[1].tolist() == [1, 2, 3, 4, 0]  # the table itself is untouched
    out = bt.gather_block_tables(torch.tensor([1], device=d), 1)  # without num_computed_tokens: no cut
    assert host(out[0]).tolist() == [[1, 2, 3, 4, 0]]


def test_a_group_context_parallelism_does_not_shard_is_mapped_whole_on_every_rank(backend):
    """cp_size 2, interleave 1, blocks of 4: the sharded group 0 deals tokens 0..7 to the ranks in turn (each rank
    stores its 4 in its own block 3: slots 12..15), the unsharded group 1 maps all 8 on both ranks from the plain
    positions (blocks 5 and 6); group 2's slot mapping is off (PAD)."""
    d = backend.device
    for rank in range(2):
        bt = BlockTables([4, 4, 4], 2, [2, 2, 2], d, backend=backend.name, max_num_batched_tokens=10, cp_size=2,
                         cp_rank=rank, dcp_sharded=[True, False, True],
                         slot_mapping_enabled=[True, True, False])  # fmt: skip
        bt.append_block_ids(1, [[3], [5, 6], [7]], True)
        slots = bt.prepare_inputs(torch.tensor([1], device=d), torch.tensor([0, 8], device=d),
                                  torch.arange(8, device=d), 1, 9)[1]  # fmt: skip
        mine = [12 + i // 2 if i % 2 == rank else -1 for i in range(8)]
        assert host(slots).tolist() == [mine + [-1], [20, 21, 22, 23, 24, 25, 26, 27, -1], [-1] * 9]


def test_a_dummy_entry_s_host_positions_are_not_read(backend):
    """Found by review: a -1 entry's tokens were still checked for a negative position (nothing is read for them)."""
    bt = BlockTables([4], 2, [2], backend.device, backend=backend.name, max_num_batched_tokens=4)
    bt.append_block_ids(0, [[3]], True)
    slots = bt.prepare_inputs(torch.tensor([-1, 0]), torch.tensor([0, 1, 2]), torch.tensor([-5, 2]), 2, 2)[1]
    assert host(slots).tolist() == [[-1, 14]]
