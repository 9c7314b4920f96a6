"""The compiled entry's `apply` (`_cstaging.StageEntry.apply`), white-box, off a GPU: an eager
`apply_staged_writes` (vLLM's call) launched in one C call, the apply kernel on the arena's ring slot with the
hand-over and the landing around it. Checked against a twin whose calls take the one Python path (`EagerMode.apply`
-> `TritonPlan.apply` -> `StagingArena.land_after` -> `TritonDevice.launch_apply`): the same variant, grid and
arguments (addresses named by what they are), tables and ring state after every step; what it does not take is the
Python path's, with nothing done; failures and interrupts as there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BackendError, StagedWriteError
from multiwrite.staging.fields import _cstaging
from tests.support.stage_entry import (
    big_pair,
    entry_tables,
    new_entry,
    pair,
    ring_state,
    run_both,
    same_tables,
    stage_appends,
    stage_whole_rows,
    staged_pair,
)

pytestmark = pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")


def apply_both(monkeypatch, bt, twin, stand_in) -> tuple | None:
    """`apply_staged_writes()` on `bt` (the entry's when it takes it) and on `twin` (the Python path's): equal tables
    and ring state required; the entry's launch (variant, grid0, grid1, args with addresses named) after checking it
    against the twin's, or None when the entry did not take the call."""
    return run_both(monkeypatch, bt, twin, stand_in.apply, lambda t: t.apply_staged_writes())[2]


def test_apply_launches_what_the_python_path_launches_for_every_step(monkeypatch):
    """80 random steps of appends and `apply_staged_writes()` (decode-sized batches: one program); overlapping writes
    every fifth (the Python path's on both) and nothing staged every seventh (nothing launched)."""
    bt, twin, stand_in = pair(monkeypatch)
    rng = np.random.default_rng(23)
    taken = {True: 0, False: 0}
    for i in range(80):
        overlap, empty = i % 5 == 4, i % 7 == 6
        if not empty:
            stage_appends([bt, twin], rng, overlap, overwrites=0.7)
        staged, overlapping = bt._mode.arena.num_writes, bt._mode.arena.may_overlap
        bt._mode._countdown.restart()
        launch = apply_both(monkeypatch, bt, twin, stand_in)
        assert (launch is not None) == bool(staged and not overlapping), i
        taken[launch is not None] += 1
        if launch is not None:
            (char, is_decode), grid0, grid1, args = launch
            assert args[:7] == ("descriptors", "meta", "values", "bounds", launch[3][4], "done", args[6])
            assert args[7:] == (len(bt.block_tables) + 1, staged, args[9], 1) and char == np.dtype(np.int32).char
            assert is_decode and args[9] <= 256 and grid1 == 1
    assert taken[True] >= 45 and taken[False] >= 15
    assert stand_in.apply.launches == taken[True] + 1  # (and `pair`'s apply of the full rows)


def test_a_large_batch_is_tiled_as_the_python_path_tiles_it(monkeypatch):
    """More values than the kernel preloads: tiles of writes and column splits (bounded by the device's programs) as
    `TritonDevice.launch_apply` computes them."""
    bt, twin, stand_in = big_pair(monkeypatch)
    rng = np.random.default_rng(4)
    for rows in (range(12), range(2), range(12)):
        stage_whole_rows([bt, twin], rows, rng)
        w, v = bt._mode.arena.num_writes, bt._mode.arena.num_values
        (_, decode), grid0, grid1, _ = apply_both(monkeypatch, bt, twin, stand_in)
        p = bt._mode.plan.device.params
        assert not decode and v > 256 and grid0 == -(-w // p.block_w), (w, v)
        assert grid1 == max(1, min(-(-v // p.block_l), p.max_splits, bt._mode.plan.device.max_programs // grid0))
    assert stand_in.apply.launches == 3 and len(stand_in.apply.calls) == 3
    for second, decode in ((30, True), (31, False)):  # (256 values: the kernel preloads them all; 257: it does not)
        for t in (bt, twin):
            t.append_block_ids(0, [[1] * 64, [2] * 32, [3] * 64], True)
            t.append_block_ids(1, [[4] * 60, [5] * second, []], True)
        assert bt._mode.arena.num_values == 226 + second
        assert apply_both(monkeypatch, bt, twin, stand_in)[0][1] == decode


@pytest.fixture
def staged(monkeypatch):
    return staged_pair(monkeypatch)


def test_what_apply_does_not_take_is_the_python_paths_with_nothing_done(staged):
    """A busy next slot, a capture under way, an unbound variant, another current device, a due address check: None
    from the entry and nothing changed; the Python path then applies (or raises) as before."""
    bt, twin, stand_in = staged
    ring, before, calls = bt._mode.arena.lender, ring_state(bt), len(stand_in.apply.calls)
    nxt = ring.leases[ring.next]
    ring.done[nxt.slot] = nxt.token - 1
    assert bt._mode.entry.apply() is None
    ring.done[nxt.slot] = nxt.token
    assert new_entry(bt, stand_in, is_capturing=lambda: True).apply() is None
    fire = dict(stand_in.apply.fire)
    stand_in.apply.fire.clear()
    assert bt._mode.entry.apply() is None
    stand_in.apply.fire.update(fire)
    mode = bt._mode
    assert new_entry(bt, stand_in, get_device=lambda: 0).apply() is None
    while mode._countdown.left > 1:  # (the address check due at the next call: each truth test counts one)
        bool(mode._countdown)
    assert mode.entry.apply() is None
    assert len(stand_in.apply.calls) == calls and ring_state(bt) == before
    bt.apply_staged_writes()  # (the Python path: it checks the addresses and applies)
    twin.apply_staged_writes()
    assert len(stand_in.apply.calls) == calls and same_tables(bt, twin) and ring_state(bt) == ring_state(twin)


def test_a_table_resized_in_place_is_refused_by_the_python_path(staged):
    """The tables' guard moved: the entry leaves the call to the Python path, whose guard names the table; nothing is
    applied and the writes stay staged. (The outputs' guard is not the apply's: a resized output does not stop it.)"""
    bt, twin, stand_in = staged
    calls = len(stand_in.apply.calls)
    bt.input_block_tables[0].resize_(2, 2)
    assert bt._mode.entry.apply() is True and len(stand_in.apply.calls) == calls + 1  # (an output: not the apply's)
    twin.apply_staged_writes()
    assert same_tables(bt, twin)
    stage_appends([bt, twin], np.random.default_rng(9), False)
    bt.block_tables[0].tensor.resize_(2, 2)
    calls, writes = len(stand_in.apply.calls), bt._mode.arena.num_writes
    with pytest.raises(StagedWriteError, match="resized|set_"):
        bt.apply_staged_writes()
    assert len(stand_in.apply.calls) == calls and bt._mode.arena.num_writes == writes


def test_a_failed_apply_leaves_every_write_staged_and_the_slot_free(staged):
    bt, twin, stand_in = staged
    arena = bt._mode.arena
    writes, lease, nxt, launches = arena.num_writes, arena.lease, arena.lender.next, arena.lease.launches
    stand_in.apply.fails = RuntimeError("launch failed")
    with pytest.raises(BackendError, match="triton-cuda") as info:
        bt.apply_staged_writes()
    assert info.value.__cause__ is stand_in.apply.fails
    assert (arena.num_writes, arena.lease, arena.lender.next, lease.launches) == (writes, lease, nxt, launches)
    assert lease.released()
    stand_in.apply.fails = None
    bt.apply_staged_writes()
    twin.apply_staged_writes()
    assert same_tables(bt, twin) and ring_state(bt, tokens=False) == ring_state(twin, tokens=False)


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupted_apply_lands_exactly_when_its_kernel_ran(staged, when):
    bt, twin, stand_in = staged
    arena = bt._mode.arena
    lease, launches, writes = arena.lease, arena.lease.launches, arena.num_writes
    setattr(stand_in.apply, "fails" if when == "before" else "fails_after", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bt.apply_staged_writes()
    stand_in.apply.fails = stand_in.apply.fails_after = None
    assert lease.released()
    if when == "before":
        assert (arena.num_writes, arena.lease, lease.launches) == (writes, lease, launches)
        bt.apply_staged_writes()
    else:
        assert arena.num_writes == 0 and arena.lease is not lease and lease.launches == launches + 1
    twin.apply_staged_writes()
    assert same_tables(bt, twin) and ring_state(bt, tokens=False) == ring_state(twin, tokens=False)


def test_vllms_apply_goes_through_the_entry(monkeypatch):
    """`multiwrite.vllm.BlockTables.apply_staged_writes()` (vLLM's call) is the core's: its launch is the entry's."""
    from multiwrite.vllm import BlockTables as VllmBlockTables

    tables, stand_in = entry_tables(monkeypatch, [16, 32], 4, 64, [8, 4], torch.device("cpu"), make=VllmBlockTables)
    tables.append_block_ids(1, [[5, 6], [7]], True)
    tables.apply_staged_writes()
    assert len(stand_in.apply.calls) == 1
    assert tables.block_tables[0].gpu[1, :2].tolist() == [5, 6] and tables.num_blocks.gpu[:, 1].tolist() == [2, 1]
