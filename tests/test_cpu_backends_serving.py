"""The CPU backends under the conditions an engine runs them (issue 8): complete cache keys, resource use
that stays flat, no write outside a table's current shape whatever the batch says, and threads."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from multiwrite.backends import compiled_cpu, torch_cpu

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, StagedWriteTensor, WriteBatch
from multiwrite.dispatch import select_backend
from multiwrite.reference import (
    ReferenceBlockTables,
    ReferenceStagedTable,
    apply_staged_reference,
    apply_writes_reference,
)

CPU_BACKENDS = [
    "torch-cpu",
    pytest.param(
        "compiled-cpu",
        marks=pytest.mark.skipif(compiled_cpu.scatter_writes is None, reason="multiwrite._cstaging is not built"),
    ),
]


def finalizers() -> int:
    """Live `weakref.finalize` registrations of the process."""
    return len(weakref.finalize._registry)  # type: ignore[attr-defined]


# -- item 6: cache keys and resource use ------------------------------------------------------------
def test_float32_view_of_an_int32_table_is_written_with_float32_bits(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    ints = StagedWriteTensor((2, 4), torch.int32, backend.device, name="ints")
    ints.stage_write(0, 0, [1, 2, 3])
    writer.apply([ints])  # the backend now knows this address, shape and strides as an int32 table
    floats = StagedWriteTensor((2, 4), torch.float32, backend.device, name="floats")
    floats.tensor = ints.tensor.view(torch.float32)  # same storage, shape and strides; float32 bits
    floats.stage_write(0, 1, [1.5, -2.25])
    floats.stage_write(1, 3, [3.0])
    writer.apply([floats])
    expected = np.array([[1, 2, 3, 0], [0, 0, 0, 0]], dtype=np.int32)
    apply_writes_reference(expected.view(np.float32), [(0, 1, [1.5, -2.25]), (1, 3, [3.0])])
    np.testing.assert_array_equal(ints.tensor.cpu().numpy(), expected)  # bit for bit
    assert floats.tensor.cpu()[0, 1:3].tolist() == [1.5, -2.25]


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_applies_register_no_finalizers_and_caches_stay_bounded(name):
    backend = select_backend("cpu", name)
    cache = backend._plans if name == "torch-cpu" else backend._descriptors
    bound = torch_cpu.PLAN_CACHE_SIZE if name == "torch-cpu" else compiled_cpu.DESCRIPTOR_CACHE_SIZE
    writer = FusedStagedWriter("cpu", name)
    long_lived = StagedWriteTensor((8, 8), torch.int32, name="long")
    before = finalizers()
    for i in range(2000):
        long_lived.stage_write(i % 8, 0, [i])
        if i % 10 == 0:  # a short-lived table of its own shape, applied together with the long-lived one
            short = StagedWriteTensor((2, 1 + i % 97), torch.int32, name="short")
            short.stage_write(1, 0, [i])
            writer.apply([long_lived, short])
            assert short.tensor[1, 0] == i
        else:
            writer.apply([long_lived])
        assert len(cache) <= bound
    assert finalizers() - before <= 2  # was 2,200 for torch-cpu: one finalizer per table per new plan
    assert long_lived.tensor[:, 0].tolist() == list(range(1992, 2000))


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_dropped_table_is_freed_and_a_new_one_at_its_address_is_written(name):
    # No cache entry keeps a table alive, and an entry left by a dead table at a reused address with the
    # same shape addresses the new table's own memory (in the new table's dtype). The address is reused
    # on purpose: every table is installed over the same 64 bytes of one pool, alternately int32 and
    # float32 (a fresh allocation is not guaranteed to land where a freed one was).
    writer = FusedStagedWriter("cpu", name)
    pool = torch.zeros(64, dtype=torch.uint8)
    for i in range(50):
        dtype = torch.float32 if i % 2 else torch.int32
        pool.zero_()
        t = StagedWriteTensor((4, 4), dtype, name="t")
        t.tensor = pool.view(dtype).view(4, 4)
        t.stage_write(i % 4, i % 3, [i, i + 1])
        writer.apply([t])
        expected = apply_writes_reference(np.zeros((4, 4), t.tensor.numpy().dtype), [(i % 4, i % 3, [i, i + 1])])
        np.testing.assert_array_equal(t.tensor.numpy(), expected)
        assert t.tensor.data_ptr() == pool.data_ptr()
        dead = weakref.ref(t)
        writer.forget()
        del t
        gc.collect()  # a StagedWriteTensor and its staging arena refer to each other
        assert dead() is None  # no cache holds the table object alive


# -- defence in depth: never outside a table's current shape ----------------------------------------
def _batch(tables, writes, dtype=np.int32):
    meta, values = [], []
    for table, row, start, vals in writes:
        meta.append((table, row, start, len(vals), len(values)))
        values.extend(vals)
    return WriteBatch(tables, np.asarray(meta, np.int32).reshape(-1, 5), np.asarray(values, dtype), True)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize(
    "write, what",
    [
        ((0, 0, 0, [1, 2, 3]), r"row 0, start 0, length 3"),  # past the width: would land in row 1
        ((0, 4, 0, [1]), r"row 4, start 0, length 1"),
        ((1, -1, 0, [1]), r"row -1, start 0, length 1"),
        ((1, 0, -1, [1]), r"row 0, start -1, length 1"),
        ((2, 0, 0, [1]), r"table 2"),
    ],
    ids=["past-width", "row-past-end", "negative-row", "negative-start", "no-such-table"],
)
def test_a_batch_outside_a_table_writes_nothing(name, write, what):
    backend = select_backend("cpu", name)
    storage = torch.zeros(16, dtype=torch.int32)
    a = storage[:8].view(4, 2)  # two tables in one storage: a write past a's width would hit a's next row
    b = storage[8:].view(2, 4)
    batch = _batch([a, b], [(0, 1, 0, [5, 6]), write, (0, 3, 1, [7])])
    with pytest.raises(StagedWriteError, match=what) as info:
        backend.apply([batch])
    assert name in str(info.value)
    if "table 2" not in what:
        assert f"shape {(4, 2) if write[0] == 0 else (2, 4)}" in str(info.value)
    assert storage.sum() == 0  # not even the valid writes before it


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_bad_batch_of_one_dtype_stops_the_others(name):
    backend = select_backend("cpu", name)
    ints, floats = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.float32)
    good = _batch([ints], [(0, 0, 0, [1, 2])])
    bad = _batch([floats], [(0, 1, 1, [1.0, 2.0])], np.float32)
    with pytest.raises(StagedWriteError, match="row 1, start 1, length 2"):
        backend.apply([good, bad])
    assert ints.sum() == 0 and floats.sum() == 0


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_shrunk_staged_write_tensor_handed_over_directly(name):
    t = StagedWriteTensor((4, 4), torch.int32, name="shrunk")
    t.stage_write(0, 1, [1, 2, 3])  # columns 1..3
    t.stage_write(2, 0, [9])
    whole = t.tensor.view(16)  # every cell of the storage, whatever shape the table takes
    t.tensor.resize_(4, 2)  # same storage, now rows of 2: column 3 of row 0 is cell (1, 1)
    arena = t._arena
    batch = WriteBatch([t._table], arena.meta[: arena.num_writes], arena.values[: arena.num_values], False, True)
    bad = r"table 0, row 0, start 1, length 3\) is outside its table \(shape \(4, 2\)"
    with pytest.raises(StagedWriteError, match=bad):
        select_backend("cpu", name).apply([batch])
    assert whole.data_ptr() == t.tensor.data_ptr() and whole.tolist() == [0] * 16


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_block_table_resized_under_staging_is_never_written_outside(staging, name):
    # Issue 8 item 4: shrunk from 4 to 2 columns, a 3-id append used to land in the next request's row.
    # A BlockTables group cannot be replaced (its tables share one allocation with num_blocks): the
    # replacement is refused, nothing changes, and the tables keep their shape and their writes.
    bt = BlockTables([16, 16], 3, [4, 4], "cpu", backend=name)
    bt.append_block_ids(1, ([5], [6]), overwrite=True)
    bt.apply_staged_writes()
    storage = torch.zeros(12, dtype=torch.int32)
    with pytest.raises(StagedWriteError, match=r"group 0 \(shape \(3, 4\)\).*cannot be replaced"):
        bt[0].tensor = storage[:6].view(3, 2)  # narrower, rows back to back in a storage of its own
    assert storage.tolist() == [0] * 12 and bt[0].tensor.shape == (3, 4)
    bt.append_block_ids(0, ([1, 2, 3], [7]), overwrite=True)
    bt.apply_staged_writes()
    assert bt[0].tensor.tolist() == [[1, 2, 3, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    assert bt.num_blocks_device[:, :2].tolist() == [[3, 1], [1, 1]]


# -- thread safety of the shared backend state ------------------------------------------------------
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_eight_threads_with_their_own_tables_match_the_reference(name):
    """8 threads, each with its own BlockTables, StagedWriteTensors and writer on the one shared backend
    instance; short-lived tables keep the backend's cache filling and evicting concurrently."""
    failures: list[str] = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            bt = BlockTables([16, 32], 4, [6, 6], "cpu", kernel_block_sizes=[16, 16], backend=name)
            ref = ReferenceBlockTables([16, 32], 4, [6, 6], [16, 16])
            writer = FusedStagedWriter("cpu", name)
            barrier.wait()
            for step in range(150):
                for req in rng.choice(4, size=2, replace=False).tolist():
                    full = ref.num_blocks[0, req] >= 5 or ref.num_blocks[1, req] >= 10
                    ids = ([int(rng.integers(0, 1000))], [int(rng.integers(0, 1000))])
                    bt.append_block_ids(req, ids, overwrite=full)
                    ref.append_block_ids(req, ids, overwrite=full)
                bt.apply_staged_writes()
                ref.apply_staged_writes()
                dtype = (torch.int32, torch.int64, torch.float32)[step % 3]
                short = StagedWriteTensor((3, 3 + (seed * 7 + step) % 13), dtype, name=f"short{seed}")
                mirror = ReferenceStagedTable(np.zeros(short.shape, short.tensor.numpy().dtype), name="mirror")
                for w in [(step % 3, 1, [seed, step]), (step % 3, 0, [step])]:
                    short.stage_write(*w)
                    mirror.stage_write(*w)
                writer.apply([short])
                apply_staged_reference([mirror])
                if not np.array_equal(short.tensor.numpy(), mirror.table):
                    failures.append(f"thread {seed} step {step}: short table differs")
            for g in range(2):
                if not np.array_equal(bt[g].tensor.numpy(), ref.tables[g]):
                    failures.append(f"thread {seed}: group {g} differs")
            if not np.array_equal(bt.num_blocks_device.numpy(), ref.num_blocks):
                failures.append(f"thread {seed}: num_blocks differ")
        except Exception as exc:  # noqa: BLE001 - reported below with the thread
            failures.append(f"thread {seed}: {exc!r}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert failures == []


# -- the reference refuses what the library refuses -------------------------------------------------
@pytest.mark.parametrize(
    "block, kernel, what",
    [(16, 64, "block size 16 is not a positive multiple of its kernel block size 64"), (48, 32, "48 .* 32")],
)
def test_reference_refuses_block_sizes_that_are_not_multiples(block, kernel, what):
    with pytest.raises(StagedWriteError, match=what):
        ReferenceBlockTables([16, block], 2, [4, 4], [16, kernel])
    with pytest.raises(StagedWriteError, match=what):  # the library agrees
        BlockTables([16, block], 2, [4, 4], "cpu", [16, kernel])


def test_reference_checks_its_other_inputs():
    ref = ReferenceBlockTables([32], 2, [2], [16])
    with pytest.raises(StagedWriteError, match="block id -1 is negative"):
        ref.append_block_ids(0, ([-1],), overwrite=True)
    with pytest.raises(StagedWriteError, match=r"request row 2 is outside \[0, 2\)"):
        ref.append_block_ids(2, ([1],), overwrite=True)
    with pytest.raises(StagedWriteError, match="past the row width 4"):
        ref.append_block_ids(0, ([1, 2, 3],), overwrite=True)
    with pytest.raises(StagedWriteError, match="the tables have 1"):
        ref.append_block_ids(0, ([1], [2]), overwrite=True)
    assert ref.tables[0].sum() == 0 and ref.num_blocks.sum() == 0  # nothing of a refused call
    table = np.zeros((2, 3), np.int32)
    with pytest.raises(StagedWriteError, match=r"row -1 is outside \[0, 2\)"):  # numpy would wrap around
        apply_writes_reference(table, [(-1, 0, [1])])
    with pytest.raises(StagedWriteError, match="kernel_blocks_per_block must be >= 1"):
        apply_writes_reference(table, [(0, 0, [1])], 0)
    with pytest.raises(StagedWriteError, match="does not fit int32"):
        apply_writes_reference(table, [(0, 0, [2**31])])
    assert table.sum() == 0


def test_reference_staged_semantics():
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
    assert c.num_staged_writes == 1 and c.table.sum() == 0
    with pytest.raises(StagedWriteError, match="does not fit shape"):
        c.replace(np.zeros((1, 1), np.int64))
    c.replace(np.zeros((2, 2), np.int64))
    apply_staged_reference([c])
    assert c.table.tolist() == [[10, 11], [0, 0]]
    ref = ReferenceBlockTables([16], 2, [3])
    ref.append_block_ids(0, ([4],), overwrite=True)
    ref.apply_staged_writes()
    ref.append_block_ids(0, ([5],), overwrite=False)
    ref.clear_staged_writes()
    assert ref.tables[0][0].tolist() == [4, 0, 0] and ref.num_blocks[0].tolist() == [1, 0]

