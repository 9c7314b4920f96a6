"""`StagedWriteTensor`: what `stage_write` accepts and refuses (errors name table, row, start, length and shape and
stage nothing), dtypes and value kinds, bools refused, kernel block expansion, 1-D tables, and a standalone table
replaced or resized in place (checked at staging and again at every apply, writes kept when refused).

Staging is the same whatever backend applies: those tests apply with `torch-cpu`. Where a backend must follow new
storage (a replacement, a `set_`, a growth in place), the test runs on every backend of the matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from tests.support.tables import CPU, host

BOOLS = [True, np.bool_(True), torch.tensor(True), np.array(True)]
BOOL_IDS = ["bool", "np.bool_", "tensor", "ndarray"]


def apply(*tables: StagedWriteTensor, backend: str = CPU, device: str | torch.device = "cpu") -> None:
    FusedStagedWriter(device, backend).apply(tables)


# -- construction ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: StagedWriteTensor((2, 2), torch.float16), "dtype=torch.float16 (supported: int32, int64, float32)"),
        (lambda: StagedWriteTensor((2, 2), torch.bool), "dtype=torch.bool"),
        (lambda: StagedWriteTensor((2, 2, 2)), "size must be (rows, columns) or n"),
        (lambda: StagedWriteTensor(()), "size must be (rows, columns) or n"),
        (lambda: StagedWriteTensor((2, -1)), "each in [0, 2**31), got (2, -1)"),
        (lambda: StagedWriteTensor((2, 2**31), torch.int32, "meta"), "each in [0, 2**31), got (2, 2147483648)"),
        (lambda: StagedWriteTensor((True, 2)), "size must be integers (rows, columns) or n, got (True, 2)"),
        (lambda: StagedWriteTensor((2.5, 3)), "size must be integers (rows, columns) or n, got (2.5, 3)"),
        (lambda: StagedWriteTensor("4"), "size must be integers"),
        (lambda: StagedWriteTensor((2, 3), kernel_blocks_per_block=1.5), "kernel_blocks_per_block must be an integer"),
        (lambda: StagedWriteTensor((2, 3), kernel_blocks_per_block=0), "kernel_blocks_per_block must be >= 1, got 0"),
        (
            lambda: StagedWriteTensor((2, 4), torch.float32, kernel_blocks_per_block=2),
            "kernel block expansion (kernel_blocks_per_block=2) needs an integer table",
        ),
    ],
    ids=[
        "float16",
        "bool",
        "3-D",
        "0-D",
        "negative",
        "past-int32",
        "bool-size",
        "float-size",
        "str-size",
        "float-k",
        "zero-k",
        "float-table-k",
    ],  # fmt: skip
)
def test_the_constructor_refuses_what_is_no_table(make, fragment):
    with pytest.raises(StagedWriteError) as info:
        make()
    assert fragment in str(info.value)


def test_the_constructor_takes_numpy_integers_and_starts_zero_filled():
    t = StagedWriteTensor((np.int32(3), np.int64(5)), torch.int64, kernel_blocks_per_block=np.int64(2))
    assert t.shape == (3, 5) and t.tensor.dtype == torch.int64 and t.dtype == torch.int64
    assert t.device == torch.device("cpu") and t.name == "table" and t.kernel_blocks_per_block == 2
    assert host(t.tensor).tolist() == [[0] * 5] * 3 and t.num_staged_writes == 0
    vec = StagedWriteTensor(np.int64(4), torch.float32, name="vec")
    assert vec.shape == (4,) and vec.tensor.shape == (4,) and vec.name == "vec"


# -- stage_write refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "row", "start", "values", "fragment"),
    [
        (torch.int32, 4, 0, [1], "row 4 is outside [0, 4)"),
        (torch.int32, -1, 0, [1], "row -1 is outside [0, 4)"),
        (torch.int32, 1, -2, [1], "start is negative"),
        (torch.int32, 1, 5, [1, 2, 3, 4], "ends at column 9 past the row width 8"),
        (torch.int32, 1, 8, [1], "ends at column 9 past the row width 8"),
        (torch.int32, 1, 0, [2**31], "value 2147483648 does not fit int32"),
        (torch.int32, 1, 0, [-(2**31) - 1], "value -2147483649 does not fit int32"),
        (torch.int32, 1, 0, [1, 2.5], "float value cannot go into an integer table"),
        (torch.int64, 1, 0, [2**63], "value 9223372036854775808 does not fit int64"),
        (torch.int64, 1, 0, np.array([1.0]), "values of dtype float64 cannot go into an integer table"),
        (torch.int32, 1, 0, np.array([2**40]), "value 1099511627776 does not fit int32"),
        (torch.int32, 1, 0, [None], "values are not integers"),
        (torch.int32, 1, 0, np.zeros((2, 2), dtype=np.int32), "values must be 1-D, got shape (2, 2)"),
        (torch.float32, 1, 0, [1e39], "overflows float32"),
        (torch.float32, 1, 0, ["x"], "values are not numbers"),
    ],
)
def test_stage_write_refuses_naming_table_row_start_length_and_shape(dtype, row, start, values, fragment):
    t = StagedWriteTensor((4, 8), dtype, name="blocks")
    t.stage_write(2, 1, [7, 8])
    with pytest.raises(StagedWriteError) as info:
        t.stage_write(row, start, values)
    message = str(info.value)
    assert fragment in message
    kind = str(dtype).removeprefix("torch.")
    assert f"blocks (shape (4, 8), {kind}): write at row {row}, start {start}, length " in message
    assert t.num_staged_writes == 1  # nothing of the refused write; the earlier one intact
    apply(t)
    assert host(t.tensor)[2].tolist()[:4] == [0, 7, 8, 0] and host(t.tensor).sum() == 15


@pytest.mark.parametrize(
    ("row", "start", "fragment"),
    [
        ("a", 0, "vec (shape (5,), int32): write at row 'a', start 0: row and start must be integers"),
        (0, 1.5, "vec (shape (5,), int32): write at row 0, start 1.5: row and start must be integers"),
        (7, 0, "vec (shape (5,), int32): write at row 7, start 0, length 1: row 7 is outside [0, 5)"),
    ],
)
def test_an_error_shows_only_the_values_the_caller_gave(row, start, fragment):
    t = StagedWriteTensor(5, torch.int32, name="vec")
    with pytest.raises(StagedWriteError) as info:
        t.stage_write(row, start, [1])
    assert fragment in str(info.value) and "-1" not in str(info.value)
    assert t.num_staged_writes == 0


@pytest.mark.parametrize("flag", BOOLS, ids=BOOL_IDS)
def test_a_bool_is_no_row_or_start(flag):
    t = StagedWriteTensor((3, 4), torch.int32)
    with pytest.raises(StagedWriteError, match=r"row and start must be integers \(a bool"):
        t.stage_write(flag, 0, [1])
    with pytest.raises(StagedWriteError, match=r"row and start must be integers \(a bool"):
        t.stage_write(0, flag, [1])
    with pytest.raises(StagedWriteError, match="a bool"):
        t.stage_write_elem(flag, 1)
    assert t.num_staged_writes == 0


#: Values no table of the dtype holds: (dtype, values, what the message says).
BAD_VALUES = [
    (torch.float32, [10**400], "(too large|overflow)"),
    (torch.float32, [1.0] * 9 + [10**400], "(too large|overflow)"),
    (torch.float32, [True], "bool"),
    (torch.float32, np.array([True, False]), "bool"),
    (torch.float32, torch.tensor([True]), "bool"),
    (torch.float32, ["x"], "not numbers"),
    (torch.float32, [1 + 2j], "not numbers"),
    (torch.float32, [None], "not numbers"),
    (torch.float32, np.array(["1"]), "values of dtype <U1 into a float32 table"),
    (torch.int32, [10**400], "does not fit"),
    (torch.int32, [1] * 9 + [10**400], "does not fit"),
    (torch.int64, [2**63], "does not fit"),
    (torch.int32, [np.int64(2**40)], "does not fit"),
    (torch.int32, [True], "bool"),
    (torch.int32, [1] * 9 + [True], "bool"),
    (torch.int32, [2.5, True] * 5, "bool"),
    (torch.int32, [np.bool_(True)], "bool"),
    (torch.int64, np.array([True]), "bool"),
    (torch.int32, [float("nan")], "float value cannot go into an integer table"),
    (torch.int32, [1.5] * 9, "float value cannot go into an integer table"),
    (torch.int32, [np.float64(5.5)] * 9, "float64 value cannot go into an integer table"),
    (torch.int32, [1] * 9 + [float("inf")], "float value cannot go into an integer table"),
    (torch.int32, [np.float32(1.0)], "float32 value cannot go into an integer table"),
    (torch.int32, ["1"], "not integers"),
    (torch.int32, ["1"] * 9, "not integers"),
    (torch.int32, b"\x01\x02", "values must be numbers, got a bytes"),
    (torch.float32, bytearray(b"\x01"), "values must be numbers, got a bytearray"),
    (torch.int32, "12", "values must be numbers, got a str"),
    (torch.float32, memoryview(b"\x05"), "values must be numbers, got a memoryview"),
    (torch.int32, {1, 2}, "values must be an ordered sequence, got a set"),
    (torch.int32, {1: 2}, "values must be an ordered sequence, got a dict"),
    (torch.int32, torch.ones(2, dtype=torch.bfloat16), "values of dtype torch.bfloat16"),
    (torch.int32, 5, "values must be a sequence, got int"),
]


@pytest.mark.parametrize(("dtype", "values", "fragment"), BAD_VALUES, ids=[str(i) for i in range(len(BAD_VALUES))])
def test_values_the_dtype_cannot_hold_are_refused(dtype, values, fragment):
    t = StagedWriteTensor((2, 16), dtype, name="bad")
    t.stage_write(0, 0, [1])
    with pytest.raises(StagedWriteError, match=r"bad \(shape \(2, 16\), \w+\): write at row 1, start 0.*" + fragment):
        t.stage_write(1, 0, values)
    if isinstance(values, list):  # the element form refuses the offending value alike
        with pytest.raises(StagedWriteError, match=fragment):
            t.stage_write_elem(1, values[-1])
    assert t.num_staged_writes == 1
    apply(t)
    assert host(t.tensor).tolist() == [[1] + [0] * 15, [0] * 16]  # the earlier write, nothing of the refused ones


def test_numbers_in_any_container_are_staged_exactly():
    ints = StagedWriteTensor((4, 4), torch.int64, name="ints")
    ints.stage_write(0, 0, np.array([1, -2], dtype=np.int16))
    ints.stage_write(1, 1, torch.tensor([3, 4, 5], dtype=torch.uint8))
    ints.stage_write(2, 2, (6, 2**40))
    ints.stage_write(3, 0, iter([8]))
    ints.stage_write(3, 1, (v for v in [np.int64(9), np.uint16(10)]))
    ints.stage_write(3, 3, [])  # an empty write: a no-op, counted until applied
    floats = StagedWriteTensor((2, 3), torch.float32, name="floats")
    floats.stage_write(0, 0, np.array([0.5, -1.25], dtype=np.float64))
    floats.stage_write(1, 0, [1, np.float32(2.5), 3])
    floats.stage_write_elem(1, float("nan"))  # a float table holds nan
    assert ints.num_staged_writes == 6 and floats.num_staged_writes == 3
    apply(ints, floats)
    assert host(ints.tensor).tolist() == [[1, -2, 0, 0], [0, 3, 4, 5], [0, 0, 6, 2**40], [8, 9, 10, 0]]
    got = host(floats.tensor)
    assert got[0].tolist() == [0.5, -1.25, 0.0] and np.isnan(got[1, 0]) and got[1, 1:].tolist() == [2.5, 3.0]
    assert ints.num_staged_writes == 0 and floats.num_staged_writes == 0


# -- kernel block expansion -----------------------------------------------------------------------------------
def test_kernel_blocks_expand_each_value_with_python_integers():
    t = StagedWriteTensor((2, 8), torch.int32, kernel_blocks_per_block=4, name="k4")
    t.stage_write(0, 0, [3, np.uint8(250)])  # 250 * 4 is 232 in uint8: must not wrap
    t.stage_write(1, 4, np.array([0], dtype=np.int8))
    apply(t)
    assert host(t.tensor).tolist() == [[12, 13, 14, 15, 1000, 1001, 1002, 1003], [0, 0, 0, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("dtype", "k", "values", "fragment"),
    [
        (
            torch.int32,
            2,
            [2**30],
            "value 1073741824 expanded to 2 kernel blocks (2147483648..2147483649) does not fit int32",
        ),  # fmt: skip
        (torch.int32, 2, [-(2**30) - 1], "value -1073741825 expanded to 2 kernel blocks (-2147483650..-2147483649)"),
        (torch.int64, 4, [np.int64(2**62)], "value 4611686018427387904 expanded to 4 kernel blocks"),
        (torch.int32, 2, [1, 2, 3, 4, 5], "ends at column 10 past the row width 8 (5 values x 2 kernel blocks each)"),
    ],
)
def test_expanded_values_must_fit_the_dtype_and_the_row(dtype, k, values, fragment):
    t = StagedWriteTensor((2, 8), dtype, kernel_blocks_per_block=k, name="g1")
    with pytest.raises(StagedWriteError) as info:
        t.stage_write(0, 0, values)
    assert fragment in str(info.value) and "g1 (shape (2, 8)" in str(info.value)
    assert t.num_staged_writes == 0


# -- 1-D tables, replaced and resized tables (the backends must follow the storage) ---------------------------
def test_a_one_dimensional_table_follows_resize_and_set_in_place(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor(4, torch.int64, backend.device, name="vec")
    t.stage_write(1, 0, [5])
    with pytest.raises(StagedWriteError, match=r"vec \(shape \(4,\), int64\): write at row 0, start 1, length 1: "
                                               "ends at column 2 past the row width 1"):  # fmt: skip
        t.stage_write(0, 1, [1])  # a row of a 1-D table is one column
    writer.apply([t])
    assert t.tensor.shape == (4,) and host(t.tensor).tolist() == [0, 5, 0, 0]
    t.tensor.set_(torch.zeros(8, dtype=torch.int64, device=backend.device))  # grown in place: rows 4..7 exist now
    t.stage_write(6, 0, [6])
    writer.apply([t])
    assert host(t.tensor).tolist() == [0, 0, 0, 0, 0, 0, 6, 0]
    fresh = torch.zeros(8, dtype=torch.int64, device=backend.device)
    old = t.tensor.clone()
    t.tensor.set_(fresh)  # other memory, the same size: the writes land there
    t.stage_write(2, 0, [9])
    writer.apply([t])
    assert host(fresh).tolist() == [0, 0, 9, 0, 0, 0, 0, 0] and host(old).tolist() == [0, 0, 0, 0, 0, 0, 6, 0]
    t.stage_write(7, 0, [1])
    t.tensor.resize_(3)  # shrunk below a staged write
    with pytest.raises(StagedWriteError, match=r"vec \(shape \(3,\), int64\): write at row 7.*not fit shape \(3,\)"):
        writer.apply([t])
    assert t.num_staged_writes == 1 and host(t.tensor).tolist() == [0, 0, 9]


def test_a_replacement_is_checked_then_written_instead_of_the_old_table(backend):
    writer = FusedStagedWriter(backend.device, backend.name)
    t = StagedWriteTensor((2, 2), torch.float32, backend.device, name="f")
    t.stage_write(1, 0, [0.5, 0.25])
    old = t.tensor
    device = backend.device
    refusals = [
        (torch.zeros(1, 2, device=device), r"f \(shape \(2, 2\), float32\): write at row 1, start 0, length 2: "
                                           r"staged before the table was resized, does not fit shape \(1, 2\)"),
        (torch.zeros(2, 2, dtype=torch.int32, device=device), "replacement tensor must be 2-D float32, got 2-D int32"),
        (torch.zeros(4, device=device), "replacement tensor must be 2-D float32, got 1-D float32"),
        ("x", "replacement must be a torch.Tensor, got str"),
    ]  # fmt: skip
    for new, fragment in refusals:
        with pytest.raises(StagedWriteError, match=fragment):
            t.tensor = new
        assert t.tensor is old and t.num_staged_writes == 1
    grown = torch.zeros(3, 5, device=backend.device)
    t.tensor = grown  # the staged write fits: kept, and it lands in the new table
    t.stage_write(2, 1, [1.5, 2.5, 3.5, 4.5])  # past the old shape, inside the new one
    writer.apply([t])
    assert t.tensor is grown and host(old).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert host(grown).tolist() == [[0.0] * 5, [0.5, 0.25, 0.0, 0.0, 0.0], [0.0, 1.5, 2.5, 3.5, 4.5]]
    t.stage_write(1, 0, [1.0])
    t.tensor = torch.zeros(2, 1, device=backend.device)  # shrunk: the staged write still fits it
    with pytest.raises(StagedWriteError, match="ends at column 2 past the row width 1"):
        t.stage_write(0, 0, [1.0, 2.0])  # staging checks the shape installed now
    writer.apply([t])
    assert host(t.tensor).tolist() == [[0.0], [1.0]] and host(grown)[1, 0] == 0.5


def test_growing_in_place_widens_the_checks_and_the_writes_land_in_the_new_storage(backend):
    t = StagedWriteTensor((4, 16), torch.int32, backend.device, name="grown")
    t.stage_write(3, 15, [1])
    FusedStagedWriter(backend.device, backend.name).apply([t])
    t.tensor.resize_(4, 32)  # new storage; the old cells keep their linear places
    t.tensor.zero_()
    t.stage_write(0, 20, [7, 8])  # past the old width, inside the new one
    t.stage_write(3, 31, [9])
    FusedStagedWriter(backend.device, backend.name).apply([t])
    got = host(t.tensor)
    assert got[0, 20:22].tolist() == [7, 8] and got[3, 31] == 9 and got.sum() == 24


@pytest.mark.parametrize("applied_before", [False, True], ids=["first-apply", "after-an-apply"])
def test_a_table_shrunk_in_place_is_refused_at_apply_with_every_write_kept(applied_before):
    writer = FusedStagedWriter("cpu", CPU)
    t = StagedWriteTensor((4, 8), torch.int32, name="shrunk")
    if applied_before:
        t.stage_write(0, 0, [1])
        writer.apply([t])
    t.stage_write(3, 0, [7] * 4)
    t.tensor.resize_(2, 4)  # behind the library's back
    t.stage_write(0, 1, [5])  # fits the new shape (staging checks it); the write above no longer does
    with pytest.raises(StagedWriteError, match=r"shrunk \(shape \(2, 4\), int32\): write at row 3, start 0, length 4: "
                                               r"staged before the table was resized, does not fit shape \(2, 4\); "
                                               "nothing was written and every staged write stays staged"):  # fmt: skip
        writer.apply([t])
    assert t.num_staged_writes == 2
    assert host(t.tensor).tolist() == [[int(applied_before), 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(StagedWriteError, match="does not fit shape"):  # refused again, not forgotten
        writer.apply([t])
    t.clear_staged_writes()
    t.stage_write(1, 3, [6])
    writer.apply([t])
    assert host(t.tensor).tolist() == [[int(applied_before), 0, 0, 0], [0, 0, 0, 6]]
