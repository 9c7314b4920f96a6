"""`BlockTables.append_block_ids` and `append_block_ids_batch` through the public API, on both staging paths (the
`staging` fixture): what a call accepts, every refusal (naming request, group, capacity and the value given) with
nothing of the call staged, the signature, and the batch: the same as its calls, its own refusals, a failing call
named by its position with the calls before it kept.

Staging does not depend on the backend: these tables apply with `torch-cpu` (the matrix of backends runs the
replay in `test_block_tables.py` and the conformance kit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, StagedWriteError
from multiwrite.testing.staging import block_tables_class
from tests.support.backends import RecordingBackend
from tests.support.tables import CPU, host

BOOLS = [True, np.bool_(True), torch.tensor(True), np.array(True)]


def tables(staging: str, backend=CPU) -> BlockTables:
    """Three groups: 4 blocks of 1 kernel block, 4 blocks of 2, 4 blocks of 1; four request rows."""
    return block_tables_class(staging)([16, 32, 8], 4, [4, 4, 4], "cpu", [16, 16, 8], backend=backend)


def staged_counts(bt: BlockTables) -> list[int]:
    return [t.num_staged_writes for t in bt.block_tables]


# -- refusals -------------------------------------------------------------------------------------------------
REFUSED = [
    # (request row, new_block_ids, overwrite, what the message says)
    (0, ([1], [2]), False, "append_block_ids: request row 0: got block ids for 2 KV-cache groups, the tables have 3"),
    (4, ([1], [2], [3]), False, "append_block_ids: request row 4 is outside [0, 4) (tables of shape (4, ...))"),
    (-1, ([1], [2], [3]), True, "append_block_ids: request row -1 is outside [0, 4)"),
    (1.5, ([1], [2], [3]), False, "append_block_ids: request row 1.5 is not an integer"),
    ("1", ([1], [2], [3]), False, "append_block_ids: request row '1' is not an integer"),
    *[(flag, ([1], [2], [3]), True, "append_block_ids: request row ") for flag in BOOLS],
    # row 0 holds 1 block of group 1 (2 kernel blocks): 4 more of 2 kernel blocks end at column 10 of 8
    (0, ([1], [2, 3, 4, 5], [3]), False, "group 1 (shape (4, 8), int32): write at row 0, start 2, length 4: 4 block "
                                         "ids x 2 kernel blocks end at column 10, past the row width 8 (room for 4 "
                                         "blocks)"),
    (0, ([1, 2, 3, 4, 5], [], []), True, "group 0 (shape (4, 4), int32): write at row 0, start 0, length 5: 5 block "
                                         "ids x 1 kernel blocks end at column 5, past the row width 4 (room for 4 "
                                         "blocks)"),
    (0, ([1], [2], [-3]), False, "group 2 (shape (4, 4), int32): write at row 0, start 1, length 1: block id -3 is "
                                 "negative"),
    (0, ([1], [2**30], [3]), False, "block id 1073741824 is too large: its 2 kernel block ids overflow int32"),
    (0, ([2**31], [2], [3]), True, "block id 2147483648 is too large: it does not fit int32"),
    (0, ([1], [10**400], []), True, "group 1"),
    (0, ([1], [2], [3.0]), False, "a float value cannot go into an integer table (int32)"),
    (0, ([1], [2], [float("nan")]), True, "cannot go into an integer table"),
    (0, ([1], [2], np.array([1.5])), True, "values of dtype float64 cannot go into an integer table (int32)"),
    (0, ([1], [2], np.array([2**40])), True, "group 2"),
    (0, ([True], [2], [3]), True, "a bool block id: stage integers, not bools"),
    (0, ([1], [2], [np.bool_(True)]), True, "bool"),
    (0, (list(range(1, 4)) + [False], [], []), True, "bool"),
    (0, ([1], ["2"], []), True, "group 1"),
    (0, ([1], [None], []), True, "group 1"),
    (0, ([1], 7, []), True, "group 1 (shape (4, 8), int32): write at row 0, start 0: the block ids of group 1 must be "
                            "a sequence, got int"),
    (1, 5, True, "append_block_ids: request row 1: new_block_ids must be one sequence of block ids per KV-cache group, "
                 "got int"),
    (1, None, True, "new_block_ids must be one sequence of block ids per KV-cache group, got NoneType"),
    (1, {0: [1], 1: [2], 2: [3]}, True, "got a dict (a dict is not a sequence of per-group lists: pass [ids of group "
                                        "0, ids of group 1, ...])"),
    *[(0, ([3], [4], []), bad, f"append_block_ids: request row 0: overwrite must be a bool (True: a new request from "
                               f"column 0, False: append after the row's blocks), got {bad!r}")
      for bad in ["no", None, 1, 0.0, "False"]],
]  # fmt: skip


@pytest.mark.parametrize(("req", "ids", "overwrite", "fragment"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_a_refused_call_says_why_and_stages_nothing(staging, req, ids, overwrite, fragment):
    bt = tables(staging)
    bt.append_block_ids(0, ([9], [8], [7]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([5], [6], []), overwrite=True)
    before = bt.num_blocks.copy()
    with pytest.raises(StagedWriteError) as info:
        bt.append_block_ids(req, ids, overwrite)
    assert fragment in str(info.value)
    assert "-1" not in str(info.value) or "-1" in repr((req, ids))  # only values the caller gave
    np.testing.assert_array_equal(bt.num_blocks, before)
    assert staged_counts(bt) == [1, 1, 1]  # row 1's overwrite (every group) and nothing more
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[:2, 0].tolist() == [9, 5]
    assert host(bt[1].tensor)[:2, :2].tolist() == [[16, 17], [12, 13]]
    assert host(bt[2].tensor)[:2, 0].tolist() == [7, 0]
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[1, 1], [2, 2], [1, 0]]


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((1, [[1], [2], [3]], True), {"extra": 1}, "extra"),
        ((1, [[1], [2], [3]], True, 4), {}, "positional"),
        ((1, [[1], [2], [3]]), {}, "overwrite"),
        ((1, [[1], [2], [3]]), {"req_index": 1, "overwrite": True}, "req_index"),
        ((), {"req_index": 1, "new_block_ids": [[1], [2], [3]]}, "overwrite"),
    ],
)
def test_the_signature_is_the_documented_one(staging, args, kwargs, words):
    bt = tables(staging)
    bt.append_block_ids(2, [[9], [8], [7]], True)
    with pytest.raises(TypeError, match=words):
        bt.append_block_ids(*args, **kwargs)
    assert staged_counts(bt) == [1, 1, 1] and bt.num_blocks[:, 1].tolist() == [0, 0, 0]
    bt.append_block_ids(overwrite=True, new_block_ids=[[1], [2], [3]], req_index=1)  # every keyword, any order
    bt.append_block_ids(3, new_block_ids=[[4], [], []], overwrite=False)
    assert bt.num_blocks[:, 1:].T.tolist() == [[1, 2, 1], [1, 2, 1], [1, 0, 0]]


# -- what is accepted -----------------------------------------------------------------------------------------
def test_any_sequence_or_iterable_of_integers_is_accepted(staging):
    bt = block_tables_class(staging)([16, 64], 4, [4, 4], "cpu", [16, 16], backend=CPU)  # group 1: 4 kernel blocks
    bt.append_block_ids(0, (ids for ids in ([1], [2])), True)  # a generator of the groups
    bt.append_block_ids(1, ((2, 3), np.array([np.uint8(250)], dtype=np.uint8)), np.bool_(True))
    bt.append_block_ids(2, [np.array([4, 5], dtype=np.int32), [np.int64(6)]], True)
    bt.append_block_ids(3, [[], torch.tensor([7], dtype=torch.int16)], True)
    bt.append_block_ids(1, [[np.uint8(4)], []], np.bool_(False))  # numpy scalars, expanded without wrapping
    bt.apply_staged_writes()
    assert host(bt[0].tensor).tolist() == [[1, 0, 0, 0], [2, 3, 4, 0], [4, 5, 0, 0], [0, 0, 0, 0]]
    assert host(bt[1].tensor)[:, :4].tolist() == [[8, 9, 10, 11], [1000, 1001, 1002, 1003], [24, 25, 26, 27],
                                                  [28, 29, 30, 31]]  # fmt: skip
    assert bt.num_blocks.tolist() == host(bt.num_blocks_device).tolist() == [[1, 3, 2, 0], [4, 4, 4, 4]]


def test_a_subclass_that_overrides_append_block_ids_is_called_by_the_batch_too(staging):
    seen = []

    class Logged(block_tables_class(staging)):
        def append_block_ids(self, req_index, new_block_ids, overwrite):
            seen.append(req_index)
            super().append_block_ids(req_index, new_block_ids, overwrite)

    bt = Logged([16, 32, 8], 8, [6, 5, 7], "cpu", [16, 16, 8], backend=CPU)
    bt.append_block_ids(3, [[1], [2], [3]], True)
    bt.append_block_ids_batch([4, 5], [[[1], [], []], [[2], [3], [4]]], True)
    assert bt.num_blocks[:, 3].tolist() == [1, 2, 1] and bt.num_blocks[:, 5].tolist() == [1, 2, 1]
    assert seen == [3, 4, 5]


# -- append_block_ids_batch -----------------------------------------------------------------------------------
CALLS = [
    (0, [[1, 2], [3], []], True),
    (1, [[4], [], [5, 6]], True),
    (0, [[7], [8], [9]], False),
    (2, [[], [], []], True),
    (1, [[], [10], []], False),
    (3, [[11], [12, 13], [14]], True),
    (0, [[15], [], []], True),  # row 0 again in the same step: an overlap, the last call wins
]


@pytest.mark.parametrize("flags", ["per-call-list", "tuple-of-numpy-bools", "one-bool"])
def test_a_batch_stages_exactly_what_its_calls_stage(staging, flags):
    calls = [(r, ids, True) for r, ids, _ in CALLS] if flags == "one-bool" else CALLS
    overwrite = {
        "per-call-list": [o for _, _, o in CALLS],
        "tuple-of-numpy-bools": tuple(np.bool_(o) for _, _, o in CALLS),
        "one-bool": True,
    }[flags]
    batched, one_by_one = tables(staging, RecordingBackend()), tables(staging, RecordingBackend())
    batched.append_block_ids_batch([r for r, _, _ in CALLS], [ids for _, ids, _ in CALLS], overwrite)
    for call in calls:
        one_by_one.append_block_ids(*call)
    assert batched.num_blocks.tolist() == one_by_one.num_blocks.tolist()
    batched.apply_staged_writes()
    one_by_one.apply_staged_writes()
    got, want = batched.backend.last, one_by_one.backend.last
    assert (got.meta.tolist(), got.values.tolist(), got.may_overlap) == (want.meta.tolist(), want.values.tolist(),
                                                                         want.may_overlap)  # fmt: skip
    assert got.may_overlap is True
    for a, b in zip(batched.block_tables, one_by_one.block_tables):
        assert host(a.tensor).tolist() == host(b.tensor).tolist()


def test_a_batch_with_a_refused_call_keeps_the_calls_before_it_and_makes_none_after(staging):
    bt = tables(staging)
    good = [[1], [2], [3]]
    with pytest.raises(StagedWriteError) as info:
        bt.append_block_ids_batch([0, 1, 4, 2], [good, good, good, good], True)
    message, cause = str(info.value), info.value.__cause__
    assert message.startswith(
        "append_block_ids_batch: call 2 of 4 (request row 4) failed; the 2 calls before it stay staged, it and the "
        "calls after it were not staged: append_block_ids: request row 4 is outside [0, 4)"
    )
    assert isinstance(cause, StagedWriteError) and message.endswith(str(cause))
    assert bt.num_blocks[:, :3].T.tolist() == [[1, 2, 1], [1, 2, 1], [0, 0, 0]]
    assert staged_counts(bt) == [2, 2, 2]
    bt.apply_staged_writes()
    assert host(bt[1].tensor)[:3, :2].tolist() == [[4, 5], [4, 5], [0, 0]]


class OddRow(ValueError):
    """An error of the caller's own type, raised by a request row's `__index__`."""


class TwoArgsRow(ValueError):
    """An error type that cannot be built from a message alone."""

    def __init__(self, a, b):
        super().__init__(a, b)


class Raising:
    def __init__(self, error: BaseException):
        self.error = error

    def __index__(self) -> int:
        raise self.error


def test_a_failing_call_of_a_batch_keeps_the_type_of_its_error(staging):
    bt = tables(staging)
    good = [[1], [2], [3]]
    original = OddRow("not today")
    with pytest.raises(OddRow) as info:
        bt.append_block_ids_batch([0, Raising(original), 2], [good] * 3, True)
    assert str(info.value).startswith("append_block_ids_batch: call 1 of 3 (request row <")  # the row's repr
    assert str(info.value).endswith("failed; the 1 calls before it stay staged, it and the calls after it were not "
                                    "staged: not today")  # fmt: skip
    assert info.value.__cause__ is original and staged_counts(bt) == [1, 1, 1]
    odd = TwoArgsRow("a", "b")
    with pytest.raises(TwoArgsRow) as info:  # raised as it is
        bt.append_block_ids_batch([Raising(odd)], [good], True)
    assert info.value is odd and odd.__cause__ is None  # (never its own cause)
    unexpected = RuntimeError("a bug of the row's type")
    with pytest.raises(RuntimeError) as info:  # not an input error: raised as it is, not caused by itself
        bt.append_block_ids_batch([Raising(unexpected)], [good], True)
    assert info.value is unexpected and unexpected.__cause__ is None
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as info:  # not an input error: passes through as it is
        bt.append_block_ids_batch([1, Raising(interrupt)], [good, good], True)
    assert info.value is interrupt and staged_counts(bt) == [2, 2, 2] and bt.num_blocks[:, 1].tolist() == [1, 2, 1]


@pytest.mark.parametrize(
    ("reqs", "ids", "overwrite", "words"),
    [
        ([0, 1], [[[1], [2], [3]]], True, "append_block_ids_batch: 2 request rows, 1 lists of block ids: one of each "
                                          "per call; nothing was staged"),
        ([0], [[[1], [2], [3]]], [True, False], "1 request rows, 1 lists of block ids and 2 overwrite flags"),
        ([0], [[[1], [2], [3]]], "yes", "append_block_ids_batch: overwrite must be a bool or one bool per call, got "
                                        "'yes' (str)"),
        ([0], [[[1], [2], [3]]], None, "overwrite must be a bool or one bool per call, got None (NoneType)"),
    ],
)  # fmt: skip
def test_a_batch_whose_lists_disagree_is_refused_before_anything_is_staged(staging, reqs, ids, overwrite, words):
    bt = tables(staging)
    with pytest.raises(StagedWriteError) as info:
        bt.append_block_ids_batch(reqs, ids, overwrite)
    assert words in str(info.value)
    assert staged_counts(bt) == [0, 0, 0] and not bt.num_blocks.any()


def test_a_batch_takes_any_sequences_and_its_documented_keywords(staging):
    bt = tables(staging)
    bt.append_block_ids_batch(np.array([3, 2]), ([[1], [2], [3]], [[4], [5], [6]]), [True, np.bool_(True)])
    bt.append_block_ids_batch(overwrite=False, new_block_ids=[[[7], [], []]], req_indices=(3,))
    bt.append_block_ids_batch([], [], True)  # no call: nothing
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        bt.append_block_ids_batch([1], [[[1], [2], [3]]], True, extra=1)
    assert bt.num_blocks[:, 2:].T.tolist() == [[1, 2, 1], [2, 2, 1]] and staged_counts(bt) == [3, 2, 2]
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[2:, :2].tolist() == [[4, 0], [1, 7]]
