"""`FusedStagedWriter.apply` and `multiwrite.apply_writes`: many tables of several arenas and dtypes in one backend
call, in true staging order also where tables share memory; what is refused before anything is written (aliasing
across dtypes, a table on another device, an item that is no table), with every write kept; a failing backend
(`BackendError`) and an interrupt, with every write kept and a retry landing them all; distinct objects from
distinct threads; no table kept alive by an apply.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import types
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiwrite import (
    Backend,
    BackendError,
    BlockTables,
    FusedStagedWriter,
    StagedWriteError,
    StagedWriteTensor,
    apply_writes,
    get_plugin_manager,
    hookimpl,
)
from multiwrite.reference import ReferenceStagedTable, apply_staged_reference, apply_writes_reference
from multiwrite.staging.arena import StagingArena
from multiwrite.testing.staging import block_tables_class
from tests.support.backends import HalfFailingBackend, RecordingBackend
from tests.support.tables import CPU, examples, host
from tests.support.threads import run_interleaved


# -- staging order across arenas and tables sharing memory ----------------------------------------------------
class Tables:
    """Tables of four arenas on `device`, several over one memory, and their references over numpy memory of the
    same layout: `base` (4 x 8), `alias` = rows 1..2 of base (an arena of its own), `low` = rows 2..3 of base and
    `own` (2 x 8, kernel blocks of 2) sharing an arena, `floats` (another dtype, its own memory)."""

    def __init__(self, device: torch.device):
        self.base = StagedWriteTensor((4, 8), torch.int32, device, name="base")
        self.alias = StagedWriteTensor((2, 8), torch.int32, device, name="alias")
        self.alias.tensor = self.base.tensor[1:3]
        arena = StagingArena(np.int32)
        self.low = StagedWriteTensor.in_arena(self.base.tensor[2:4], arena, name="low")
        self.own = StagedWriteTensor.in_arena(torch.zeros(2, 8, dtype=torch.int32, device=device), arena, name="own",
                                              kernel_blocks_per_block=2)  # fmt: skip
        self.floats = StagedWriteTensor((3, 4), torch.float32, device, name="floats")
        self.all = [self.base, self.alias, self.low, self.own, self.floats]
        memory = np.zeros((4, 8), np.int64)
        self.refs = [
            ReferenceStagedTable(memory, name="base"),
            ReferenceStagedTable(memory[1:3], name="alias"),
            ReferenceStagedTable(memory[2:4], name="low"),
            ReferenceStagedTable(np.zeros((2, 8), np.int64), kernel_blocks_per_block=2, name="own"),
            ReferenceStagedTable(np.zeros((3, 4), np.float32), name="floats"),
        ]

    def check(self) -> None:
        for t, ref in zip(self.all, self.refs):
            np.testing.assert_array_equal(host(t.tensor), ref.table, err_msg=t.name)
            assert t.num_staged_writes == ref.num_staged_writes, t.name


@st.composite
def operations(draw):
    ops = []
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["write"] * 6 + ["apply", "apply", "clear"]))
        if kind == "write":
            t = draw(st.integers(0, 4))
            rows, cols, k = [(4, 8, 1), (2, 8, 1), (2, 8, 1), (2, 8, 2), (3, 4, 1)][t]
            row, start = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols))
            n = draw(st.integers(0, (cols - start) // k))
            ops.append(("write", t, row, start, draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n))))
        elif kind == "apply":  # a subset of the tables, in any order, some twice, as a list or an iterator
            picked = draw(st.lists(st.integers(0, 4), min_size=1, max_size=7))
            ops.append(("apply", picked, draw(st.booleans())))
        else:  # a clear of one table (of a shared arena: its runs are dropped as a partial apply drops them)
            ops.append(("clear", [draw(st.integers(0, 4))]))
    return ops


def test_tables_of_several_arenas_and_over_one_memory_land_in_true_staging_order(backend):
    writer = FusedStagedWriter(backend.device, backend.name)

    @settings(max_examples=examples(backend, 40), deadline=None, suppress_health_check=list(HealthCheck))
    @given(operations())
    def check(ops):
        tables = Tables(backend.device)
        for op in ops:
            if op[0] == "write":
                _, t, row, start, values = op
                tables.all[t].stage_write(row, start, values)
                tables.refs[t].stage_write(row, start, values)
            elif op[0] == "apply":
                _, picked, as_iterator = op
                chosen = [tables.all[i] for i in picked]
                writer.apply(iter(chosen) if as_iterator else chosen)
                apply_staged_reference(tables.refs[i] for i in picked)
                tables.check()
            else:
                for t in op[1]:
                    tables.all[t].clear_staged_writes()
                    tables.refs[t].clear_staged_writes()
        writer.apply(tables.all)
        apply_staged_reference(tables.refs)
        tables.check()

    check()


def test_writes_staged_after_part_of_an_arena_was_applied_keep_their_place_in_staging_order():
    writer = FusedStagedWriter("cpu", CPU)
    base = StagedWriteTensor((4, 4), torch.int32, name="base")
    arena = StagingArena(np.int32)
    low = StagedWriteTensor.in_arena(base.tensor[2:4], arena, name="low")  # low row 0 is base row 2
    own = StagedWriteTensor.in_arena(torch.zeros(2, 4, dtype=torch.int32), arena, name="own")
    own.stage_write(0, 0, [5])
    base.stage_write(2, 0, [7])
    low.stage_write(1, 0, [9])
    writer.apply([low])  # part of the shared arena (a clear of low drops it alike): own's write stays staged
    low.stage_write(0, 0, [1])  # staged after base's 7: wins
    writer.apply([base, low, own])
    assert host(base.tensor)[2:].tolist() == [[1, 0, 0, 0], [9, 0, 0, 0]] and host(own.tensor)[0, 0] == 5


def test_one_apply_of_several_arenas_is_one_backend_call_with_one_batch_per_dtype():
    recorder = RecordingBackend()
    writer = FusedStagedWriter("cpu", recorder)
    x = StagedWriteTensor((2, 4), torch.int32, name="x")
    y = StagedWriteTensor((2, 4), torch.int32, name="y")
    f = StagedWriteTensor((2, 2), torch.float32, name="f")
    x.stage_write(0, 0, [1])
    y.stage_write(0, 0, [2])
    f.stage_write(1, 1, [0.5])
    x.stage_write(1, 0, [3, 4])
    y.stage_write(1, 2, [5])
    writer.apply([y, f, x])
    (call,) = recorder.calls
    by_dtype = {batch.dtype: batch for batch in call}
    assert len(call) == 2 and set(by_dtype) == {torch.int32, torch.float32}
    ints, floats = by_dtype[torch.int32], by_dtype[torch.float32]
    # the int32 writes of both arenas in the order they were staged (tables numbered in the order given: y, x)
    assert ints.writes() == [(1, 0, 0, [1]), (0, 0, 0, [2]), (1, 1, 0, [3, 4]), (0, 1, 2, [5])]
    assert ints.num_tables == 2 and ints.may_overlap is False  # disjoint memory, distinct rows per table
    assert floats.writes() == [(0, 1, 1, [0.5])]
    writer.apply([x, y, f])  # nothing staged: the backend is not called
    assert len(recorder.calls) == 1
    # tables of two arenas over one memory: the merged batch may overlap (the backend must keep its order)
    z = StagedWriteTensor((2, 4), torch.int32, name="z")
    z.tensor = x.tensor
    x.stage_write(0, 0, [6])
    z.stage_write(1, 0, [7])
    writer.apply([x, z])
    assert recorder.last.may_overlap is True and recorder.last.writes() == [(0, 0, 0, [6]), (1, 1, 0, [7])]


def test_apply_reads_any_iterable_at_every_call_and_counts_a_table_once(staging):
    writer = FusedStagedWriter("cpu", CPU)
    a = StagedWriteTensor((2, 4), torch.int32, name="a")
    b = StagedWriteTensor((2, 4), torch.int32, name="b")
    listed = [a]
    for step in range(3):
        a.stage_write(0, step, [step + 1])
        writer.apply(iter(listed) if step % 2 else (t for t in listed))
        b.stage_write(1, step, [step + 10])
        a.stage_write(1, step, [step + 20])
        listed[0] = b  # the same list, mutated in place: read again at the next call
        writer.apply(listed)
        assert host(b.tensor)[1, step] == step + 10 and b.num_staged_writes == 0
        assert host(a.tensor)[1, step] == 0 and a.num_staged_writes == 1  # not asked for: still staged
        listed[0] = a
        writer.apply([a, a, a])  # listed three times: applied once
        assert host(a.tensor)[:, step].tolist() == [step + 1, step + 20]
    bt = two_groups(staging)
    bt.append_block_ids(1, ([1], [2]), True)
    writer.apply([bt[0], bt[1], bt[0]])  # as many items as the arena has tables, but num_blocks' row is not one
    assert host(bt[0].tensor)[1, 0] == 1 and host(bt[1].tensor)[1, 0] == 2
    assert host(bt.num_blocks_device)[:, 1].tolist() == [0, 0]
    bt.apply_staged_writes()  # the counts' write was kept and lands now
    assert host(bt.num_blocks_device)[:, 1].tolist() == [1, 1] and bt.num_blocks[:, 1].tolist() == [1, 1]


def two_groups(staging: str) -> BlockTables:
    return block_tables_class(staging)([16, 16], 4, [4, 4], "cpu", backend=CPU)


def test_a_view_of_a_block_tables_group_lands_in_staging_order_with_the_group(staging):
    bt = two_groups(staging)
    view = StagedWriteTensor((4, 4), torch.int32, name="view")
    view.tensor = bt[0].tensor
    bt.append_block_ids(0, ([1, 2], [3]), True)
    view.stage_write(0, 1, [9])  # staged after the append: wins on (0, 1)
    bt.append_block_ids(1, ([4], []), True)
    view.stage_write(1, 0, [8, 8])  # wins on (1, 0); (1, 1) is rewritten by the append below
    bt.append_block_ids(1, ([5], []), False)
    FusedStagedWriter("cpu", CPU).apply([view, *bt.block_tables])
    assert host(bt[0].tensor)[:2, :3].tolist() == [[1, 9, 0], [8, 5, 0]]
    bt.apply_staged_writes()
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[2, 2], [1, 0]]


# -- refused before anything is written -----------------------------------------------------------------------
def test_tables_of_two_dtypes_over_one_memory_are_refused_with_their_writes_kept():
    writer = FusedStagedWriter("cpu", CPU)
    ints = StagedWriteTensor((2, 4), torch.int32, name="ints")
    floats = StagedWriteTensor((2, 4), torch.float32, name="floats")
    floats.tensor = ints.tensor.view(torch.float32)
    other = StagedWriteTensor((2, 4), torch.int32, name="other")
    ints.stage_write(0, 0, [1])
    floats.stage_write(0, 1, [2.0])
    other.stage_write(1, 1, [3])
    with pytest.raises(StagedWriteError, match="tables of dtypes int32 and float32 share memory in one apply: .* "
                                               "Nothing was written and every staged write stays staged"):  # fmt: skip
        writer.apply([other, ints, floats])
    assert host(ints.tensor).sum() == 0 and host(other.tensor).sum() == 0
    assert (ints.num_staged_writes, floats.num_staged_writes, other.num_staged_writes) == (1, 1, 1)
    writer.apply([ints, other])  # apart, they apply
    writer.apply([floats])
    assert host(ints.tensor)[0, 0] == 1 and host(floats.tensor)[0, 1] == 2.0 and host(other.tensor)[1, 1] == 3


def test_a_table_on_another_device_is_refused_with_every_write_kept():
    writer = FusedStagedWriter("cpu", CPU)
    local = StagedWriteTensor((2, 4), torch.int32, name="local")
    remote = StagedWriteTensor((2, 4), torch.int32, "meta", name="remote")
    local.stage_write(0, 0, [1, 2])
    remote.stage_write(1, 1, [3])
    with pytest.raises(
        StagedWriteError,
        match=r"remote \(shape \(2, 4\), int32\) is on meta, but this writer applies "
        "to cpu; nothing was written and its 1 staged writes stay staged",
    ):
        writer.apply([local, remote])
    assert host(local.tensor).sum() == 0 and local.num_staged_writes == 1 and remote.num_staged_writes == 1
    writer.apply([local])
    assert host(local.tensor)[0].tolist() == [1, 2, 0, 0]


def test_an_item_that_is_no_staged_write_tensor_is_named_with_its_position():
    t = StagedWriteTensor((2, 2), torch.int32)
    t.stage_write(0, 0, [1])
    writer = FusedStagedWriter("cpu", CPU)
    for bad, what in [(torch.zeros(2), r"torch\.Tensor"), (np.zeros(3), r"numpy\.ndarray"), ("x", "builtins.str")]:
        with pytest.raises(TypeError, match=rf"FusedStagedWriter.apply: item 1 is a {what}, not a StagedWriteTensor; "
                                            "nothing was written"):  # fmt: skip
            writer.apply([t, bad])
    with pytest.raises(TypeError, match="apply_writes: argument 1 is a list, not a StagedWriteTensor"):
        apply_writes(t, [t])
    assert t.num_staged_writes == 1 and host(t.tensor).sum() == 0
    writer.apply([t])
    assert host(t.tensor)[0, 0] == 1


# -- failures -------------------------------------------------------------------------------------------------
def test_a_failing_backend_raises_backend_error_and_a_retry_lands_every_write():
    failing = HalfFailingBackend(failures=2)
    writer = FusedStagedWriter("cpu", failing)
    a = StagedWriteTensor((2, 4), torch.int32, name="a")
    b = StagedWriteTensor((2, 4), torch.int32, name="b")
    a.stage_write(0, 0, [1, 2])
    b.stage_write(1, 1, [3])
    a.stage_write(0, 1, [4])
    for _ in range(2):
        with pytest.raises(BackendError) as info:
            writer.apply([a, b, a])
        message = str(info.value)
        assert "backend 'half-failing' (tests.support.backends.HalfFailingBackend) failed applying 3 staged writes " \
               "to a, b on cpu: RuntimeError: lost the device half-way" in message  # fmt: skip
        assert "every staged write is still staged, and applying again lands them all" in message
        assert isinstance(info.value.__cause__, RuntimeError) and info.value.backend is failing
        assert info.value.tables == ("a", "b")
        assert a.num_staged_writes == 2 and b.num_staged_writes == 1
    assert host(a.tensor)[0].tolist() == [1, 4, 0, 0] and host(b.tensor).sum() == 0  # the half it wrote
    a.stage_write(1, 3, [5])  # staging goes on after a failure
    writer.apply([a, b])
    assert host(a.tensor).tolist() == [[1, 4, 0, 0], [0, 0, 0, 5]] and host(b.tensor)[1].tolist() == [0, 3, 0, 0]
    assert failing.calls == 3 and a.num_staged_writes == 0 and b.num_staged_writes == 0


def test_a_keyboard_interrupt_passes_through_unwrapped_with_the_writes_staged():
    writer = FusedStagedWriter("cpu", HalfFailingBackend(KeyboardInterrupt()))
    a = StagedWriteTensor((2, 4), torch.int32, name="a")
    a.stage_write(0, 0, [1])
    a.stage_write(1, 2, [2])
    with pytest.raises(KeyboardInterrupt):
        writer.apply([a])
    assert a.num_staged_writes == 2
    writer.apply([a])
    assert host(a.tensor).tolist() == [[1, 0, 0, 0], [0, 0, 2, 0]] and a.num_staged_writes == 0


# -- lifetimes, devices, threads ------------------------------------------------------------------------------
def test_applied_tables_are_not_kept_alive(backend):
    t = StagedWriteTensor((64, 64), torch.int32, backend.device)
    t.stage_write(0, 0, [1])
    apply_writes(t)
    u = StagedWriteTensor((8, 8), torch.int64, backend.device)
    u.stage_write(1, 0, [2])
    FusedStagedWriter(backend.device, backend.name).apply([u])
    tables = [weakref.ref(t.tensor), weakref.ref(u.tensor)]
    del t, u
    bt = BlockTables([16], 8, [8], backend.device, backend=backend.name)
    bt.append_block_ids(0, ([1],), True)
    bt.apply_staged_writes()
    bt.apply_staged_writes()
    tables.append(weakref.ref(bt[0].tensor))
    del bt
    gc.collect()
    assert [ref() is None for ref in tables] == [True, True, True]


class MetaRecorder(Backend):
    """A backend for the `meta` device (which no built-in serves) that records what it is asked to write."""

    NAME = "test-meta-recorder"
    PRIORITY = 60
    SUPPORTED_DEVICE_TYPES = frozenset({"meta"})

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int, list]] = []

    def apply(self, batches):
        for b in batches:
            for table, row, start, n, off in b.meta.tolist():
                self.writes.append((table, row, start, b.values[off : off + n].tolist()))


@contextlib.contextmanager
def registered(backend: Backend):
    plugin = types.SimpleNamespace(multiwrite_backends=hookimpl(lambda: [backend]))
    manager = get_plugin_manager()
    manager.register(plugin, name="test-meta-plugin")
    try:
        yield
    finally:
        manager.unregister(plugin)


def test_apply_writes_applies_the_tables_of_each_device_through_that_devices_writer(auto_selection):
    meta = MetaRecorder()
    result: list[object] = []

    def run() -> None:  # in a thread of its own: its shared writers (one per device and thread) die with it
        try:
            here = StagedWriteTensor((2, 2), torch.int32, name="here")
            there = StagedWriteTensor((2, 2), torch.int32, "meta", name="there")
            here.stage_write(1, 1, [7])
            there.stage_write(0, 0, [8, 9])
            apply_writes(here, there)
            result.append((host(here.tensor).tolist(), here.num_staged_writes, there.num_staged_writes))
            result.append(FusedStagedWriter.default_for("meta").backend is meta)
        except BaseException as exc:  # reported below
            result.append(exc)

    with registered(meta):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert result == [([[0, 0], [0, 7]], 0, 0), True]
    assert meta.writes == [(0, 0, 0, [8, 9])]


def test_distinct_tables_and_writers_from_eight_threads_match_the_reference(backend):
    steps = 6 if backend.interpreted else 120

    def worker(seed: int, ready) -> None:
        rng = np.random.default_rng(seed)
        ints = StagedWriteTensor((4, 8), torch.int32, backend.device, name=f"ints{seed}", kernel_blocks_per_block=2)
        floats = StagedWriteTensor(16, torch.float32, backend.device, name=f"floats{seed}")
        writer = FusedStagedWriter(backend.device, backend.name)
        ints_ref, floats_ref = np.zeros((4, 8), np.int64), np.zeros((16, 1), np.float64)
        ready()
        for step in range(steps):
            writes = [(int(rng.integers(0, 4)), int(rng.integers(0, 5)), rng.integers(0, 99, size=2).tolist())
                      for _ in range(int(rng.integers(1, 4)))]  # fmt: skip
            for row, start, values in writes:
                ints.stage_write(row, start, values)
            apply_writes_reference(ints_ref, writes, 2)
            cell = int(rng.integers(0, 16))
            floats.stage_write_elem(cell, step + 0.5)
            floats_ref[cell, 0] = step + 0.5
            # a short-lived table of a changing shape: the backends' caches fill and evict meanwhile
            short = StagedWriteTensor((3, 3 + (seed + step) % 7), torch.int64, backend.device, name="short")
            short.stage_write(step % 3, 1, [seed, step])
            if step % 2 and backend.name == FusedStagedWriter.default_for(backend.device).backend.NAME:
                apply_writes(ints, floats, short)  # this thread's shared writer
            else:
                writer.apply([ints, short, floats])
            assert host(short.tensor)[step % 3, 1:3].tolist() == [seed, step], f"step {step}: a short-lived table"
        assert host(ints.tensor).tolist() == ints_ref.tolist(), "its int32 table differs from the reference"
        assert host(floats.tensor).tolist() == floats_ref[:, 0].tolist(), "its float32 table differs from the reference"

    assert run_interleaved(worker) == []
