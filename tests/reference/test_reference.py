"""The test oracle itself (`multiwrite.reference`): it refuses what the library refuses, stages and applies in true
staging order, and its gather and slot mappings give the values derived by hand from vLLM's semantics. Every other
room compares the library with it, so a fault here would hide in both."""

from __future__ import annotations

import numpy as np
import pytest

from multiwrite import StagedWriteError
from multiwrite.reference import (
    PAD_SLOT_ID,
    ReferenceBlockTables,
    ReferenceStagedTable,
    apply_staged_reference,
    apply_writes_reference,
    compute_slot_mappings_reference,
    gather_block_tables_reference,
)


@pytest.mark.parametrize(
    ("block", "kernel", "what"),
    [(16, 64, "group 1 block size 16 is not a positive multiple of its kernel block size 64"), (48, 32, "48 .* 32")],
)
def test_the_reference_refuses_block_sizes_that_are_not_multiples_of_their_kernel_block(block, kernel, what):
    with pytest.raises(StagedWriteError, match=what):
        ReferenceBlockTables([16, block], 2, [4, 4], [16, kernel])


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (([], 2, []), "at least one KV-cache group"),
        (([16], 2, [4, 4]), "1 block sizes, 1 kernel block sizes, 2 max_num_blocks_per_group entries"),
        (([16], 0, [4]), "sizes must be >= 1"),
        (([16], True, [4]), "must be an integer, not a bool"),
        (([16.0], 2, [4]), "block_sizes must be an integer, got 16.0"),
    ],
)
def test_the_reference_refuses_sizes_that_are_not_positive_integers(args, what):
    with pytest.raises(StagedWriteError, match=what):
        ReferenceBlockTables(*args)


def test_the_reference_checks_its_other_inputs_and_stages_nothing_of_a_refused_call():
    ref = ReferenceBlockTables([32], 2, [2], [16])
    for call, what in [
        ((0, ([-1],), True), "block id -1 is negative"),
        ((0, ([2**30],), True), "block id 1073741824 is negative or its kernel block ids overflow int32"),
        ((2, ([1],), True), r"request row 2 is outside \[0, 2\)"),
        ((-1, ([1],), True), r"request row -1 is outside \[0, 2\)"),  # numpy would wrap around
        ((True, ([1],), True), "must be an integer, not a bool"),
        ((0, ([1, 2, 3],), True), "past the row width 4"),
        ((0, ([1], [2]), True), "the tables have 1"),
        ((0, ([1.5],), True), "must be an integer, got 1.5"),
    ]:
        with pytest.raises(StagedWriteError, match=what):
            ref.append_block_ids(*call)
    assert ref.tables[0].sum() == 0 and ref.num_blocks.sum() == 0
    table = np.zeros((2, 3), np.int32)
    for writes, k, what in [
        ([(-1, 0, [1])], 1, r"row -1 is outside \[0, 2\)"),
        ([(0, -1, [1])], 1, "start is negative"),
        ([(0, 0, [1])], 0, "kernel_blocks_per_block must be >= 1"),
        ([(0, 0, [2**31])], 1, "does not fit int32"),
        ([(0, 0, [1.0])], 1, "is not an integer"),
        ([(0, 2, [1, 2])], 1, "ends at column 4 past the row width 3"),
    ]:
        with pytest.raises(StagedWriteError, match=what):
            apply_writes_reference(table, writes, k)
    assert table.sum() == 0
    floats = np.zeros((1, 2), np.float32)
    with pytest.raises(StagedWriteError, match="overflows float32"):
        apply_writes_reference(floats, [(0, 0, [1e39])])
    with pytest.raises(StagedWriteError, match=r"kernel block expansion \(k=2\) needs an integer table"):
        ReferenceStagedTable(floats, kernel_blocks_per_block=2)


def test_the_reference_writes_cell_by_cell_with_kernel_block_expansion():
    table = np.zeros((2, 6), np.int64)
    apply_writes_reference(table, [(0, 0, [1, 5]), (1, 2, [7]), (0, 2, [2])], kernel_blocks_per_block=2)
    assert table.tolist() == [[2, 3, 4, 5, 0, 0], [0, 0, 14, 15, 0, 0]]  # later wins on (0, 2..3)
    floats = np.zeros((1, 2), np.float32)
    apply_writes_reference(floats, [(0, 0, [0.1, 3])])
    assert floats.tolist() == [[np.float32(0.1), 3.0]]


def test_the_reference_stages_applies_and_clears_in_true_staging_order():
    shared = np.zeros((2, 4), np.int64)
    a = ReferenceStagedTable(shared, name="a")
    b = ReferenceStagedTable(shared, name="b")  # the same memory: true staging order across tables
    a.stage_write(0, 0, [1, 2])
    b.stage_write(0, 1, [9])
    a.stage_write(1, 0, [3])
    c = ReferenceStagedTable(np.zeros((1, 2), np.int64), kernel_blocks_per_block=2, name="c")
    c.stage_write(0, 0, [5])
    apply_staged_reference(iter([b, a, b]))  # any iterable, duplicates count once; c not asked for
    assert shared.tolist() == [[1, 9, 0, 0], [3, 0, 0, 0]]
    assert (a.num_staged_writes, b.num_staged_writes, c.num_staged_writes) == (0, 0, 1) and c.table.sum() == 0
    with pytest.raises(StagedWriteError, match="does not fit shape"):
        c.replace(np.zeros((1, 1), np.int64))
    with pytest.raises(StagedWriteError, match="replacement must be 2-D int64"):
        c.replace(np.zeros((2, 2), np.int32))
    c.replace(np.zeros((2, 2), np.int64))
    apply_staged_reference([c])
    assert c.table.tolist() == [[10, 11], [0, 0]]
    a.stage_write(0, 0, [7])
    a.clear_staged_writes()
    apply_staged_reference([a])
    assert shared[0, 0] == 1
    ref = ReferenceBlockTables([16, 32], 2, [3, 2], [16, 16])
    ref.append_block_ids(0, ([4], [1]), overwrite=True)
    assert ref.tables[1][0].tolist() == [2, 3, 0, 0] and ref.num_blocks[:, 0].tolist() == [1, 2]
    ref.apply_staged_writes()
    ref.append_block_ids(0, ([5], []), overwrite=False)
    ref.append_block_ids(1, ([6], [7]), overwrite=True)
    ref.clear_staged_writes()  # tables and counts as of the last apply
    assert ref.tables[0].tolist() == [[4, 0, 0], [0, 0, 0]] and ref.num_blocks.tolist() == [[1, 0], [2, 0]]
    ref.append_block_ids(0, ([8], []), overwrite=True)  # an overwrite keeps the cells past its new count
    assert ref.tables[1][0].tolist() == [2, 3, 0, 0] and ref.num_blocks[:, 0].tolist() == [1, 0]
    assert ref.num_blocks_applied[:, 0].tolist() == [1, 2]


def test_the_gather_and_slot_references_give_the_values_derived_by_hand():
    # vLLM's fused groups: block sizes 16, 32 (kernel 16), 8; request 1 then request 0 in batch order
    tables = [
        np.array([[1, 2, 0], [3, 0, 0]]),
        np.array([[20, 21, 22, 23], [24, 25, 0, 0]]),
        np.array([[0, 0, 0, 0], [5, 6, 0, 0]]),
    ]
    num_blocks = np.array([[2, 1], [4, 2], [0, 2]])
    outputs = [np.full((3, t.shape[1]), 9) for t in tables]
    gathered = gather_block_tables_reference(tables, num_blocks, [1, 0], 3, outputs)
    assert [g.tolist() for g in gathered] == [
        [[3, 9, 9], [1, 2, 9], [0, 0, 0]],  # cells past a request's count keep what they held; padding rows zero
        [[24, 25, 9, 9], [20, 21, 22, 23], [0, 0, 0, 0]],
        [[5, 6, 9, 9], [9, 9, 9, 9], [0, 0, 0, 0]],
    ]
    slots = compute_slot_mappings_reference(tables, [16, 16, 8], [1, 0], [0, 1, 3], [12, 29, 30, 99], 4,
                                            is_padding=[False, False, True, False])  # fmt: skip
    assert slots.tolist() == [
        [3 * 16 + 12, 2 * 16 + 13, PAD_SLOT_ID, PAD_SLOT_ID],  # token 2 is padding, token 3 past the last entry
        [24 * 16 + 12, 21 * 16 + 13, PAD_SLOT_ID, PAD_SLOT_ID],
        [6 * 8 + 4, 0 * 8 + 5, PAD_SLOT_ID, PAD_SLOT_ID],
    ]
    # context parallelism: 2 ranks, interleave 2, block size 4: rank 0 stores positions 0,1, 4,5, 8,9, ...
    cp = [np.array([[3, 7]])]
    rank0 = compute_slot_mappings_reference(cp, [4], [0], [0, 6], [0, 1, 2, 3, 4, 9], 6, cp_size=2, cp_rank=0,
                                            cp_interleave=2)  # fmt: skip
    rank1 = compute_slot_mappings_reference(cp, [4], [0], [0, 6], [0, 1, 2, 3, 4, 9], 6, cp_size=2, cp_rank=1,
                                            cp_interleave=2)  # fmt: skip
    assert rank0.tolist() == [[12, 13, -1, -1, 14, 7 * 4 + 1]]  # local tokens 0, 1, 2 (block 3), 5 (block 7)
    assert rank1.tolist() == [[-1, -1, 12, 13, -1, -1]]
