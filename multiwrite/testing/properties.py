"""Property tests of the conformance kit: random tables, dtypes and write batches against the
sequential reference (`multiwrite.reference`), with hypothesis. The example count is the
`multiwrite_examples` fixture (`--multiwrite-examples N`)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiwrite.reference import ReferenceBlockTables, apply_writes_reference

DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32}
LIMITS = {"int32": 2**31 - 1, "int64": 2**63 - 1, "float32": 2**24}


@st.composite
def batches(draw):
    """1-3 tables of one dtype, each with a random `k`, and 0-3 applies of random (overlapping) writes."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    num_tables = draw(st.integers(1, 3))
    shapes = [(draw(st.integers(1, 5)), draw(st.integers(1, 12))) for _ in range(num_tables)]
    ks = [1 if dtype == "float32" else draw(st.integers(1, 3)) for _ in range(num_tables)]
    limit = LIMITS[dtype]
    applies = []
    for _ in range(draw(st.integers(0, 3))):
        writes = []
        for _ in range(draw(st.integers(0, 10))):
            t = draw(st.integers(0, num_tables - 1))
            rows, cols = shapes[t]
            k = ks[t]
            row = draw(st.integers(0, rows - 1))
            n = draw(st.integers(0, cols // k))
            start = draw(st.integers(0, cols - n * k))
            hi = limit // k - 1
            values = draw(st.lists(st.integers(-hi if k == 1 else 0, hi), min_size=n, max_size=n))
            if draw(st.booleans()):
                values = np.asarray(values, dtype=np.int64 if dtype != "int32" else np.int32)
            writes.append((t, row, start, values))
        applies.append(writes)
    return dtype, shapes, ks, applies


def test_random_batches_match_reference(multiwrite_kit):
    """Random tables of one dtype (random k), random overlapping writes, 0-3 applies: equal to the
    sequential reference after every apply."""
    kit = multiwrite_kit

    @settings(max_examples=kit.examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(batches())
    def check(case):
        dtype, shapes, ks, applies = case
        torch_dtype = DTYPES[dtype]
        tables = [
            kit.table(shape, torch_dtype, name=f"t{i}", kernel_blocks_per_block=k)
            for i, (shape, k) in enumerate(zip(shapes, ks))
        ]
        np_dtype = {"int32": np.int32, "int64": np.int64, "float32": np.float32}[dtype]
        expected = [np.zeros(shape, dtype=np_dtype) for shape in shapes]
        writer = kit.writer()
        for writes in applies:
            for t, row, start, values in writes:
                tables[t].stage_write(row, start, values)
                apply_writes_reference(expected[t], [(row, start, list(map(int, values)))], ks[t])
            writer.apply(tables)
            assert all(t.num_staged_writes == 0 for t in tables)
            for t, exp in zip(tables, expected):
                got = kit.host(t.tensor)
                mismatch = np.argwhere(got != exp)
                assert mismatch.size == 0, f"{t.name}: first mismatches at {mismatch[:5].tolist()}"

    check()


@st.composite
def block_table_calls(draw):
    """Random hybrid groups and a sequence of append_block_ids calls (overwrites and appends)."""
    num_groups = draw(st.integers(1, 4))
    kernel = [draw(st.sampled_from([8, 16])) for _ in range(num_groups)]
    block_sizes = [kb * draw(st.integers(1, 3)) for kb in kernel]
    reqs = draw(st.integers(1, 5))
    # now and then a wide group whose ids overflow the staging arrays in the middle of a call
    max_blocks = [draw(st.sampled_from([1, 2, 3, 5, 6, 400])) for _ in range(num_groups)]
    held = np.zeros((num_groups, reqs), dtype=np.int64)
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        calls = []
        for _ in range(draw(st.integers(0, 6))):
            req = draw(st.integers(0, reqs - 1))
            overwrite = draw(st.booleans())
            ids = []
            for g in range(num_groups):
                room = max_blocks[g] - (0 if overwrite else held[g, req])
                n = draw(st.integers(0, int(room)))
                ids.append(draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)))
                held[g, req] = (0 if overwrite else held[g, req]) + n
            calls.append((req, ids, overwrite))
        steps.append(calls)
    return block_sizes, kernel, reqs, max_blocks, steps


def test_random_block_tables_match_reference(multiwrite_kit, multiwrite_staging):
    """Random hybrid groups and random append/overwrite calls through BlockTables: tables and num_blocks
    (host and device) equal to the reference after every apply."""
    kit = multiwrite_kit

    @settings(max_examples=kit.examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(block_table_calls())
    def check(case):
        block_sizes, kernel, reqs, max_blocks, steps = case
        bt = kit.block_tables(block_sizes, reqs, max_blocks, kernel, staging=multiwrite_staging)
        ref = ReferenceBlockTables(block_sizes, reqs, max_blocks, kernel)
        for calls in steps:
            for call in calls:
                bt.append_block_ids(*call)
                ref.append_block_ids(*call)
            bt.apply_staged_writes()
            for g, t in enumerate(bt.block_tables):
                np.testing.assert_array_equal(kit.host(t.tensor), ref.tables[g], err_msg=f"group {g}")
            np.testing.assert_array_equal(bt.num_blocks, ref.num_blocks)
            np.testing.assert_array_equal(kit.host(bt.num_blocks_device), ref.num_blocks)

    check()
