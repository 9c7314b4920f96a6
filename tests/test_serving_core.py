"""The core library under the conditions an engine runs it (issue 8) and a user's first-hour edges (issue 11).

Resized tables, clears that read no device state, `FusedStagedWriter.apply` arguments (any iterable,
duplicates, tables sharing memory), bad values that used to escape as raw Python errors, a backend that
fails half-way, and the library edges a new user trips on. Every test runs on every available backend
(the `backend` fixture) and, where `BlockTables` stages, through both staging paths (`staging`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import multiwrite
from multiwrite import (
    Backend,
    BackendError,
    BackendUnavailableError,
    BlockTables,
    FusedStagedWriter,
    StagedWriteError,
    StagedWriteTensor,
    WriteBatch,
    apply_writes,
)
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from multiwrite.staging import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def small_tables(backend, groups: int = 2, width: int = 4) -> BlockTables:
    return BlockTables([16] * groups, 4, [width] * groups, backend.device, backend=backend.name)


# -- 1. resized tables -----------------------------------------------------------------------------------
def test_blocktables_group_cannot_be_replaced(staging, backend):
    bt = small_tables(backend)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    old = bt[0].tensor
    with pytest.raises(StagedWriteError, match=r"group 0 \(shape \(4, 4\)\): a BlockTables' tables cannot be replaced"):
        bt[0].tensor = torch.zeros(4, 2, dtype=torch.int32, device=backend.device)
    assert bt[0].tensor is old and bt[0].num_staged_writes == 1
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0].tolist() == [1, 2, 0, 0] and host(bt.num_blocks_device)[:, 0].tolist() == [2, 1]


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.resize_(4, 2),  # shrunk from 4 to 2 columns (the case)
        lambda t: t.resize_(2, 4),  # fewer rows
        lambda t: t.resize_(4, 6),  # grown over the next group's memory
        lambda t: t.set_(torch.zeros(4, 4, dtype=torch.int32, device=t.device)),  # other memory, same shape
        lambda t: t.t_(),  # transposed in place: same shape, other strides
    ],
    ids=["shrink-columns", "shrink-rows", "grow", "set_", "transpose"],
)
def test_blocktables_resized_in_place_is_refused_before_writing(staging, backend, change):
    bt = small_tables(backend)
    bt.append_block_ids(1, ([5], [6]), True)
    bt.apply_staged_writes()
    before = [host(t.tensor).clone() for t in bt.block_tables], host(bt.num_blocks_device).clone()
    bt.append_block_ids(0, ([1, 2, 3], [4]), True)
    num_blocks = bt.num_blocks.copy()
    change(bt[0].tensor)
    with pytest.raises(StagedWriteError, match="group 0 of a BlockTables was resized in place"):
        bt.apply_staged_writes()
    # nothing written anywhere (the other group and num_blocks included), everything still staged
    assert [host(t.tensor).tolist() for t in bt.block_tables[1:]] == [t.tolist() for t in before[0][1:]]
    assert host(bt.num_blocks_device).tolist() == before[1].tolist()
    assert bt[0].num_staged_writes == 1 and bt[1].num_staged_writes == 1
    assert (bt.num_blocks == num_blocks).all()
    with pytest.raises(StagedWriteError, match="resized in place"):  # the lower-level apply refuses it too
        FusedStagedWriter(backend.device, backend.name).apply([bt[1]])
    assert bt[1].num_staged_writes == 1


def test_blocktables_refusal_survives_the_repeat_fast_path(staging, backend):
    bt = small_tables(backend)
    for step in range(3):  # warm the writer's fast path
        bt.append_block_ids(step, ([step + 1], []), True)
        bt.apply_staged_writes()
    bt.append_block_ids(3, ([9], [9]), True)
    bt.num_blocks_device.set_(torch.zeros(2, 4, dtype=torch.int32, device=backend.device))
    with pytest.raises(StagedWriteError, match="num_blocks of a BlockTables was resized in place"):
        bt.apply_staged_writes()
    assert bt[0].num_staged_writes == 1


def test_torch_writes_into_blocktables_are_not_a_resize(staging, backend):
    bt = small_tables(backend)
    bt.append_block_ids(0, ([1], [2]), True)
    bt.apply_staged_writes()
    bt[1].tensor[3, 3] = 77  # an in-place write by torch bumps the version counter; the layout is the same
    bt.append_block_ids(0, ([3], []), False)
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0, :2].tolist() == [1, 3] and host(bt[1].tensor)[3, 3] == 77


def test_staging_after_an_in_place_shrink_still_checks_the_earlier_writes(backend):
    t = StagedWriteTensor((4, 8), torch.int32, backend.device, name="shrunk")
    t.stage_write(3, 0, [7] * 4)
    t.tensor.resize_(2, 4)
    t.stage_write(0, 0, [1])  # fits the new shape; the write above no longer does
    with pytest.raises(StagedWriteError, match=r"shrunk .*row 3, start 0, length 4: .*does not fit shape \(2, 4\)"):
        FusedStagedWriter(backend.device, backend.name).apply([t])
    assert host(t.tensor).tolist() == [[0] * 4, [0] * 4] and t.num_staged_writes == 2


def test_one_dimensional_table_follows_resize_and_set_in_place(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor(4, torch.int64, backend.device, name="vec")
    t.stage_write(1, 0, [5])
    writer.apply([t])
    t.tensor.set_(torch.zeros(8, dtype=torch.int64, device=backend.device))  # grown in place: row 6 exists now
    t.stage_write(6, 0, [6])
    writer.apply([t])
    assert host(t.tensor)[[1, 6]].tolist() == [0, 6]
    fresh = torch.zeros(8, dtype=torch.int64, device=backend.device)
    t.tensor.set_(fresh)  # other memory, same size: the writes must land there
    t.stage_write(2, 0, [9])
    writer.apply([t])
    assert host(fresh).tolist() == [0, 0, 9, 0, 0, 0, 0, 0]
    t.stage_write(7, 0, [1])
    t.tensor.resize_(3)  # shrunk below a staged write
    with pytest.raises(
        StagedWriteError, match=r"vec \(shape \(3,\), int64\): write at row 7.*does not fit shape \(3,\)"
    ):
        writer.apply([t])
    assert t.num_staged_writes == 1


def test_standalone_table_replaced_grown_then_shrunk(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor((2, 2), torch.float32, backend.device, name="f")
    t.tensor = torch.zeros(3, 5, dtype=torch.float32, device=backend.device)
    t.stage_write(2, 1, [1.5, 2.5, 3.5, 4.5])
    writer.apply([t])
    assert host(t.tensor)[2].tolist() == [0.0, 1.5, 2.5, 3.5, 4.5]
    t.stage_write(1, 0, [1.0])
    t.tensor = torch.zeros(2, 1, dtype=torch.float32, device=backend.device)
    with pytest.raises(StagedWriteError, match="past the row width 1"):
        t.stage_write(0, 0, [1.0, 2.0])
    writer.apply([t])
    assert host(t.tensor).tolist() == [[0.0], [1.0]]


# -- 2. clear reads no device state --------------------------------------------------------------------
def test_clear_staged_writes_restores_from_the_host_mirror(staging, backend):
    bt = small_tables(backend)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    bt.apply_staged_writes()
    # What a stream still busy with another apply would show: device counts that are not the last apply's.
    bt.num_blocks_device.fill_(99)
    bt.append_block_ids(0, ([4], [5]), False)
    bt.append_block_ids(2, ([6], []), True)
    bt.clear_staged_writes()
    assert bt.num_blocks[:, :3].tolist() == [[2, 0, 0], [1, 0, 0]]
    bt.num_blocks_device.zero_()
    bt.append_block_ids(0, ([7], []), False)  # goes after the two blocks of the last apply
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0, :3].tolist() == [1, 2, 7]
    assert host(bt.num_blocks_device)[:, 0].tolist() == [3, 1]


def test_clear_after_a_failed_apply_keeps_the_last_successful_counts(staging, backend):
    bt = small_tables(backend)
    bt.append_block_ids(1, ([1], [2]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([3], []), False)
    bt[0].tensor.resize_(4, 2)
    with pytest.raises(StagedWriteError):
        bt.apply_staged_writes()
    bt.clear_staged_writes()
    assert bt.num_blocks[:, 1].tolist() == [1, 1]


# -- 3. FusedStagedWriter.apply arguments --------------------------------------------------------------
def test_apply_takes_any_iterable_every_time(staging, backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    a = StagedWriteTensor((2, 4), torch.int32, backend.device, name="a")
    b = StagedWriteTensor((2, 4), torch.int32, backend.device, name="b")
    for step in range(4):  # one table (the writer's repeat fast path), then two
        a.stage_write(0, step, [step + 1])
        writer.apply(iter([a]) if step % 2 else (t for t in (a,)))
        b.stage_write(1, step, [step + 10])
        writer.apply(t for t in (a, b))
        assert host(a.tensor)[0, step] == step + 1 and host(b.tensor)[1, step] == step + 10
        assert a.num_staged_writes == 0 and b.num_staged_writes == 0
    bt = small_tables(backend)
    for step in range(4):
        bt.append_block_ids(step, ([step + 1], [step + 5]), True)
        writer.apply(iter([bt[0], bt[1]]))
        assert host(bt[0].tensor)[step, 0] == step + 1 and host(bt[1].tensor)[step, 0] == step + 5


def test_a_table_listed_twice_counts_once(staging, backend):
    bt = small_tables(backend, groups=2)
    writer = FusedStagedWriter(backend.device, backend.name)
    bt.append_block_ids(1, ([1], [2]), True)
    writer.apply([bt[0], bt[1], bt[0]])  # three items, as many as the arena's tables: num_blocks' row too
    assert bt[0].num_staged_writes == 0 and host(bt.num_blocks_device)[:, 1].tolist() == [0, 0]
    bt.apply_staged_writes()  # the num_blocks row was kept and lands now
    assert host(bt.num_blocks_device)[:, 1].tolist() == [1, 1]
    bt = small_tables(backend, groups=3)
    bt.append_block_ids(0, ([1], [2], [3]), True)
    writer.apply([bt[0], bt[1], bt[0]])
    assert host(bt[0].tensor)[0, 0] == 1 and host(bt[1].tensor)[0, 0] == 2 and host(bt[2].tensor)[0, 0] == 0
    assert bt[2].num_staged_writes == 1
    bt.apply_staged_writes()  # the num_blocks row was kept and lands now
    assert host(bt[2].tensor)[0, 0] == 3 and host(bt.num_blocks_device)[:, 0].tolist() == [1, 1, 1]
    s = StagedWriteTensor((2, 2), torch.int32, backend.device)
    s.stage_write(1, 0, [4, 5])
    writer.apply([s, s, s])
    writer.apply([s, s])
    assert host(s.tensor).tolist() == [[0, 0], [4, 5]]


def test_tables_sharing_memory_apply_in_staging_order(backend):
    for order in ("base-first", "alias-first"):
        base = StagedWriteTensor((4, 8), torch.int32, backend.device, name="base")
        alias = StagedWriteTensor((2, 8), torch.int32, backend.device, name="alias")
        alias.tensor = base.tensor[1:3]  # alias row 0 is base row 1
        base.stage_write(1, 0, [1, 1])
        alias.stage_write(0, 0, [2, 2, 2])  # later: wins on columns 0..2
        base.stage_write(1, 2, [3])  # later still: wins on column 2
        alias.stage_write(1, 0, [4])
        base.stage_write(2, 0, [5])  # base row 2 is alias row 1: this one wins
        tables = [base, alias] if order == "base-first" else [alias, base]
        FusedStagedWriter(backend.device, backend.name).apply(tables)
        got = host(base.tensor)
        assert got[1, :4].tolist() == [2, 2, 3, 0], order
        assert got[2, :2].tolist() == [5, 0], order


def test_a_view_of_a_blocktables_group_keeps_staging_order(staging, backend):
    bt = small_tables(backend)
    view = StagedWriteTensor((4, 4), torch.int32, backend.device, name="view")
    view.tensor = bt[0].tensor
    bt.append_block_ids(0, ([1, 2], [3]), True)
    view.stage_write(0, 1, [9])  # staged after the append: wins
    bt.append_block_ids(1, ([4], []), True)
    view.stage_write(1, 0, [8])
    bt.append_block_ids(1, ([5], []), False)  # staged after view's write: its column 1 is untouched by it
    FusedStagedWriter(backend.device, backend.name).apply([view, *bt.block_tables])
    assert host(bt[0].tensor)[:2, :3].tolist() == [[1, 9, 0], [8, 5, 0]]
    bt.apply_staged_writes()
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[2, 2], [1, 0]]


def test_tables_of_two_dtypes_over_one_memory_are_refused(backend):
    ints = StagedWriteTensor((2, 4), torch.int32, backend.device, name="ints")
    floats = StagedWriteTensor((2, 4), torch.float32, backend.device, name="floats")
    floats.tensor = ints.tensor.view(torch.float32)
    ints.stage_write(0, 0, [1])
    floats.stage_write(0, 0, [2.0])
    with pytest.raises(StagedWriteError, match="dtypes int32 and float32 share memory"):
        FusedStagedWriter(backend.device, backend.name).apply([ints, floats])
    assert host(ints.tensor).sum() == 0 and ints.num_staged_writes == 1 and floats.num_staged_writes == 1


def test_an_item_that_is_not_a_staged_write_tensor_is_named(backend):
    t = StagedWriteTensor((2, 2), torch.int32, backend.device)
    t.stage_write(0, 0, [1])
    writer = FusedStagedWriter(backend.device, backend.name)
    with pytest.raises(TypeError, match=r"item 1 is a torch\.Tensor, not a StagedWriteTensor"):
        writer.apply([t, torch.zeros(2)])
    assert t.num_staged_writes == 1 and host(t.tensor).sum() == 0
    writer.apply([t])  # the repeat fast path is armed now: other items must still get the clear error
    for bad in (np.zeros(3), torch.zeros(3), "x"):
        with pytest.raises(TypeError, match=r"item 0 is a .*, not a StagedWriteTensor"):
            writer.apply([bad])
    assert host(t.tensor)[0, 0] == 1


# -- 4. bad values become StagedWriteError ---------------------------------------------------------------
BAD_VALUES = [
    (torch.float32, [10**400], "(too large|overflow)"),
    (torch.float32, [1.0] * 9 + [10**400], "(too large|overflow)"),
    (torch.float32, [True], "bool"),
    (torch.float32, np.array([True, False]), "bool"),
    (torch.float32, torch.tensor([True]), "bool"),
    (torch.float32, ["x"], "not numbers"),
    (torch.float32, [1 + 2j], "not numbers"),
    (torch.float32, [None], "not numbers"),
    (torch.int32, [10**400], "does not fit"),
    (torch.int32, [1] * 9 + [10**400], "does not fit"),
    (torch.int64, [2**63], "does not fit"),
    (torch.int32, [np.int64(2**40)], "does not fit"),
    (torch.int32, [True], "bool"),
    (torch.int32, [1] * 9 + [True], "bool"),
    (torch.int32, [np.bool_(True)], "bool"),
    (torch.int64, np.array([True]), "bool"),
    (torch.int32, [float("nan")], "float value cannot go into an integer table"),
    (torch.int32, [1] * 9 + [float("inf")], "float value cannot go into an integer table"),
    (torch.int32, [np.float32(1.0)], "float32 value cannot go into an integer table"),
    (torch.int32, ["1"], "not integers"),
]


@pytest.mark.parametrize(("dtype", "values", "fragment"), BAD_VALUES, ids=[f"{i}" for i in range(len(BAD_VALUES))])
def test_bad_values_raise_staged_write_error(dtype, values, fragment):
    t = StagedWriteTensor((2, 16), dtype, name="bad")
    t.stage_write(0, 0, [1] if dtype != torch.float32 else [1.0])
    with pytest.raises(StagedWriteError, match=r"bad \(shape \(2, 16\), .*\): write at row 1, start 0.*" + fragment):
        t.stage_write(1, 0, values)
    assert t.num_staged_writes == 1
    if isinstance(values, list):
        with pytest.raises(StagedWriteError, match=fragment):
            t.stage_write_elem(1, values[-1])
    assert t.num_staged_writes == 1


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ([10**400], "(too large|does not fit)"),
        ([True], "bool"),
        ([1, 2, 3, 4, 5, 6, 7, 8, False], "bool"),
        ([np.bool_(True)], "bool"),
        ([float("nan")], "cannot go into an integer table"),
        ([1.0], "cannot go into an integer table"),
        (np.array([2**40]), "does not fit|too large"),
    ],
)
def test_bad_block_ids_raise_staged_write_error(staging, ids, fragment):
    bt = BlockTables([16, 16], 2, [16, 16], "cpu", backend="torch-cpu")
    bt.append_block_ids(0, ([1], [2]), True)
    with pytest.raises(StagedWriteError, match=fragment):
        bt.append_block_ids(1, ([3], ids), True)
    assert bt.num_blocks[:, 1].tolist() == [0, 0] and bt[0].num_staged_writes == 1
    bt.append_block_ids(1, ([np.int64(4)], [np.int32(5)]), True)  # numpy integers are integers
    bt.apply_staged_writes()
    assert bt[1].tensor[:, 0].tolist() == [2, 5]


def test_numpy_scalar_ids_expand_without_wrapping(staging):
    """`np.uint8(250) * 4` is 232 in uint8: expansion and its range check must use Python integers."""
    bt = BlockTables([64], 2, [4], "cpu", [16], backend="torch-cpu")
    bt.append_block_ids(0, ([np.uint8(250), np.int16(3)],), True)
    bt.apply_staged_writes()
    assert bt[0].tensor[0, :8].tolist() == [1000, 1001, 1002, 1003, 12, 13, 14, 15]
    t = StagedWriteTensor((2, 8), torch.int32, kernel_blocks_per_block=4, name="k4")
    t.stage_write(0, 0, [np.uint8(250)])
    FusedStagedWriter("cpu", "torch-cpu").apply([t])
    assert t.tensor[0, :4].tolist() == [1000, 1001, 1002, 1003]
    wide = StagedWriteTensor((2, 8), torch.int64, kernel_blocks_per_block=4, name="wide")
    with pytest.raises(StagedWriteError, match="value 4611686018427387904 expanded to 4 kernel blocks"):
        wide.stage_write(0, 0, [np.int64(2**62)])
    assert wide.num_staged_writes == 0


@pytest.mark.parametrize("new_block_ids", [5, None])
def test_block_ids_that_are_not_sequences(staging, new_block_ids):
    bt = BlockTables([16], 2, [4], "cpu", backend="torch-cpu")
    with pytest.raises(StagedWriteError, match="one sequence of block ids per KV-cache group"):
        bt.append_block_ids(1, new_block_ids, False)


# -- 5. a backend that fails half-way ------------------------------------------------------------------
class HalfFailingBackend(Backend):
    """A plugin-like backend: writes the first half of each batch's tables, then raises (while armed)."""

    NAME = "half-failing"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self, exc: BaseException | None = None):
        self.exc = exc or RuntimeError("lost the device half-way")
        self.failures_left = 1
        self.calls = 0

    def apply(self, batches: list[WriteBatch]) -> None:
        self.calls += 1
        for batch in batches:
            limit = len(batch.tables) // 2 if self.failures_left else len(batch.tables)
            for m in batch.meta:
                if m[META_TABLE] < limit:
                    off, n = int(m[META_VALUE_OFFSET]), int(m[META_LENGTH])
                    row, start = int(m[META_ROW]), int(m[META_START])
                    batch.tables[m[META_TABLE]][row, start : start + n] = torch.from_numpy(batch.values[off : off + n])
        if self.failures_left:
            self.failures_left -= 1
            raise self.exc


def test_a_backend_failure_is_wrapped_and_a_retry_lands_every_write(staging):
    failing = HalfFailingBackend()
    bt = BlockTables([16, 32, 16], 4, [4, 4, 4], "cpu", [16, 16, 16], backend=failing)
    ref = ReferenceBlockTables([16, 32, 16], 4, [4, 4, 4], [16, 16, 16])
    calls = [(0, ([1, 2], [3], [4]), True), (1, ([5], [], [6, 7]), True), (0, ([8], [9], []), False)]
    for call in calls:
        bt.append_block_ids(*call)
        ref.append_block_ids(*call)
    with pytest.raises(BackendError, match=r"backend 'half-failing' .* group 0, group 1, group 2, num_blocks") as info:
        bt.apply_staged_writes()
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.backend is failing
    assert info.value.tables == ("group 0", "group 1", "group 2", "num_blocks")
    assert [t.num_staged_writes for t in bt.block_tables] == [3, 3, 2]
    assert (bt.num_blocks == ref.num_blocks).all()  # the host keeps the staged counts
    assert host(bt.num_blocks_device).sum() == 0  # num_blocks is past the half that was written
    bt.apply_staged_writes()  # the retry
    for g in range(3):
        assert bt[g].tensor.tolist() == ref.tables[g].tolist()
    assert bt.num_blocks_device.tolist() == ref.num_blocks.tolist() == bt.num_blocks.tolist()
    assert [t.num_staged_writes for t in bt.block_tables] == [0, 0, 0] and failing.calls == 2
    bt.append_block_ids(1, ([10], [], []), False)  # and staging goes on from the retried counts
    bt.apply_staged_writes()
    assert bt[0].tensor[1, :2].tolist() == [5, 10]


def test_a_standalone_write_survives_a_backend_failure():
    failing = HalfFailingBackend()
    writer = FusedStagedWriter("cpu", backend=failing)
    a = StagedWriteTensor((2, 4), torch.int32, name="a")
    b = StagedWriteTensor((2, 4), torch.int32, name="b")
    a.stage_write(0, 0, [1, 2])
    b.stage_write(1, 1, [3])
    a.stage_write(0, 1, [4])
    with pytest.raises(BackendError, match="'half-failing'.*failed applying 3 staged writes to a, b") as info:
        writer.apply([a, b])
    assert info.value.tables == ("a", "b")
    assert a.num_staged_writes == 2 and b.num_staged_writes == 1
    writer.apply([a, b])
    assert a.tensor[0].tolist() == [1, 4, 0, 0] and b.tensor[1].tolist() == [0, 3, 0, 0]


def test_keyboard_interrupt_is_not_wrapped_and_keeps_writes():
    writer = FusedStagedWriter("cpu", backend=HalfFailingBackend(KeyboardInterrupt()))
    a = StagedWriteTensor((2, 4), torch.int32)
    a.stage_write(0, 0, [1])
    with pytest.raises(KeyboardInterrupt):
        writer.apply([a])
    assert a.num_staged_writes == 1
    writer.apply([a])
    assert a.tensor[0, 0] == 1


# -- 6. library edges (issue 11) -----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize(
    "make",
    [
        lambda: BlockTables([16, 32, 8], 256, [1025, 513, 2049], "cuda", [16, 16, 8]),
        lambda: StagedWriteTensor((4, 8), torch.int32, "cuda"),
        lambda: FusedStagedWriter("cuda"),
        lambda: BlockTables([16], 2, [4], "cuda:3"),
    ],
    ids=["BlockTables", "StagedWriteTensor", "FusedStagedWriter", "BlockTables-index"],
)
def test_cuda_on_a_cpu_only_torch_is_a_clean_error(make):
    with pytest.raises(BackendUnavailableError, match="cuda"):
        make()


@pytest.mark.parametrize(
    ("blocks", "kernel", "fragment"),
    [([2**31], [16], r"group 0 row width 2147483648 blocks x 1"), ([2**30], [8], "x 2 kernel blocks = 2147483648")],
)
def test_blocktables_refuses_a_row_width_past_int32(blocks, kernel, fragment):
    # on the meta device: nothing can be allocated by mistake, and the width is checked first
    with pytest.raises(StagedWriteError, match=fragment + ".*past 2\\*\\*31 - 1"):
        BlockTables([16], 2, blocks, "meta", kernel)
    with pytest.raises(StagedWriteError, match="each in \\[0, 2\\*\\*31\\)"):
        StagedWriteTensor((2, 2**31), torch.int32, "meta")


def test_error_messages_print_only_the_users_values(staging):
    t = StagedWriteTensor(5, torch.int32, name="vec")
    for call, fragment in [
        (lambda: t.stage_write("a", 0, [1]), "vec (shape (5,), int32): write at row 'a', start 0: row and start"),
        (lambda: t.stage_write(0, 1.5, [1]), "write at row 0, start 1.5: row and start must be integers"),
        (lambda: t.stage_write(7, 0, [1]), "vec (shape (5,), int32): write at row 7, start 0, length 1: row 7"),
    ]:
        with pytest.raises(StagedWriteError) as info:
            call()
        assert fragment in str(info.value)
        assert "-1" not in str(info.value)
    bt = BlockTables([16, 16], 2, [4, 4], "cpu", backend="torch-cpu")
    for ids in ((5, []), ([1], 7)):
        with pytest.raises(StagedWriteError, match="must be a sequence") as info:
            bt.append_block_ids(1, ids, True)
        assert "-1" not in str(info.value)


def test_apply_writes_applies_tables_of_several_devices_and_keeps_none(backend):
    a = StagedWriteTensor((2, 2), torch.int32, backend.device)
    b = StagedWriteTensor(3, torch.float32, backend.device)
    a.stage_write(1, 1, [7])
    b.stage_write_elem(2, 0.25)
    apply_writes(a, b)
    assert host(a.tensor).tolist() == [[0, 0], [0, 7]] and host(b.tensor).tolist() == [0.0, 0.0, 0.25]
    assert FusedStagedWriter.default_for(a.device)._fast is None
    with pytest.raises(TypeError, match="argument 1 is a list"):
        apply_writes(a, [b])


# -- 7. layering: staging knows nothing of writers -----------------------------------------------------
def _multiwrite_imports(path: Path) -> set[str]:
    """Every multiwrite module a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("multiwrite"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("multiwrite"))
    return found


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("errors", set()),
        ("staging", {"multiwrite.errors", "multiwrite._cstaging"}),  # (the compiled module imports nothing of ours)
        ("capture", {"multiwrite.errors"}),
        # the default `Backend.prepare_inputs` composes apply with the generic torch stage (a lazy import)
        ("backend", {"multiwrite.errors", "multiwrite.staging", "multiwrite.stage"}),
        (
            "writer",
            {"multiwrite.errors", "multiwrite.staging", "multiwrite.backend", "multiwrite.dispatch"}
            | {"multiwrite.capture"},
        ),
    ],
)
def test_lower_layers_never_import_upper_ones(module, allowed):
    path = Path(multiwrite.__file__).parent / f"{module}.py"
    assert _multiwrite_imports(path) <= allowed
    assert not hasattr(StagedWriteTensor, "apply_write")


def test_reference_helper_matches_staged_writes_after_resizes(backend):
    """A resize-heavy sequence against the plain reference (a small fuzz with a fixed seed)."""
    rng = np.random.default_rng(8)
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor((4, 6), torch.int64, backend.device, name="fuzz")
    ref = np.zeros((4, 6), dtype=np.int64)
    for step in range(40):
        rows, cols = ref.shape
        if step % 7 == 3:  # grow or shrink, by replacement or in place; the reference follows
            new_rows, new_cols = int(rng.integers(2, 7)), int(rng.integers(2, 9))
            t.clear_staged_writes()
            grown = np.zeros((new_rows, new_cols), dtype=np.int64)
            r, c = min(rows, new_rows), min(cols, new_cols)
            grown[:r, :c] = ref[:r, :c]
            new = torch.from_numpy(grown.copy()).to(backend.device)
            if step % 2:
                t.tensor = new
            else:
                t.tensor.set_(new)
            ref = grown
            continue
        writes = []
        for _ in range(int(rng.integers(1, 6))):
            row = int(rng.integers(0, rows))
            start = int(rng.integers(0, cols))
            vals = rng.integers(-50, 50, size=int(rng.integers(0, cols - start + 1))).tolist()
            t.stage_write(row, start, vals)
            writes.append((row, start, vals))
        writer.apply([t])
        apply_writes_reference(ref, writes)
        assert host(t.tensor).numpy().tolist() == ref.tolist(), step


# -- 8. threads: distinct objects from distinct threads ------------------------------------------------
def _thread_worker(seed: int, backend_name: str, steps: int) -> None:
    """One thread's own BlockTables and StagedWriteTensors, checked against the reference as it goes."""
    rng = np.random.default_rng(seed)
    sizes, kernel, widths, reqs = [16, 32], [16, 16], [6, 4], 8
    bt = BlockTables(sizes, reqs, widths, "cpu", kernel, backend=backend_name)
    ref = ReferenceBlockTables(sizes, reqs, widths, kernel)
    ints = StagedWriteTensor((4, 8), torch.int32, name=f"ints-{seed}")
    floats = StagedWriteTensor(16, torch.float32, name=f"floats-{seed}")
    writer = FusedStagedWriter("cpu", backend_name)
    ints_ref, floats_ref = np.zeros((4, 8), np.int64), np.zeros((16, 1), np.float64)
    for step in range(steps):
        if step % 11 == 5:  # a batch staged, then dropped: the reference never sees it
            bt.append_block_ids(0, ([1], []), True)
            bt.append_block_ids(1, ([2], [3]), True)
            bt.clear_staged_writes()
        for _ in range(int(rng.integers(1, 5))):
            req = int(rng.integers(0, reqs))
            ids = [rng.integers(0, 1000, size=int(rng.integers(0, 3))).tolist() for _ in sizes]
            room = all(ref.num_blocks[g, req] + len(ids[g]) * ref.k[g] <= ref.tables[g].shape[1] for g in range(2))
            overwrite = bool(rng.integers(0, 4) == 0) or not room
            bt.append_block_ids(req, ids, overwrite)
            ref.append_block_ids(req, ids, overwrite)
        bt.apply_staged_writes()
        writes = [(int(rng.integers(0, 4)), int(rng.integers(0, 6)), rng.integers(-9, 9, size=2).tolist())]
        for row, start, vals in writes:
            ints.stage_write(row, start, vals)
        apply_writes_reference(ints_ref, writes)
        cell = int(rng.integers(0, 16))
        floats.stage_write_elem(cell, step + 0.5)
        floats_ref[cell, 0] = step + 0.5
        if step % 2:
            apply_writes(ints, floats)
        else:
            writer.apply([ints, floats])
    for g in range(2):
        assert bt[g].tensor.tolist() == ref.tables[g].tolist(), (seed, g)
    assert bt.num_blocks_device.tolist() == ref.num_blocks.tolist() == bt.num_blocks.tolist(), seed
    assert ints.tensor.tolist() == ints_ref.tolist() and floats.tensor.tolist() == floats_ref[:, 0].tolist()


def test_eight_threads_with_their_own_objects_match_the_reference(backend):
    import sys
    import threading

    if backend.device.type != "cpu" or backend.name.startswith("triton"):
        pytest.skip("native CPU backends (the GPU case is under tests/gpu)")
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(seed: int) -> None:
        try:
            barrier.wait()
            _thread_worker(seed, backend.name, steps=150)
        except BaseException as exc:  # reported below, with the thread's seed
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads as often as possible: interleave staging and applies
    try:
        threads = [threading.Thread(target=run, args=(seed,)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
