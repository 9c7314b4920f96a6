"""The staging arena (`multiwrite.staging.arena.StagingArena`): the staged writes of its tables in staging order,
values gap-free, the overlap flag, and the runs it records on the staging clock.

The arena is what a backend receives (`WriteBatch.meta`, `.values`, `.may_overlap`, `.values_in_order`): the tests
read it through `StagedWriteTensor.arena` / `.index` and through what a recording backend is handed. The runs
(`arena.runs`) have no public face but the merged order of an apply over several arenas (tested in the writer
room); they are read here, white-box, because that merge is only as right as what each arena records.
"""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import FusedStagedWriter, StagedWriteTensor
from multiwrite.staging.arena import StagingArena
from tests.support.backends import RecordingBackend
from tests.support.tables import CPU, host


def shared_arena() -> tuple[StagingArena, StagedWriteTensor, StagedWriteTensor]:
    """Two int32 tables staging into one arena, the second with 2 kernel blocks per block."""
    arena = StagingArena(np.int32)
    a = StagedWriteTensor.in_arena(torch.zeros(3, 6, dtype=torch.int32), arena, name="a")
    b = StagedWriteTensor.in_arena(torch.zeros(2, 4, dtype=torch.int32), arena, name="b", kernel_blocks_per_block=2)
    return arena, a, b


def staged(arena: StagingArena) -> tuple[list[list[int]], list[int]]:
    return arena.meta[: arena.num_writes].tolist(), arena.values[: arena.num_values].tolist()


def test_writes_are_staged_in_staging_order_with_gap_free_values():
    arena, a, b = shared_arena()
    assert (a.arena, a.index, b.arena, b.index) == (arena, 0, arena, 1)
    a.stage_write(0, 1, [1, 2])
    b.stage_write(1, 0, [5])  # expanded: 10, 11
    a.stage_write(2, 0, [])  # an empty write: a row of its own, no values
    b.stage_write(0, 2, [1])
    a.stage_write(1, 5, [9])
    # (table, row, start, length, value offset): offsets are the running sum of the lengths
    assert staged(arena) == (
        [[0, 0, 1, 2, 0], [1, 1, 0, 2, 2], [0, 2, 0, 0, 4], [1, 0, 2, 2, 4], [0, 1, 5, 1, 6]],
        [1, 2, 10, 11, 2, 3, 9],
    )
    assert (a.num_staged_writes, b.num_staged_writes) == (3, 2)
    recorder = RecordingBackend()
    FusedStagedWriter("cpu", recorder).apply([a, b])
    batch = recorder.last  # what the backend gets is the arena as staged
    assert batch.num_tables == 2 and batch.meta.tolist() == staged_meta_of(batch) and batch.values_in_order
    assert batch.writes() == [(0, 0, 1, [1, 2]), (1, 1, 0, [10, 11]), (0, 2, 0, []), (1, 0, 2, [2, 3]),
                              (0, 1, 5, [9])]  # fmt: skip
    assert host(a.tensor).tolist() == [[0, 1, 2, 0, 0, 0], [0, 0, 0, 0, 0, 9], [0] * 6]
    assert host(b.tensor).tolist() == [[0, 0, 2, 3], [10, 11, 0, 0]]
    assert arena.num_writes == 0 and arena.num_values == 0


def staged_meta_of(batch) -> list[list[int]]:
    """The metadata of a recorded batch whose value offsets are recomputed as the running sum of its lengths."""
    meta = batch.meta.copy()
    lengths = meta[:, 3].astype(np.int64)
    meta[:, 4] = np.cumsum(lengths) - lengths
    return meta.tolist()


def test_dropping_one_tables_writes_keeps_the_others_in_order_and_gap_free():
    arena, a, b = shared_arena()
    a.stage_write(0, 0, [1, 2, 3])
    b.stage_write(1, 0, [4])
    a.stage_write(1, 0, [5])
    b.stage_write(0, 0, [6, 7])
    a.clear_staged_writes()
    assert staged(arena) == ([[1, 1, 0, 2, 0], [1, 0, 0, 4, 2]], [8, 9, 12, 13, 14, 15])
    assert (a.num_staged_writes, b.num_staged_writes) == (0, 2)
    FusedStagedWriter("cpu", CPU).apply([a, b])
    assert host(a.tensor).sum() == 0 and host(b.tensor).tolist() == [[12, 13, 14, 15], [8, 9, 0, 0]]


def test_the_arena_grows_mid_step_keeping_every_write_in_order():
    arena, a, b = shared_arena()
    first_meta, first_values = arena.meta_cap, arena.values_cap
    want_a, want_b = np.zeros((3, 6), np.int64), np.zeros((2, 4), np.int64)
    rng = np.random.default_rng(3)
    for i in range(4 * first_meta):  # past the initial metadata rows and values several times
        if i % 3:
            row, values = i % 3, rng.integers(-(2**31), 2**31, size=6).tolist()
            a.stage_write(row, 0, values)
            want_a[row] = values
        else:
            row, values = i % 2, rng.integers(0, 2**30, size=2).tolist()
            b.stage_write(row, 0, values)
            want_b[row] = [v * 2 + j for v in values for j in range(2)]
    assert arena.meta_cap > first_meta and arena.num_values > first_values
    assert arena.num_writes == 4 * first_meta
    meta = arena.meta[: arena.num_writes]
    assert (meta[:, 4] == np.concatenate(([0], np.cumsum(meta[:-1, 3])))).all()  # gap-free after every growth
    FusedStagedWriter("cpu", CPU).apply([a, b])
    assert host(a.tensor).tolist() == want_a.tolist() and host(b.tensor).tolist() == want_b.tolist()


def test_the_overlap_flag_is_set_exactly_when_a_row_of_a_table_is_written_twice():
    recorder = RecordingBackend()
    writer = FusedStagedWriter("cpu", recorder)
    arena, a, b = shared_arena()
    a.stage_write(0, 0, [1])
    b.stage_write(0, 0, [2])  # the same row of another table: no overlap
    a.stage_write(1, 3, [3])
    assert arena.may_overlap is False
    writer.apply([a, b])
    assert recorder.last.may_overlap is False
    a.stage_write(1, 0, [4])  # a new batch: row 1 is free again
    assert arena.may_overlap is False
    a.stage_write(1, 4, [5])  # row 1 of a again, other cells: may overlap all the same
    assert arena.may_overlap is True
    b.stage_write(1, 0, [6])
    a.clear_staged_writes()  # what is left (b's one write) no longer overlaps
    assert arena.may_overlap is False
    b.stage_write(1, 2, [7])
    writer.apply([a, b])
    assert recorder.last.may_overlap is True
    assert host(b.tensor)[1].tolist() == [12, 13, 14, 15] and host(a.tensor)[1].tolist() == [0, 0, 0, 3, 0, 0]
    b.stage_write(1, 0, [8])
    b.clear_staged_writes()
    b.stage_write(1, 0, [9])
    assert arena.may_overlap is False  # a clear starts a new batch


def test_runs_record_where_another_arena_staged_in_between():
    x, y, z = (StagedWriteTensor((2, 4), torch.int32, name=n) for n in "xyz")
    for t, row in [(x, 0), (x, 1), (y, 0), (x, 0), (z, 0), (y, 1)]:
        t.stage_write(row, 0, [1])
    # one run per stretch of writes into one arena: (clock, index of its first write)
    (c1, f1), (c3, f3) = x.arena.runs
    (c2, f2), (c5, f5) = y.arena.runs
    ((c4, f4),) = z.arena.runs
    assert c1 < c2 < c3 < c4 < c5 and (f1, f2, f3, f4, f5) == (0, 0, 2, 0, 1)
    FusedStagedWriter("cpu", CPU).apply([x])
    assert x.arena.runs == [] and y.arena.runs == [(c2, 0), (c5, 1)]
    y.stage_write(0, 1, [2])  # y staged last: its run goes on
    assert y.arena.runs == [(c2, 0), (c5, 1)]
    x.stage_write(0, 1, [2])
    ((c6, f6),) = x.arena.runs
    assert c6 > c5 and f6 == 0
    # dropping some tables' writes renumbers the runs of the rest, and drops runs left empty
    arena, a, b = shared_arena()
    a.stage_write(0, 0, [1])
    z.stage_write(1, 0, [1])
    b.stage_write(0, 0, [1])
    a.stage_write(1, 0, [1])
    (r1, _), (r2, _) = arena.runs
    a.clear_staged_writes()
    assert arena.runs == [(r2, 0)] and arena.num_writes == 1


def test_the_batch_number_grows_at_every_clear_and_apply():
    t = StagedWriteTensor((2, 2), torch.int32)
    arena = t.arena
    first = arena.batch
    t.stage_write(0, 0, [1])
    assert arena.batch == first
    t.clear_staged_writes()
    assert arena.batch == first + 1
    t.stage_write(0, 0, [1])
    FusedStagedWriter("cpu", CPU).apply([t])
    assert arena.batch == first + 2
