"""`Backend.apply` on `WriteBatch`es built by hand (as a caller other than multiwrite's staging may build them), on
every built-in backend: any value offsets are honoured, and a batch that is not `checked` and lies outside its table
is refused before anything of any batch is written, naming the write, its table, row, start, length and the table's
shape (`WriteBatch.check_bounds`, or compiled-cpu's own check). The Triton backends used to clip such a write
silently: they now refuse it too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import StagedWriteError, WriteBatch, select_backend
from tests.support.tables import host


def batch(tables, writes, dtype=np.int32, checked=False) -> WriteBatch:
    """A WriteBatch of `(table, row, start, values)` writes with values in staging order."""
    meta, values = [], []
    for t, row, start, vals in writes:
        meta.append((t, row, start, len(vals), len(values)))
        values.extend(vals)
    return WriteBatch(tables, np.asarray(meta, np.int32).reshape(-1, 5), np.asarray(values, dtype), False,
                      values_in_order=True, checked=checked)  # fmt: skip


def test_value_offsets_in_any_order_are_honoured(backend):
    """Write w takes values[offset_w : offset_w + length_w] whatever the offsets: out of order, shared, with gaps."""
    be = select_backend(backend.device, backend.name)
    t = torch.zeros(3, 6, dtype=torch.int32, device=backend.device)
    u = torch.zeros(2, 4, dtype=torch.int32, device=backend.device)
    meta = np.array([(0, 2, 1, 2, 4), (1, 0, 0, 3, 0), (0, 0, 3, 3, 1), (1, 1, 2, 1, 7)], np.int32)
    values = np.arange(10, 18, dtype=np.int32)
    be.apply([WriteBatch([t, u], meta, values, False, values_in_order=False)])
    assert host(t).tolist() == [[0, 0, 0, 11, 12, 13], [0] * 6, [0, 14, 15, 0, 0, 0]]
    assert host(u).tolist() == [[10, 11, 12, 0], [0, 0, 17, 0]]


#: (what, write) of writes outside a 3 x 4 table, each after a valid write (which must not land either).
OUTSIDE = [
    ("past the row", (0, 1, 2, [1, 2, 3])),
    ("starting at the row's end", (0, 1, 4, [1])),
    ("the row after the last", (0, 3, 0, [1])),
    ("a negative row", (0, -1, 0, [1])),
    ("a negative start", (0, 0, -2, [1, 2])),
]


@pytest.mark.parametrize("what, write", OUTSIDE, ids=[w for w, _ in OUTSIDE])
def test_a_write_outside_its_table_is_refused_naming_it_and_nothing_is_written(backend, what, write):
    be = select_backend(backend.device, backend.name)
    buf = torch.full((5, 8), -7, dtype=torch.int32, device=backend.device)
    table = buf[1:4, 2:6]  # a 3 x 4 view inside a canary
    table.zero_()
    t, row, start, vals = write
    pattern = (rf"^{be.NAME}.*write 1 \(table 0, row {row}, start {start}, length {len(vals)}\) is outside its table "
               r"\(shape \(3, 4\)")  # fmt: skip
    with pytest.raises(StagedWriteError, match=pattern):
        be.apply([batch([table], [(0, 0, 0, [5, 6]), write])])
    expect = np.full((5, 8), -7)
    expect[1:4, 2:6] = 0
    np.testing.assert_array_equal(host(buf), expect)


def test_a_write_naming_no_table_or_past_the_values_is_refused(backend):
    be = select_backend(backend.device, backend.name)
    table = torch.zeros(3, 4, dtype=torch.int32, device=backend.device)
    no_table = WriteBatch([table], np.array([(0, 0, 0, 1, 0), (1, 0, 0, 1, 1)], np.int32), np.array([1, 2], np.int32),
                          False)  # fmt: skip
    with pytest.raises(StagedWriteError, match=r"write 1 \(table 1 of a batch of 1 tables.*names no table"):
        be.apply([no_table])
    past_values = WriteBatch([table], np.array([(0, 0, 0, 1, 0), (0, 1, 0, 3, 1)], np.int32),
                             np.array([1, 2, 3], np.int32), False)  # fmt: skip
    with pytest.raises(StagedWriteError, match=r"write 1 \(table 0, row 1, start 0, length 3\).*offset 1 of 3"):
        be.apply([past_values])
    assert not table.any()


def test_a_table_shrunk_under_its_batch_is_refused(backend):
    """A batch built for a table that was then resized in place to fewer columns: the backend checks the shape the
    table has now."""
    be = select_backend(backend.device, backend.name)
    table = torch.zeros(3, 6, dtype=torch.int32, device=backend.device)
    b = batch([table], [(0, 0, 0, [1]), (0, 2, 3, [4, 5, 6])])
    table.resize_(3, 4)
    with pytest.raises(StagedWriteError, match=r"write 1 \(table 0, row 2, start 3, length 3\).*\(shape \(3, 4\)"):
        be.apply([b])
    assert not table.any()


def test_a_bad_batch_of_one_dtype_stops_the_batches_of_the_others(backend):
    be = select_backend(backend.device, backend.name)
    ints = torch.zeros(2, 4, dtype=torch.int32, device=backend.device)
    floats = torch.zeros(2, 4, dtype=torch.float32, device=backend.device)
    good = batch([ints], [(0, 0, 0, [1, 2])])
    bad = batch([floats], [(0, 1, 3, [0.5, 1.5])], dtype=np.float32)
    for batches in ([good, bad], [bad, good]):
        with pytest.raises(StagedWriteError, match=r"is outside its table \(shape \(2, 4\)"):
            be.apply(batches)
        assert not ints.any() and not floats.any()


def test_empty_writes_are_no_ops_wherever_they_point(backend):
    be = select_backend(backend.device, backend.name)
    table = torch.zeros(2, 3, dtype=torch.int32, device=backend.device)
    meta = np.array([(0, 9, 9, 0, 0), (0, 1, 1, 2, 0), (0, -1, 0, 0, 2)], np.int32)
    be.apply([WriteBatch([table], meta, np.array([4, 5], np.int32), False)])
    assert host(table).tolist() == [[0, 0, 0], [0, 4, 5]]


def test_check_bounds_passes_a_batch_inside_its_tables_and_names_the_first_write_outside():
    table = torch.zeros(3, 4, dtype=torch.int32)
    batch([table], [(0, 2, 0, [1, 2, 3, 4]), (0, 0, 3, [1])]).check_bounds("mine")
    with pytest.raises(StagedWriteError, match=r"^mine: write 2 \(table 0, row 0, start 3, length 2\).*int32"):
        batch([table], [(0, 0, 0, [1]), (0, 1, 1, [1]), (0, 0, 3, [1, 2]), (0, 5, 0, [1])]).check_bounds("mine")
