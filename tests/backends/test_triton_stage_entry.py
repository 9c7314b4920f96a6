"""The compiled entry of eager stage calls (`multiwrite.stage.entry`, `_cstaging.StageEntry`), white-box, off a GPU:
the Triton plan's launch spec is handed a stand-in launcher whose bound "fast launchers" record each launch and run
it through the real launcher (Triton's interpreter on CPU tensors), so that what the entry launches is computed.
Checked: it launches exactly what the one Python path (`TablesMode.stage_call` -> `TritonPlan._stage`) launches for
the same step (variant key, grid, every argument), the tables it leaves equal a twin's that never takes it, and every
precondition it tests sends the call to the Python path with nothing done."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest
import torch

from multiwrite import BackendError, BlockTables, StagedWriteError, StageInputError
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.launcher import Launcher
from multiwrite.backends.triton.plan import TritonPlan
from multiwrite.reference import gather_block_tables_reference
from multiwrite.staging.fields import _cstaging
from tests.support.stage_entry import GROUPS, I32, I64, engine_steps, entry_tables, new_entry, stage_rows

pytestmark = pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")

def _run(call: str, step: tuple, tables: BlockTables) -> tuple[torch.Tensor, ...]:
    idx, padded, nct, qsl, pos, tokens, pad = step
    if call == "gather":
        return tables.gather_block_tables(idx, padded, num_computed_tokens=nct)
    return (tables.compute_slot_mappings(idx, qsl, pos, tokens, pad),)


def test_the_entry_launches_what_the_python_path_launches_for_every_step(monkeypatch):
    """Each step twice on the same tables and state: through the entry (its stand-in records the launch), then with no
    fast launcher bound, so that the Python path launches (recorded at `Launcher.launch`): the same variant key, grid
    and arguments; gathered rows and slot mappings as a twin that never takes the entry computes them."""
    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    twin = BlockTables(backend=TritonCudaBackend(), **GROUPS)
    assert twin._mode.entry is None  # (no GPU: the Triton plan has no launch spec)
    rng = np.random.default_rng(7)
    stage_rows(bt, np.random.default_rng(1))
    stage_rows(twin, np.random.default_rng(1))
    python_path: list[tuple] = []
    original = Launcher.launch

    def recording(self, variant, consts, grid0, grid1, args, *rest, **kw):
        python_path.append((variant, grid0, grid1, args))
        return original(self, variant, consts, grid0, grid1, args, *rest, **kw)

    monkeypatch.setattr(Launcher, "launch", recording)
    bound = dict(stand_in.fire)
    for idx, padded, nct, qsl, pos, tokens, pad in engine_steps(rng, 40):
        for call in ("gather", "slots"):
            step = (idx, padded, nct, qsl, pos, tokens, pad)
            run = functools.partial(_run, call, step)
            bt._mode._countdown.restart()  # (a call at which the address check is due is the Python path's: below)
            dirty = bt._mode.dirty_rows
            calls, python = len(stand_in.calls), len(python_path)
            got = run(bt)  # (through the entry)
            want = run(twin)
            assert (len(stand_in.calls), len(python_path)) == (calls + 1, python + 2)  # (its launch, the twin's)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), call
            bt._mode.dirty_rows = dirty
            stand_in.fire.clear()
            again = run(bt)  # (through the Python path)
            stand_in.fire.update(bound)
            assert len(stand_in.calls) == calls + 1 and len(python_path) == python + 3
            assert python_path[-1] == stand_in.calls[-1], call
            assert [(a.data_ptr(), a.shape) for a in again] == [(a.data_ptr(), a.shape) for a in got]
    assert stand_in.launches == len(stand_in.calls) == 80


@pytest.fixture
def tables(monkeypatch):
    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    stage_rows(bt, np.random.default_rng(3))
    return bt, stand_in


def test_a_gather_of_fewer_rows_zeroes_what_the_last_gather_left(tables):
    bt, stand_in = tables
    tabs = [t.tensor.numpy().copy() for t in bt.block_tables]
    counts = bt.num_blocks.copy()
    bt.gather_block_tables(torch.tensor([5, 4, 3, 2], dtype=I32), 6)
    got = bt.gather_block_tables(torch.tensor([1], dtype=I64), 1)
    # (the rows launched: the 4 requests the last gather filled; it zeroed its padding rows 4 and 5 itself)
    assert len(stand_in.calls) == 2 and stand_in.calls[-1][3][19] == 4
    outs = [t.numpy().copy() for t in bt.input_block_tables]
    want = [np.full_like(o, 7) for o in outs]
    want = gather_block_tables_reference(tabs, counts, [1], 1, want, num_rows=4)
    for g, (o, w) in enumerate(zip(outs, want)):
        assert np.array_equal(o[1:6], np.zeros_like(o[1:6])), g
        assert np.array_equal(o[0, : counts[g, 1]], w[0, : counts[g, 1]]), g
        assert got[g].data_ptr() == bt.input_block_tables[g].data_ptr() and got[g].shape[0] == 1


#: Each precondition the entry tests: the calls it concerns, and whether the Python path then refuses the call.
PRECONDITIONS = {
    "float-idx": ("both", True), "non-contiguous-idx": ("both", False), "int16-idx": ("both", True),
    "too-many-reqs": ("both", True), "numpy-count": ("gather", False), "bool-count": ("both", True),
    "padded-below-reqs": ("gather", True), "short-nct": ("gather", True), "short-qsl": ("slots", True),
    "tokens-over": ("slots", True), "pad-dtype": ("slots", True), "pad-short": ("slots", True),
    "unbound": ("both", False),
}  # fmt: skip


@pytest.mark.parametrize("why", PRECONDITIONS)
def test_every_precondition_sends_the_call_to_the_python_path_with_nothing_done(tables, why):
    """A call the entry does not take exactly launches nothing of its own; the Python path then runs it (and raises
    what it raises for bad inputs)."""
    bt, stand_in = tables
    calls, raises = PRECONDITIONS[why]
    idx, qsl, pos = torch.tensor([2, 0], dtype=I32), torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 6, 1])
    padded, tokens, nct, pad = 2, 4, None, None
    if why == "float-idx":
        idx = idx.to(torch.float32)
    elif why == "non-contiguous-idx":
        idx = torch.tensor([2, 9, 0, 9], dtype=I32)[::2]
    elif why == "int16-idx":
        idx = idx.to(torch.int16)
    elif why == "too-many-reqs":
        idx = torch.arange(7, dtype=I32)
    elif why == "numpy-count":
        padded = np.int64(3)
    elif why == "bool-count":
        padded, tokens = True, True
    elif why == "padded-below-reqs":
        padded = 1
    elif why == "short-nct":
        nct = torch.zeros(5, dtype=I64)
    elif why == "short-qsl":
        qsl = torch.tensor([0, 2], dtype=I32)
    elif why == "tokens-over":
        tokens = 33
    elif why == "pad-dtype":
        pad = torch.zeros(4, dtype=I32)
    elif why == "pad-short":
        pad = torch.zeros(3, dtype=torch.bool)
    elif why == "unbound":
        stand_in.fire.clear()
    stage = bt._mode.plan.device.stage_launcher
    for call in ("gather", "slots") if calls == "both" else (calls,):
        launches = stage.launches
        with pytest.raises(StageInputError) if raises else contextlib.nullcontext():
            if call == "gather":
                bt.gather_block_tables(idx, padded, num_computed_tokens=nct)
            else:
                bt.compute_slot_mappings(idx, qsl, pos, tokens, pad)
        assert stand_in.calls == [] and stand_in.launches == 0
        assert stage.launches == launches + (not raises)  # (the Python path launched through the real launcher)


def test_another_current_device_sends_the_call_to_the_python_path(tables):
    """With another device current the entry does nothing (the Python path switches to the tables' device)."""
    bt, stand_in = tables
    current = [0]
    entry = new_entry(bt, stand_in, get_device=lambda: current[0])
    idx, qsl, pos = torch.tensor([2, 0], dtype=I32), torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 6, 1])
    assert entry.gather(idx, 2, None) is None and entry.slots(idx, qsl, pos, 4, None) is None
    assert stand_in.calls == []
    current[0] = -1
    assert entry.gather(idx, 2, None) is not None and entry.slots(idx, qsl, pos, 4, None) is not None
    assert len(stand_in.calls) == 2


def test_a_due_address_check_or_a_resized_table_goes_through_the_preamble(monkeypatch):
    """`check_addresses=True` (the check at every call): the entry never takes a call; a table resized in place: the
    Python path's guard raises, naming it, and the entry launched nothing."""
    bt, stand_in = entry_tables(monkeypatch, check_addresses=True, **GROUPS)
    idx = torch.tensor([0], dtype=I32)
    bt.gather_block_tables(idx, 1)
    assert stand_in.calls == []
    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    for _ in range(3):
        bt.gather_block_tables(idx, 1)
    assert len(stand_in.calls) == 3
    bt.input_block_tables[0].resize_(2, 2)
    with pytest.raises(Exception, match="input_block_tables|resized|set_"):
        bt.gather_block_tables(idx, 1)
    assert len(stand_in.calls) == 3


@pytest.mark.parametrize("call", ["gather", "slots"])
def test_a_table_resized_in_place_is_refused_and_the_entry_launches_nothing(monkeypatch, call):
    """The tables' guard (not only the outputs'): a group table resized in place sends the call to the Python path,
    whose guard names it; nothing is launched (the descriptors hold the old shape)."""
    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    idx, qsl, pos = torch.tensor([0], dtype=I32), torch.tensor([0, 1], dtype=I32), torch.tensor([3])
    run = (lambda: bt.gather_block_tables(idx, 1)) if call == "gather" else (
        lambda: bt.compute_slot_mappings(idx, qsl, pos, 1))  # fmt: skip
    run()
    assert len(stand_in.calls) == 1
    bt.block_tables[0].tensor.resize_(2, 2)
    with pytest.raises(StagedWriteError, match="resized|set_"):
        run()
    assert len(stand_in.calls) == 1


def test_tables_without_a_sliding_window_do_not_read_num_computed_tokens():
    """Without a window group the variant key says "no window" whatever `num_computed_tokens` is, as `_stage`'s does
    (else the entry would look up a key the Python path never binds, and never take such a call)."""
    mp = pytest.MonkeyPatch()
    try:
        groups = {**GROUPS, "sliding_window_reach": [0, 0, 0]}
        bt, stand_in = entry_tables(mp, **groups)
        nct = torch.zeros(6, dtype=I64)
        bt.gather_block_tables(torch.tensor([1], dtype=I32), 1, num_computed_tokens=nct)
        assert len(stand_in.calls) == 1
        key, args = stand_in.calls[0][0], stand_in.calls[0][3]
        assert key[-2:] == (I32, False) and args[17] == args[14]  # (no window: nct's slot gets the fallback address)
    finally:
        mp.undo()


def test_the_entry_counts_its_calls_on_the_preambles_countdown(tables):
    """Every call the entry takes counts one call of the address check's countdown; the call at which the check is
    due goes to the Python path, which checks the addresses and restarts the countdown."""
    bt, stand_in = tables
    countdown, stage = bt._mode._countdown, bt._mode.plan.device.stage_launcher
    idx = torch.tensor([0], dtype=I32)
    left = countdown.left
    for i in range(left - 1):
        bt.gather_block_tables(idx, 1)
        assert countdown.left == left - 1 - i
    assert countdown.left == 1 and len(stand_in.calls) == left - 1
    python = stage.launches
    bt.gather_block_tables(idx, 1)  # (due: the Python path)
    assert len(stand_in.calls) == left - 1 and stage.launches == python + 1
    assert countdown.left == countdown.period
    bt.gather_block_tables(idx, 1)
    assert len(stand_in.calls) == left


@pytest.mark.parametrize("fails", [RuntimeError("launch failed"), KeyboardInterrupt()])
def test_a_failed_launch_through_the_entry_is_raised_as_the_python_path_raises_it(monkeypatch, fails):
    """An `Exception` from the launch: the `BackendError` naming the backend and tables, from the launch's error, and
    the dirty rows unchanged (nothing launched); an interrupt: as it is, the dirty rows at the larger count."""
    bt, stand_in = entry_tables(monkeypatch, fails=fails, **GROUPS)
    bt._mode.dirty_rows = 5  # (more than the 3 rows gathered: an interrupt leaves the larger count, 5)
    idx = torch.tensor([1, 2, 3], dtype=I32)
    if isinstance(fails, Exception):
        with pytest.raises(BackendError, match="triton-cuda") as info:
            bt.gather_block_tables(idx, 3)
        assert info.value.__cause__ is fails and info.value.__suppress_context__
        assert bt._mode.dirty_rows == 5
    else:
        with pytest.raises(KeyboardInterrupt):
            bt.gather_block_tables(idx, 3)
        assert bt._mode.dirty_rows == 5
        bt._mode.dirty_rows = 2
        with pytest.raises(KeyboardInterrupt):
            bt.gather_block_tables(idx, 3)
        assert bt._mode.dirty_rows == 3


@pytest.mark.parametrize("where", ["idx", "qsl", "pos", "pad", "nct"])
def test_an_input_on_another_device_is_the_python_paths(tables, monkeypatch, where):
    """A host input of GPU tables (or one on another GPU) is not the entry's: the Python path copies or refuses it
    (an int32 `is_padding` is refused, naming it). The entry once took such an input without reading it (its check
    returned "accepted" on a device mismatch) and launched with garbage for its address and length."""
    bt, stand_in = tables
    idx, qsl, pos = torch.tensor([2, 0], dtype=I32), torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 6, 1])
    nct, pad = torch.zeros(6, dtype=I64), torch.zeros(4, dtype=torch.bool)
    if where == "pad":
        pad = torch.zeros(4, dtype=I32)  # (a dtype the Python path refuses: the entry must not launch it)
    elsewhere = {"idx": idx, "qsl": qsl, "pos": pos, "pad": pad, "nct": nct}[where]
    get_device = torch.Tensor.get_device
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 1 if t is elsewhere else get_device(t))
    stage = bt._mode.plan.device.stage_launcher
    for call in ("gather", "slots"):
        if call == "gather" and where in ("qsl", "pos", "pad") or call == "slots" and where == "nct":
            continue
        launches = stage.launches
        with pytest.raises(StageInputError, match="is_padding") if where == "pad" else contextlib.nullcontext():
            if call == "gather":
                bt.gather_block_tables(idx, 2, num_computed_tokens=nct)
            else:
                bt.compute_slot_mappings(idx, qsl, pos, 4, pad)
        assert stand_in.calls == []
        assert stage.launches == launches + (where != "pad")


def test_a_failed_reinitialization_leaves_the_entry_as_it_was(tables):
    """`__init__` again with a spec it cannot use raises and changes nothing: the entry still launches as before."""
    bt, stand_in = tables
    mode, entry = bt._mode, bt._mode.entry
    bad = dataclasses.replace(mode.plan.launch_spec(), layout=object())
    with pytest.raises(AttributeError, match="gathered_views"):
        entry.__init__(mode, mode._countdown, mode.guard, mode.outputs_guard, mode.failure, bad)
    assert entry.gather(torch.tensor([1], dtype=I32), 1, None) is not None and len(stand_in.calls) == 1
    with pytest.raises(TypeError, match="not initialized"):
        type(entry).__new__(type(entry)).gather(torch.tensor([1], dtype=I32), 1, None)


def test_a_plan_returning_something_else_than_a_launch_spec_is_named(monkeypatch):
    monkeypatch.setattr(TritonPlan, "stage_launch_spec", lambda self: {"launcher": None})
    with pytest.raises(TypeError, match="stage_launch_spec\\(\\) must return a StageLaunchSpec or None"):
        BlockTables(backend=TritonCudaBackend(), **GROUPS)


def test_a_failure_function_that_raises_keeps_the_launch_error_as_its_context(tables):
    bt, stand_in = tables
    stand_in.fails = RuntimeError("launch failed")

    def failure(exc):
        raise ValueError("failure() broke")

    entry = new_entry(bt, stand_in, failure=failure)
    with pytest.raises(ValueError, match="failure\\(\\) broke") as info:
        entry.gather(torch.tensor([1], dtype=I32), 1, None)
    assert info.value.__context__ is stand_in.fails
