"""The compiled entry's `prepare` (`_cstaging.StageEntry.prepare`, `multiwrite.stage.entry`), white-box, off a GPU: an
eager `prepare_inputs` with a staged batch, launched in one C call with the slot's hand-over and the landing around
it. Checked against a twin whose calls all take the one Python path (`TablesMode.stage_call` -> `TritonPlan.prepare`
-> `StagingArena.land_after`): the same variant key, grid and arguments (addresses named by what they are), the same
tables, outputs and ring state after every step; every precondition sends the call to the Python path with nothing
done; a failed launch leaves every write staged and the slot free; an interrupt lands the batch exactly when its
kernel ran."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from multiwrite import BackendError, BlockTables
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.staging.fields import _cstaging
from tests.support.stage_entry import (
    I32,
    I64,
    big_pair,
    engine_steps,
    new_entry,
    pair,
    ring_state,
    run_both,
    same_results,
    same_tables,
    stage_appends,
    stage_whole_rows,
    staged_pair,
)

pytestmark = pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")

def prepare_both(monkeypatch, bt: BlockTables, twin: BlockTables, stand_in, step: tuple) -> tuple | None:
    """`prepare_inputs(*step)` on `bt` (the entry's when it takes it) and on `twin` (the Python path's): equal results,
    tables and ring state required. Returns the entry's launch (key, grid0, grid1, args), the args' addresses named,
    after checking it against the twin's launch and the views returned; None when the entry did not take the call."""
    idx, qsl, pos, padded, tokens, pad, nct = step
    got, want, launch = run_both(monkeypatch, bt, twin, stand_in, lambda t: t.prepare_inputs(*step))
    assert same_results(got, want)
    if launch is None:
        return None
    views = [(t[:padded].data_ptr(), t[:padded].shape) for t in bt.input_block_tables]
    assert [(v.data_ptr(), v.shape) for v in got[0]] == views
    view = bt.slot_mappings[:, :tokens]
    assert (got[1].data_ptr(), got[1].shape) == (view.data_ptr(), view.shape)
    return launch


def test_prepare_launches_what_the_python_path_launches_for_every_step(monkeypatch):
    """80 random steps of appends and a `prepare_inputs` on tables whose calls take the entry and on a twin whose
    calls take the Python path: the same launch (key, grid, every argument, addresses by name), results, tables and
    ring state (slot landed on, the ring's next slot, every slot's token and launch count). Steps with overlapping
    writes are the Python path's on both."""
    bt, twin, stand_in = pair(monkeypatch)
    rng = np.random.default_rng(11)
    launched = {True: 0, False: 0}
    for i, (idx, padded, nct, qsl, pos, tokens, pad) in enumerate(engine_steps(rng, 80)):
        overlap = i % 5 == 4
        if i % 7 != 6:  # (else nothing staged: the stage alone, with gather and slots)
            stage_appends([bt, twin], rng, overlap)
        staged = bt._mode.arena.num_writes
        assert bool(bt._mode.arena.may_overlap) == (overlap and staged > 0)
        bt._mode._countdown.restart()
        launch = prepare_both(monkeypatch, bt, twin, stand_in, (idx, qsl, pos, padded, tokens, pad, nct))
        assert (launch is not None) == (not (overlap and staged)), i
        launched[launch is not None] += 1
        if launch is not None:  # (has_writes, and the lease's memory in the arguments, exactly when staged)
            assert (launch[0][6], launch[3][1] == "meta") == (staged > 0, staged > 0), i
    assert launched[True] >= 60 and launched[False] >= 10
    plan, ring = bt._mode.plan, bt._mode.arena.lender
    assert all(lease.keep is plan.desc for lease in ring.leases if lease.launches)


def test_a_batch_of_many_writes_and_values_is_tiled_as_the_python_path_tiles_it(monkeypatch):
    """More writes than one apply tile holds and more values than the kernel preloads: the apply programs' tiles and
    column splits (bounded by the device's programs) as the Python path computes them."""
    bt, twin, stand_in = big_pair(monkeypatch)
    rng = np.random.default_rng(2)
    for rows in (range(12), range(3), range(12)):
        stage_whole_rows([bt, twin], rows, rng)
        w, v = bt._mode.arena.num_writes, bt._mode.arena.num_values
        step = (torch.tensor([4, 0, 7], dtype=I32), torch.tensor([0, 2, 3, 5], dtype=I32),
                torch.tensor([5, 6, 1, 500, 3]), 3, 6, None, None)  # fmt: skip
        launch = prepare_both(monkeypatch, bt, twin, stand_in, step)
        tiles, programs = launch[3][10:12]
        assert tiles == -(-w // 32) and (programs > tiles) == (v > 256), (w, v, tiles, programs)
    assert stand_in.launches == 3


STEP = (torch.tensor([2, 0], dtype=I32), torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 6, 1]), 2, 4, None,
        None)  # fmt: skip


@pytest.fixture
def staged(monkeypatch):
    return staged_pair(monkeypatch)


def test_a_busy_next_slot_a_capture_or_no_staged_spec_is_the_python_paths(staged):
    """The ring's next slot still read by a launch (the Python path waits for it), a capture under way on the current
    stream (the Python path refuses the call), a spec without its staged part: None, nothing changed."""
    bt, twin, stand_in = staged
    ring = bt._mode.arena.lender
    before = ring_state(bt)
    nxt = ring.leases[ring.next]
    ring.done[nxt.slot] = nxt.token - 1  # (its word does not hold its token yet: busy)
    assert bt._mode.entry.prepare(*STEP) is None
    ring.done[nxt.slot] = nxt.token
    assert new_entry(bt, stand_in, is_capturing=lambda: True).prepare(*STEP) is None
    assert new_entry(bt, stand_in, staged=False).prepare(*STEP) is None
    assert stand_in.calls == [] and ring_state(bt) == before
    with pytest.raises(RuntimeError, match="no CUDA"):  # (the capture test's own error, as the preamble raises it)
        new_entry(bt, stand_in, is_capturing=_broken).prepare(*STEP)
    assert stand_in.calls == [] and ring_state(bt) == before
    assert same_results(bt.prepare_inputs(*STEP), twin.prepare_inputs(*STEP)) and len(stand_in.calls) == 1


def _broken():
    raise RuntimeError("no CUDA")


def test_the_arenas_own_slot_is_passed_by_as_the_python_path_passes_it(staged):
    """The ring one slot ahead (its next slot the arena's own, as an interrupted apply can leave it): the arena lands
    on the slot after, on both paths."""
    bt, twin, stand_in = staged
    for t in (bt, twin):
        t._mode.arena.lender.next = t._mode.arena.lease.slot
    own = bt._mode.arena.lease.slot
    assert same_results(bt.prepare_inputs(*STEP), twin.prepare_inputs(*STEP)) and len(stand_in.calls) == 1
    assert ring_state(bt) == ring_state(twin)
    assert bt._mode.arena.lease.slot not in (own, -1)


@pytest.mark.parametrize("fails", [RuntimeError("launch failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failed_launch_after_passing_the_arenas_own_slot_leaves_the_ring_as_the_python_path(staged, fails):
    """The ring one slot ahead and the launch failing before its kernel ran: the ring's next slot where the Python
    path leaves it (its release steps back over the second acquire only: the slot after the arena's own), the writes
    staged. (Found by review: the entry left it at the arena's own slot.)"""
    bt, twin, stand_in = staged
    for t in (bt, twin):
        t._mode.arena.lender.next = t._mode.arena.lease.slot
    stand_in.fails = fails
    raised = BackendError if isinstance(fails, Exception) else KeyboardInterrupt
    with pytest.raises(raised):
        bt.prepare_inputs(*STEP)
    raised = BackendError if isinstance(fails, Exception) else KeyboardInterrupt
    with failing_launches(fails), pytest.raises(raised):
        twin.prepare_inputs(*STEP)
    depth = len(bt._mode.arena.lender.leases)
    assert ring_state(bt) == ring_state(twin) and ring_state(bt)[1] == (bt._mode.arena.lease.slot + 1) % depth
    assert bt._mode.arena.num_writes == twin._mode.arena.num_writes > 0


@contextlib.contextmanager
def failing_launches(fails: BaseException):
    """Every `Launcher.launch` raises `fails` before launching (the Python path's launch failing)."""
    original = Launcher.launch

    def launch(self, *args, **kwargs):
        raise fails

    Launcher.launch = launch
    try:
        yield
    finally:
        Launcher.launch = original


def test_a_failed_launch_leaves_every_write_staged_and_the_slot_free(staged):
    """An `Exception` from the launch: the `BackendError` from it; the writes stay staged, the slot is free (its word
    holds its token), the ring's next slot unchanged; the next call applies them as the twin does."""
    bt, twin, stand_in = staged
    arena = bt._mode.arena
    writes, lease, nxt, launches = arena.num_writes, arena.lease, arena.lender.next, arena.lease.launches
    stand_in.fails = RuntimeError("launch failed")
    with pytest.raises(BackendError, match="triton-cuda") as info:
        bt.prepare_inputs(*STEP)
    assert info.value.__cause__ is stand_in.fails
    assert (arena.num_writes, arena.lease, arena.lender.next) == (writes, lease, nxt) and lease.released()
    assert lease.launches == launches  # (not counted: nothing was issued)
    stand_in.fails = None
    assert same_results(bt.prepare_inputs(*STEP), twin.prepare_inputs(*STEP)) and same_tables(bt, twin)
    assert ring_state(bt, tokens=False) == ring_state(twin, tokens=False)  # (the failed launch took a token)


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_lands_the_batch_exactly_when_its_kernel_ran(staged, when):
    """A `KeyboardInterrupt` around the launch, raised as it is: before the kernel was issued, the writes stay staged
    and the slot is free; after, the batch has landed (counted on its slot, the arena on the next one) and the
    tables hold it, as the twin's after its call; the dirty rows at the larger count either way."""
    bt, twin, stand_in = staged
    arena = bt._mode.arena
    lease, launches, writes = arena.lease, arena.lease.launches, arena.num_writes
    bt._mode.dirty_rows = 5
    setattr(stand_in, "fails" if when == "before" else "fails_after", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bt.prepare_inputs(*STEP)
    assert bt._mode.dirty_rows == 5 and lease.released()
    stand_in.fails = stand_in.fails_after = None
    if when == "before":
        assert (arena.num_writes, arena.lease, lease.launches) == (writes, lease, launches)
        assert same_results(bt.prepare_inputs(*STEP), twin.prepare_inputs(*STEP))
    else:
        assert arena.num_writes == 0 and arena.lease is not lease and lease.launches == launches + 1
        twin.prepare_inputs(*STEP)
    assert same_tables(bt, twin) and ring_state(bt, tokens=False) == ring_state(twin, tokens=False)


def test_a_spec_whose_staged_part_is_unusable_is_named(staged):
    bt, _, stand_in = staged
    with pytest.raises(TypeError, match="staged.stage_tiling must be a tuple of five positive ints"):
        new_entry(bt, stand_in, stage_tiling=(16, 16, 0, 64, 64))
    with pytest.raises(TypeError, match="staged.apply_tiling must be a tuple of five positive ints"):
        new_entry(bt, stand_in, apply_tiling=(16, 16, 256, 64))
    with pytest.raises(TypeError, match="staged.max_programs must be a positive int"):
        new_entry(bt, stand_in, max_programs=0)
    with pytest.raises(TypeError, match="ArenaFields arena"):
        new_entry(bt, stand_in, arena=object())


def test_prepare_with_int64_inputs_and_padding_through_the_entry(staged):
    """The variant of int64 inputs, an `is_padding` mask and `num_computed_tokens` on a window group: taken by the
    entry, equal to the twin's; the slot handed over (what the launch reads kept alive by the lease)."""
    bt, twin, stand_in = staged
    idx, qsl = torch.tensor([3, 1, 0], dtype=I64), torch.tensor([0, 1, 3, 4], dtype=I64)
    pos = torch.tensor([9, 2, 7, 0])
    pad, nct = torch.tensor([False, True, False, False, True]), torch.tensor([0, 40, 3, 60, 1, 2], dtype=I32)
    step = (idx, qsl, pos, 4, 5, pad, nct)
    lease = bt._mode.arena.lease
    lease.keep = None  # (the launch on it must reference what it reads: the apply descriptors)
    assert same_results(bt.prepare_inputs(*step), twin.prepare_inputs(*step)) and same_tables(bt, twin)
    assert lease.keep is bt._mode.plan.desc and bt._mode.arena.lender.leases[lease.slot] is lease
    (key, *_), = stand_in.calls
    assert key[:7] == (I64, I64, I64, True, True, True, True) and key[-2:] == (I32, True)


def test_a_head_of_another_length_is_refused_at_construction(staged):
    """`spec.head` must hold the 12 no-batch arguments: the staged launch reads its first (found by review: an empty
    one crashed the process)."""
    bt, _, stand_in = staged
    with pytest.raises(TypeError, match="spec.head a tuple of 12"):
        new_entry(bt, stand_in, spec_changes={"head": ()})


def test_the_entrys_capture_test_is_the_one_a_fork_rebinds(staged, monkeypatch):
    """The entry asks `multiwrite.capture` at each call, so that in a child forked after CUDA was initialized it
    raises what every capture test there raises (found by review: it held torch's function, bound at import)."""
    import multiwrite.capture as capture

    bt, _, stand_in = staged

    def forked():
        raise capture.ForkedCudaError("forked after CUDA was initialized")

    monkeypatch.setattr(capture, "_is_capturing", forked)
    monkeypatch.setattr(capture, "_CUDA_BUILT", True)
    with pytest.raises(capture.ForkedCudaError):
        bt._mode.entry.prepare(*STEP)
    assert stand_in.calls == []


@pytest.mark.parametrize("raised", [RuntimeError("CUDA error: device unavailable"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])  # fmt: skip
def test_a_failing_device_query_leaves_every_call_to_the_python_path_with_nothing_done(staged, raised):
    """torch's current-device query raising an `Exception` inside the entry: the call is not taken, nothing done
    (no token, no countdown, no launch): the Python path asks again where it asks, after its hand-over, and raises
    from there (found by review: the entry raised before the hand-over the Python path makes first). An interrupt
    propagates as it is, nothing done."""
    bt, _, stand_in = staged

    def broken():
        raise raised

    entry = new_entry(bt, stand_in, get_device=broken)
    idx, qsl, pos = STEP[:3]
    before, left = ring_state(bt), bt._mode._countdown.left
    calls = (lambda: entry.gather(idx, 2, None), lambda: entry.slots(idx, qsl, pos, 4, None),
             lambda: entry.prepare(*STEP), entry.apply)  # fmt: skip
    for call in calls:
        if isinstance(raised, Exception):
            assert call() is None
        else:
            with pytest.raises(KeyboardInterrupt):
                call()
    assert ring_state(bt) == before and bt._mode._countdown.left == left
    assert stand_in.calls == stand_in.apply.calls[1:] == []  # (`pair` applied its full rows through the entry)
