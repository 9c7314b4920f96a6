"""The address check of `BlockTables` (docs/lifecycle.md): a table or output re-pointed to other memory with
`tensor.data = other` keeps its version counter, so only its `data_ptr()` shows it. With `check_addresses=True` (or
`$MULTIWRITE_CHECK_ADDRESSES` on) every call compares them first and refuses, naming the tensor and both addresses,
having staged, written and launched nothing; without, the check runs at every 64th call of the preamble, at
`refresh_layout` and in a writer's apply of the tables. The writes refused stay staged and land whole once the tensor
points back."""

from __future__ import annotations

import re

import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, TableMovedError
from multiwrite.tables.block_tables import CHECK_ADDRESSES_ENV
from multiwrite.tables.mode import ADDRESS_CHECK_PERIOD
from tests.support.tables import CPU, host

I32 = torch.int32

#: the tensors a caller can reach and re-point, and how the error names them
TENSORS = {
    "group 0": (lambda bt: bt[0].tensor, "group 0 of a BlockTables"),
    "group 1": (lambda bt: bt[1].tensor, "group 1 of a BlockTables"),
    "num_blocks_device": (lambda bt: bt.num_blocks_device, "num_blocks of a BlockTables"),
    "input_block_tables[1]": (lambda bt: bt.input_block_tables[1], "input_block_tables[1] of a BlockTables"),
    "slot_mappings": (lambda bt: bt.slot_mappings, "slot_mappings of a BlockTables"),
}


def _idx(bt):
    return torch.tensor([1, 0], dtype=I32, device=bt.device)


def _qsl(bt):
    return torch.tensor([0, 1, 2], dtype=I32, device=bt.device)


def _pos(bt):
    return torch.tensor([0, 17], device=bt.device)


#: every call through the preamble, and the name its refusal gives it
JOBS = {
    "apply_staged_writes": (lambda bt: bt.apply_staged_writes(), "BlockTables.apply_staged_writes"),
    "prepare_inputs": (lambda bt: bt.prepare_inputs(_idx(bt), _qsl(bt), _pos(bt), 2, 4), "BlockTables.prepare_inputs"),
    "gather_block_tables": (lambda bt: bt.gather_block_tables(_idx(bt), 2), "gather_block_tables"),
    "gather(apply_staged)": (lambda bt: bt.gather_block_tables(_idx(bt), 2, apply_staged=True),
                             "BlockTables.gather_block_tables(apply_staged=True)"),
    "compute_slot_mappings": (lambda bt: bt.compute_slot_mappings(_idx(bt), _qsl(bt), _pos(bt), 4),
                              "compute_slot_mappings"),
    "get_dummy_block_tables": (lambda bt: bt.get_dummy_block_tables(2), "BlockTables.get_dummy_block_tables"),
    "get_dummy_slot_mappings": (lambda bt: bt.get_dummy_slot_mappings(2), "BlockTables.get_dummy_slot_mappings"),
}  # fmt: skip

#: calls that apply nothing and read no staged counts
ROTATION = ("gather_block_tables", "get_dummy_block_tables", "get_dummy_slot_mappings")

# After row 1 ([5] / [6]) landed and row 0 ([1, 2] / [3]) was staged, group 1 with k = 2: the tables, and a
# prepare_inputs of batch (row 1, row 0) with one token each, at positions 0 and 17.
TABLE_0 = [[1, 2, 0, 0], [5, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
TABLE_1 = [[6, 7, 0, 0], [12, 13, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
GATHERED = ([[5, 0, 0, 0], [1, 2, 0, 0]], [[12, 13, 0, 0], [6, 7, 0, 0]])
SLOTS = [[5 * 16, 2 * 16 + 1, -1, -1], [12 * 16, 7 * 16 + 1, -1, -1]]


def tables(backend_name=CPU, device="cpu", **kw) -> BlockTables:
    """Two groups (block sizes 16 and 32 over kernel blocks of 16: widths 4 and 4), 4 rows, 4 tokens; row 1 landed,
    row 0 staged."""
    bt = BlockTables([16, 32], 4, [4, 2], device, [16, 16], backend=backend_name, max_num_batched_tokens=4, **kw)
    bt.append_block_ids(1, ([5], [6]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(0, ([1, 2], [3]), True)
    return bt


def repoint(t: torch.Tensor) -> torch.Tensor:
    """Point `t` at other memory of its shape (holding 7s); returns what points back."""
    saved = t.data
    t.data = torch.full_like(t, 7)
    return saved


def moved(call: str, what: str, old: int, new: int) -> str:
    return (rf"^{re.escape(call)}: {re.escape(what)} was re-pointed to other memory \(tensor.data = \.\.\. or the "
            rf"like\): its address was {old:#x} at construction and is {new:#x} now .* Nothing of this call was "
            "staged, written or recorded and every staged write stays staged")  # fmt: skip


def assert_untouched(bt: BlockTables) -> None:
    """Row 0's writes still staged, nothing of them anywhere, the outputs as built (zero, PAD)."""
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1] and bt.num_staged_writes == 3
    assert bt.num_blocks[:, :2].tolist() == [[2, 1], [2, 2]]
    assert host(bt[0].tensor).tolist()[:2] == [[0, 0, 0, 0], [5, 0, 0, 0]]
    assert host(bt[1].tensor).tolist()[:2] == [[0, 0, 0, 0], [12, 13, 0, 0]]
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[0, 1], [0, 2]]
    assert not any(host(t).any() for t in bt.input_block_tables) and (host(bt.slot_mappings) == -1).all()


def assert_landed_whole(bt: BlockTables) -> None:
    """One prepare_inputs lands row 0 and gathers and maps the batch (row 1, row 0)."""
    gathered, slots = JOBS["prepare_inputs"][0](bt)
    assert bt.num_staged_writes == 0
    assert host(bt[0].tensor).tolist() == TABLE_0 and host(bt[1].tensor).tolist() == TABLE_1
    assert host(bt.num_blocks_device)[:, :2].tolist() == [[2, 1], [2, 2]]
    assert [host(t).tolist() for t in gathered] == [*map(list, GATHERED)] and host(slots).tolist() == SLOTS


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(CHECK_ADDRESSES_ENV, raising=False)


@pytest.mark.parametrize("tensor", list(TENSORS))
def test_checking_on_refuses_a_re_pointed_tensor_before_anything_and_the_writes_land_once_it_points_back(
    backend, tensor
):
    bt = tables(backend.name, backend.device, check_addresses=True)
    assert bt.checks_addresses
    get, what = TENSORS[tensor]
    t = get(bt)
    old = t.data_ptr()
    saved = repoint(t)
    for job in ("prepare_inputs", "apply_staged_writes"):
        fn, call = JOBS[job]
        with pytest.raises(TableMovedError, match=moved(call, what, old, t.data_ptr())) as info:
            fn(bt)
        assert (info.value.what, info.value.old, info.value.new) == (what, old, t.data_ptr())
        assert (host(t) == 7).all()  # nothing went to the memory it shows either
    t.data = saved
    assert_untouched(bt)
    assert_landed_whole(bt)


@pytest.mark.parametrize("job", list(JOBS))
def test_every_call_through_the_preamble_checks_with_checking_on(job):
    bt = tables(check_addresses=True)
    t = bt.input_block_tables[1]
    old = t.data_ptr()
    saved = repoint(t)
    fn, call = JOBS[job]
    with pytest.raises(TableMovedError, match=moved(call, "input_block_tables[1] of a BlockTables", old,
                                                    t.data_ptr())):  # fmt: skip
        fn(bt)
    t.data = saved
    assert_untouched(bt)
    assert_landed_whole(bt)


def test_checking_off_finds_it_at_the_64th_call_then_at_every_call_until_it_points_back():
    assert ADDRESS_CHECK_PERIOD == 64  # (the figure docs/lifecycle.md gives)
    bt = tables()  # (its first apply was call 1)
    assert not bt.checks_addresses
    jobs = [fn for fn, _ in JOBS.values() if fn is not JOBS["apply_staged_writes"][0]]
    for _ in range(9):  # calls 2 .. 10: no re-pointing yet
        bt.get_dummy_slot_mappings(1)
    t = bt[0].tensor
    old = t.data_ptr()
    saved = repoint(t)
    calls = 10
    since = r"the writes of the calls since the last check \(up to 63.*may have gone to that old memory"
    with pytest.raises(TableMovedError, match=rf"group 0 of a BlockTables was re-pointed.*{since}"):
        while True:  # the calls that leave the staged writes staged, in turn (staging and clear are no calls of it)
            bt.append_block_ids(2, ([9], []), False)
            bt.clear_staged_writes()
            bt.append_block_ids(0, ([1, 2], [3]), True)
            JOBS[ROTATION[calls % len(ROTATION)]][0](bt)
            calls += 1
            if calls > 64:
                pytest.fail(f"no TableMovedError by call {calls}")
    assert calls + 1 == 64  # the 64th call raised
    for fn in jobs:  # and every call after it, until it points back
        with pytest.raises(TableMovedError, match=f"its address was {old:#x}"):
            fn(bt)
    t.data = saved
    assert_landed_whole(bt)  # (this call checked, and restarted the countdown)
    repoint(t)
    for _ in range(63):
        bt.get_dummy_block_tables(1)
    with pytest.raises(TableMovedError):
        bt.get_dummy_block_tables(1)  # 64 calls after the last check


@pytest.mark.parametrize("value", ["1", "true", " Yes ", "ON"])
def test_the_environment_variable_turns_checking_on_for_tables_built_while_it_is_on(monkeypatch, value):
    monkeypatch.setenv(CHECK_ADDRESSES_ENV, value)
    bt = tables()
    monkeypatch.delenv(CHECK_ADDRESSES_ENV)  # (read once, at construction)
    assert bt.checks_addresses
    saved = repoint(bt.slot_mappings)
    with pytest.raises(TableMovedError, match="slot_mappings of a BlockTables was re-pointed.*every call before this "
                                              "one was checked"):  # fmt: skip
        bt.gather_block_tables(_idx(bt), 2)
    bt.slot_mappings.data = saved
    assert_landed_whole(bt)


@pytest.mark.parametrize("value", ["0", "false", "no", "Off", ""])
def test_the_environment_variable_off_leaves_checking_to_the_argument(monkeypatch, value):
    monkeypatch.setenv(CHECK_ADDRESSES_ENV, value)
    off, on = tables(), tables(check_addresses=True)
    assert (off.checks_addresses, on.checks_addresses) == (False, True)
    for bt in (off, on):
        repoint(bt.num_blocks_device)
    off.get_dummy_block_tables(1)  # (call 2 of 64: not checked)
    with pytest.raises(TableMovedError, match="num_blocks of a BlockTables"):
        on.get_dummy_block_tables(1)


def test_an_unparseable_environment_variable_is_refused_at_construction(monkeypatch):
    monkeypatch.setenv(CHECK_ADDRESSES_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"^MULTIWRITE_CHECK_ADDRESSES='sometimes' is neither on \(1, true, yes, "
                                         r"on\) nor off \(0, false, no, off or empty\), case-insensitive; multiwrite "
                                         "does not guess whether BlockTables check their addresses at every "
                                         "call$"):  # fmt: skip
        BlockTables([16], 2, [4], "cpu", check_addresses=True)


def test_refresh_layout_checks_whatever_the_setting(backend):
    bt = tables(backend.name, backend.device)
    t = bt[1].tensor
    old = t.data_ptr()
    saved = repoint(t)
    with pytest.raises(TableMovedError, match=moved("BlockTables.refresh_layout", "group 1 of a BlockTables", old,
                                                    t.data_ptr())):  # fmt: skip
        bt.refresh_layout()
    t.data = saved
    bt.refresh_layout()
    assert_untouched(bt)
    assert_landed_whole(bt)


def test_a_writer_applying_the_tables_checks_them_whatever_the_setting():
    bt = tables()
    saved = repoint(bt[0].tensor)
    with pytest.raises(TableMovedError, match=r"^FusedStagedWriter.apply: group 0 of a BlockTables was re-pointed"):
        FusedStagedWriter("cpu", CPU).apply([bt[1]])
    bt[0].tensor.data = saved
    assert_untouched(bt)
    FusedStagedWriter("cpu", CPU).apply([bt[1]])
    assert host(bt[1].tensor).tolist() == TABLE_1 and host(bt[0].tensor).tolist()[0] == [0, 0, 0, 0]


def test_without_checking_a_write_through_a_re_pointed_table_is_found_by_the_next_call_as_a_move():
    """A torch write through the re-pointed tensor bumps the version counter the tables share: the layout check of the
    next call finds the tensor moved (a CPU backend's apply, written with torch ops, does the same)."""
    bt = tables()
    t = bt[0].tensor
    saved = repoint(t)
    t[0, 0] = 3
    with pytest.raises(StagedWriteError, match=r"^group 0 of a BlockTables was resized in place \(moved to other "
                                               r"memory \(set_, a storage resize, or tensor.data = \.\.\. and a "
                                               r"write\)\)"):  # fmt: skip
        bt.apply_staged_writes()
    t.data = saved
    assert_untouched(bt)
    assert_landed_whole(bt)
