"""Device-sourced writes (`multiwrite.apply_device_writes`) on every backend that declares them, against the one
sequential reference (`multiwrite.reference.apply_device_writes_reference`): every source kind, index and table dtype,
batches of 1 to 1024 writes, empty writes and full rows, overlapping writes (the later wins), two sets in one call,
rows past 2^31 elements from the table's start, and the bad-input contract."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from multiwrite import (
    BackendUnavailableError,
    DeviceWriteFaults,
    DeviceWrites,
    HostCopies,
    StagedWriteError,
    addresses_of,
    apply_device_writes,
    select_backend,
)
from multiwrite.reference import apply_device_writes_reference
from multiwrite.testing.device_writes import draw_sets
from tests.support.tables import host

TABLE_DTYPES = [torch.int32, torch.int64, torch.float32]


def _skip_without(backend, kinds=("values",)):
    b = select_backend(backend.device, backend.name)
    missing = set(kinds) - set(b.DEVICE_WRITE_SOURCES)
    if missing:
        pytest.skip(f"{backend.name} does not declare device writes from {sorted(missing)}")


def _apply_and_compare(backend, table, drawn, **kw):
    expected = drawn.reference(table)
    apply_device_writes(table, drawn.sets, backend=backend.name, **kw)
    np.testing.assert_array_equal(host(table), expected)
    return expected


@pytest.mark.parametrize("kind", ["values", "tensors", "addresses"])
@pytest.mark.parametrize("dtype", TABLE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_random_sets_match_the_reference(backend, kind, dtype):
    _skip_without(backend, [kind])
    rng = np.random.default_rng(hash((kind, str(dtype))) % 2**32)
    sizes = [1, 7, 130] if backend.interpreted else [1, 7, 130, 1024]
    for bs in sizes:
        for index_dtype, host_copies in ((torch.int32, True), (torch.int64, False)):
            table = torch.full((bs + 1, 40), -1, dtype=dtype, device=backend.device)
            drawn = draw_sets(rng, (bs + 1, 40), backend.device, bs=bs, kind=kind, index_dtype=index_dtype,
                              source_dtype=torch.int64 if dtype != torch.float32 else torch.int32, host=host_copies,
                              max_len=None if bs < 1000 else 5)  # fmt: skip
            expected = _apply_and_compare(backend, table, drawn)
            assert (expected != -1).sum() > 0 or bs == 1


def test_a_scan_over_many_tiles_without_host_copies(backend):
    """1024 writes of up to 40 cells with nothing known on the host: the offsets of the last writes sum the lengths
    of every earlier tile (the look-back crosses many windows)."""
    _skip_without(backend)
    rng = np.random.default_rng(5)
    bs = 300 if backend.interpreted else 1024
    table = torch.zeros((bs, 64), dtype=torch.int32, device=backend.device)
    drawn = draw_sets(rng, (bs, 64), backend.device, bs=bs, host=False)
    drawn.sets[0] = DeviceWrites(drawn.sets[0].rows, drawn.sets[0].starts, drawn.sets[0].lengths,
                                 values=torch.arange(int(drawn.sets[0].lengths.sum()), device=backend.device),
                                 may_overlap=False)  # fmt: skip
    _apply_and_compare(backend, table, drawn)


@pytest.mark.parametrize("host_copies", [True, False], ids=["host", "device-only"])
def test_overlapping_writes_the_later_wins(backend, host_copies):
    """Writes into a few rows with random columns, two sets over the same cells: only in-order application, sets in
    order and writes in index order, gives the reference's table."""
    _skip_without(backend, ["values", "tensors"])
    rng = np.random.default_rng(11)
    for bs in (5, 40):
        table = torch.zeros((3, 16), dtype=torch.int64, device=backend.device)
        a = draw_sets(rng, (3, 16), backend.device, bs=bs, overlap=True, host=host_copies)
        b = draw_sets(rng, (3, 16), backend.device, bs=bs, overlap=True, host=host_copies, kind="tensors")
        drawn = a
        drawn.sets += b.sets
        _apply_and_compare(backend, table, drawn)
    table = torch.zeros((1, 4), dtype=torch.int32, device=backend.device)
    rows, starts, lengths = (torch.tensor(v, device=backend.device) for v in ([0, 0, 0], [0, 1, 3], [4, 2, 1]))
    w = DeviceWrites(rows, starts, lengths, values=torch.tensor([1, 2, 3, 4, 5, 6, 7], device=backend.device),
                     host=HostCopies([0, 0, 0], [0, 1, 3], [4, 2, 1]) if host_copies else None)  # fmt: skip
    apply_device_writes(table, [w], backend=backend.name)
    assert host(table).tolist() == [[1, 5, 6, 7]]


def test_sglang_prefix_and_extend_in_one_call(backend):
    """SGLang's extend step: per request the cached prefix (int64 tensors by address) into [0, pre_len), the new
    tokens (out_cache_loc, int64, flat) into [pre_len, seq_len), of an int32 table with a padding row 0."""
    _skip_without(backend, ["values", "tensors"])
    dev = backend.device
    pool = torch.zeros((6, 12), dtype=torch.int32, device=dev)
    req, pre, ext = [3, 1, 5], [4, 0, 2], [2, 3, 5]
    prefixes = [torch.arange(100 * i, 100 * i + n, dtype=torch.int64, device=dev) for i, n in enumerate(pre, 1)]
    out_cache_loc = torch.arange(1000, 1000 + sum(ext), dtype=torch.int64, device=dev)
    rows = torch.tensor(req, device=dev)
    kind = "addresses" if "addresses" in select_backend(dev, backend.name).DEVICE_WRITE_SOURCES else "tensors"
    sources = addresses_of(prefixes, dev) if kind == "addresses" else prefixes
    prefix = DeviceWrites(rows, torch.zeros(3, dtype=torch.int64, device=dev), torch.tensor(pre, device=dev),
                          sources=sources, source_dtype=torch.int64, may_overlap=False)  # fmt: skip
    extend = DeviceWrites(rows, torch.tensor(pre, device=dev), torch.tensor(ext, device=dev), values=out_cache_loc,
                          host=HostCopies(req, pre, ext))  # fmt: skip
    apply_device_writes(pool, [prefix, extend], backend=backend.name)
    got = host(pool)
    assert got[3, :6].tolist() == [100, 101, 102, 103, 1000, 1001]
    assert got[1, :3].tolist() == [1002, 1003, 1004]
    assert got[5, :7].tolist() == [300, 301, 1005, 1006, 1007, 1008, 1009]
    assert not got[0].any() and not got[2].any() and got.sum() == sum(range(1000, 1010)) + 406 + 601


BAD = {  # (row, start, length) of write 1 of 3 into a (4, 8) table, and what the message says
    "row past the table": ((4, 0, 2), "row 4 is outside [0, 4)"),
    "negative row": ((-1, 0, 2), "row -1"),
    "negative length": ((2, 1, -1), "negative"),
    "negative start": ((2, -1, 2), "negative"),
    "past the row": ((2, 6, 3), "ends at column 9, past the row width 8"),
    "past the row, start + length past 2^63": ((2, 2**62, 2**62), f"ends at column {2**63}, past the row width 8"),
}


@pytest.mark.parametrize("case", list(BAD) + ["values too short"])
def test_bad_writes_with_host_copies_raise_naming_them_and_write_nothing(backend, case):
    _skip_without(backend)
    dev = backend.device
    (row, start, length), words = BAD.get(case, ((2, 0, 7), "end at 8, past the 7 values given"))
    table = torch.full((4, 8), 9, dtype=torch.int32, device=dev)
    r, s, n = [0, row, 3], [0, start, 1], [1, length, 0]
    w = DeviceWrites(*(torch.tensor(x, device=dev) for x in (r, s, n)), values=torch.arange(7, device=dev),
                     host=HostCopies(r, s, n))  # fmt: skip
    ok = DeviceWrites(*(torch.tensor(x, device=dev) for x in ([1], [0], [3])), values=torch.arange(3, device=dev))
    with pytest.raises(StagedWriteError) as info:
        apply_device_writes(table, [ok, w], backend=backend.name)
    text = str(info.value)
    for part in ("set 1", "request 1", f"row {row}", f"start {start}", f"length {length}", "shape (4, 8)", words):
        assert part in text, (part, text)
    assert (host(table) == 9).all(), "a refused call wrote cells"
    with pytest.raises(StagedWriteError, match="request 1"):
        apply_device_writes_reference(np.full((4, 8), 9, np.int32), [ok, w])


def test_bad_writes_without_host_copies_are_skipped_whole_and_recorded(backend):
    """Device-only inputs: each bad write writes nothing (not clipped to its row), the others land, and the fault
    record counts them and names one; the reference skips the same writes."""
    _skip_without(backend)
    dev = backend.device
    r, s, n = [0, 5, 1, 2, 3, 1], [0, 0, 6, -1, 2, 0], [2, 1, 3, 1, -2, 8]
    w = DeviceWrites(*(torch.tensor(x, device=dev) for x in (r, s, n)), values=torch.arange(1, 16, device=dev))
    table = torch.zeros((4, 8), dtype=torch.int32, device=dev)
    faults = DeviceWriteFaults(dev)
    apply_device_writes(table, [w], backend=backend.name, faults=faults)
    skipped: list = []
    expected = apply_device_writes_reference(np.zeros((4, 8), np.int32), [w], skipped)
    assert skipped == [(0, 1), (0, 2), (0, 3), (0, 4)]
    np.testing.assert_array_equal(host(table), expected)
    assert host(table)[1].tolist() == list(range(8, 16)) and host(table)[0].tolist() == [1, 2] + [0] * 6
    assert not host(table)[2:].any()  # the write past row 1 (start 6, length 3) did not spill into row 2
    assert int(host(faults.tensor)[0]) == 4
    with pytest.raises(StagedWriteError, match=r"4 bad write\(s\) skipped, e\.g\. set 0, request [1-4]"):
        faults.check()
    assert not host(faults.tensor).any()
    faults.check()  # cleared: quiet


def test_a_per_row_tensor_shorter_than_its_length_is_skipped_without_host_copies(backend):
    _skip_without(backend, ["tensors"])
    dev = backend.device
    tensors = [torch.tensor([1, 2], device=dev), torch.tensor([3, 4, 5], device=dev), torch.tensor([6], device=dev)]
    w = DeviceWrites(*(torch.tensor(x, device=dev) for x in ([0, 1, 2], [0, 0, 1], [2, 4, 1])), sources=tensors)
    table = torch.zeros((3, 4), dtype=torch.int64, device=dev)
    faults = DeviceWriteFaults(dev)
    apply_device_writes(table, w, backend=backend.name, faults=faults)
    assert host(table).tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [0, 6, 0, 0]]
    skipped: list = []
    np.testing.assert_array_equal(host(table), apply_device_writes_reference(np.zeros((3, 4), np.int64), [w], skipped))
    assert skipped == [(0, 1)] and int(host(faults.tensor)[0]) == 1 and int(host(faults.tensor)[2]) == 1


def test_row_offsets_past_2_to_the_31_elements(backend):
    """A table whose row 1 starts 2^31 + 16 elements after row 0 (a sparse 8 GiB mapping: only touched pages take
    memory): `row * row_stride` must be computed in 64 bits, or the write lands near the start of the mapping."""
    _skip_without(backend)
    if backend.device.type != "cpu":
        pytest.skip("CPU memory mapping (tests/gpu/test_device_writes.py allocates a large table on the GPU)")
    stride = 2**31 + 16
    buf = mmap.mmap(-1, (stride + 64) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)  # MAP_NORESERVE
    try:
        flat = torch.frombuffer(buf, dtype=torch.int32)
        table = flat.as_strided((2, 8), (stride, 1))
        w = DeviceWrites(torch.tensor([1, 0]), torch.tensor([2, 0]), torch.tensor([3, 1]),
                         values=torch.tensor([7, 8, 9, 5]))  # fmt: skip
        apply_device_writes(table, [w], backend=backend.name)
        assert table[1].tolist() == [0, 0, 7, 8, 9, 0, 0, 0] and table[0].tolist() == [5] + [0] * 7
        assert int(flat[:64].sum()) == 5 and int(flat[stride : stride + 8].sum()) == 24
        del flat, table
    finally:
        import gc

        gc.collect()
        buf.close()


def test_values_are_cast_to_the_tables_dtype(backend):
    _skip_without(backend)
    dev = backend.device
    table = torch.zeros((2, 3), dtype=torch.float32, device=dev)
    w = DeviceWrites(torch.tensor([1], device=dev), torch.tensor([0], device=dev), torch.tensor([3], device=dev),
                     values=torch.tensor([2**40 + 1, -3, 16777217], dtype=torch.int64, device=dev))  # fmt: skip
    apply_device_writes(table, w, backend=backend.name)
    assert host(table)[1].tolist() == [2.0**40, -3.0, 16777216.0]
    ints = torch.zeros((1, 3), dtype=torch.int32, device=dev)
    f = DeviceWrites(torch.tensor([0], device=dev), torch.tensor([0], device=dev), torch.tensor([3], device=dev),
                     values=torch.tensor([2.75, -2.75, 7.0], device=dev))  # fmt: skip
    apply_device_writes(ints, f, backend=backend.name)
    assert host(ints).tolist() == [[2, -2, 7]]


def test_structural_errors_name_the_field():
    with pytest.raises(StagedWriteError, match="exactly one of values"):
        DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(StagedWriteError, match="lengths"):
        DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1.0]), values=torch.tensor([1]))
    with pytest.raises(StagedWriteError, match="source_dtype"):
        DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), sources=torch.tensor([0]))
    with pytest.raises(StagedWriteError, match="host.rows holds 2"):
        DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), values=torch.tensor([1]),
                     host=HostCopies([0, 1], [0], [1]))  # fmt: skip
    with pytest.raises(StagedWriteError, match="overlap in memory"):
        apply_device_writes(torch.zeros(8, dtype=torch.int32).as_strided((4, 4), (1, 1)),
                            DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]),
                                         values=torch.tensor([1], dtype=torch.int32)))  # fmt: skip


def test_a_set_reads_its_host_copies_and_tensors_once_when_built():
    a, b = torch.arange(3, dtype=torch.int64), torch.arange(5, dtype=torch.int32)[::2]  # b: not contiguous
    rows, starts, lengths = torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([3, 2])
    host_rows = torch.tensor([2, 0], dtype=torch.int32)
    w = DeviceWrites(rows, starts, lengths, sources=[a, a[:2]], host=HostCopies(host_rows, [0, 1], [3, 2]))
    assert w.source_addresses.tolist() == [a.data_ptr(), a.data_ptr()] and w.source_sizes.tolist() == [3, 2]
    assert [x.tolist() for x in w.host_arrays] == [[2, 0], [0, 1], [3, 2]] and w.length_bound == 3
    host_rows[0] = 99  # after the set is built: it checks what it was built with
    table = torch.zeros(3, 4, dtype=torch.int64)
    apply_device_writes(table, w, backend="torch-generic")
    assert table.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 1, 2, 0]]
    v = DeviceWrites(rows, starts, lengths, values=torch.arange(5), max_length=7)
    assert (v.host_arrays, v.source_sizes, v.source_addresses, v.length_bound) == (None, None, None, 7)
    with pytest.raises(StagedWriteError, match=r"sources\[1\] is not contiguous \(stride 2\)"):
        DeviceWrites(rows, starts, lengths, sources=[b[:1], b])
    with pytest.raises(StagedWriteError, match=r"sources\[1\] must be a 1-D tensor of torch.int64"):
        DeviceWrites(rows, starts, lengths, sources=[a, a.view(1, 3)])
    with pytest.raises(StagedWriteError, match=r"sources\[0\] must be a 1-D tensor of torch.int64"):
        DeviceWrites(rows, starts, lengths, sources=[[1, 2], a], source_dtype=torch.int64)


def test_address_sources_need_a_backend_that_reads_addresses():
    """torch-cpu reads flat values and per-row tensors, never raw addresses: forcing it for an address set is refused
    naming what it lacks."""
    t = torch.arange(4, dtype=torch.int64)
    w = DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), sources=addresses_of([t], "cpu"),
                     source_dtype=torch.int64)  # fmt: skip
    with pytest.raises(BackendUnavailableError, match="device-sourced writes from addresses"):
        apply_device_writes(torch.zeros((1, 4), dtype=torch.int64), w, backend="torch-cpu")


def test_auto_selection_picks_a_backend_that_reads_every_kind_of_the_call(auto_selection):
    """On CPU the torch backends win flat values; only a Triton backend reads raw addresses: through the interpreter
    (which tests/conftest.py turns on where no GPU exists), else no CPU backend does, and the refusal says why."""
    cpu = torch.device("cpu")
    assert select_backend(cpu, dtypes=[torch.int32], device_writes={"values"}).NAME in ("compiled-cpu", "torch-cpu")
    if os.environ.get("TRITON_INTERPRET") == "1":
        chosen = select_backend(cpu, dtypes=[torch.int32], device_writes={"values", "addresses"})
        assert "addresses" in chosen.DEVICE_WRITE_SOURCES
    else:
        with pytest.raises(BackendUnavailableError, match="addresses"):
            select_backend(cpu, dtypes=[torch.int32], device_writes={"values", "addresses"})


def test_a_backend_declaring_device_writes_wrongly_is_set_aside_naming_the_value():
    from multiwrite import Backend
    from multiwrite.plugins.checked import BackendContractError

    class Wrong(Backend):
        NAME = "wrong-device-writes"
        SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})
        DEVICE_WRITE_SOURCES = "values"  # a str, not a set of kinds

        def apply(self, batches):
            raise AssertionError("not called")

    w = DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), values=torch.tensor([1]))
    with pytest.raises(BackendContractError, match=r"DEVICE_WRITE_SOURCES='values' \(a str\) is not a set"):
        apply_device_writes(torch.zeros((1, 1), dtype=torch.int64), w, backend=Wrong())
