"""The fast paths of `BlockTables.prepare_inputs` (issue 10's host-time goal): each must give exactly what the
general path gives, and step aside for anything it does not handle.

- `stage._build_common`: the input checks of an engine's call on a GPU (device inputs, counts in range). It runs
  only for GPU tables; here a CPU `BlockTables` is told it is on a GPU, so its result can be compared with the
  full `_build` field by field, and every input `_build` would refuse must make it step aside (return None).
- `StageInputs.gathered` / `slots`: views cached per size, equal to fresh slices.
- `triton_stage._plan`: what the fused launch keeps per `BlockTables`, reused only for the pristine stage and
  the batch list the writer hands over again.
- The writer's `_stage` hand-off: the one backend call of the apply is `prepare_inputs`, and the hand-off is
  cleared whatever happens.
- The direct path of an eager step on the Triton backends (`backends/triton_direct.py`): equal to the general path
  over a trace, and every guarantee kept: capture refused first, a failed launch a `BackendError` with every write
  still staged and its ring slot free, tables resized in place refused, a new batch epoch after each step; and it
  steps aside for overlapping writes, empty batches and host inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.errors import StagedWriteError, StageInputError
from multiwrite.stage import StageInputs, _build, _build_common

I32, I64 = torch.int32, torch.int64
CPU = "torch-cpu"


def tables(backend: str = CPU, **kw) -> BlockTables:
    bt = BlockTables([16, 32], 6, [4, 4], "cpu", [16, 16], backend=backend, max_num_batched_tokens=32, **kw)
    bt.append_block_ids(2, ([1, 2], [3]), overwrite=True)
    bt.append_block_ids(4, ([5], [6, 7]), overwrite=True)
    return bt


def inputs():
    return (torch.tensor([4, 2], dtype=I32), 4, torch.tensor([0, 1, 3], dtype=I64),
            torch.tensor([7, 20, 21], dtype=I64), 8, None)  # fmt: skip


def fields(s: StageInputs) -> dict:
    return {name: getattr(s, name) for name in StageInputs.__slots__}


@pytest.fixture
def on_gpu(monkeypatch):
    """A CPU BlockTables whose stage config says GPU (the only case `_build_common` serves)."""
    bt = tables()
    monkeypatch.setattr(bt._stage_config, "gpu", True)
    return bt


def test_common_build_equals_the_full_build(on_gpu):
    idx, nrp, qsl, pos, ntp, pad = inputs()
    fast = _build_common(on_gpu._stage_config, idx, nrp, qsl, pos, ntp, pad)
    full = _build(on_gpu, "prepare_inputs", idx, nrp, qsl, pos, ntp, pad)
    assert fast is not None
    a, b = fields(fast), fields(full)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] is b[name] or a[name] == b[name], name
    padding = torch.tensor([False, False, True, True, False, False, False, False, True])
    fast = _build_common(on_gpu._stage_config, idx, nrp, qsl, pos, ntp, padding)
    assert fast is not None and fast.is_padding is padding


def _spoiled():
    """One input the full `_build` refuses (or checks on the host) per case, with what is wrong."""
    idx, nrp, qsl, pos, ntp, pad = inputs()
    yield "idx int16", (idx.to(torch.int16), nrp, qsl, pos, ntp, pad)
    yield "idx 2-D", (idx.view(1, 2), nrp, qsl, pos, ntp, pad)
    yield "idx numpy", (idx.numpy(), nrp, qsl, pos, ntp, pad)
    yield "idx longer than the tables", (torch.zeros(7, dtype=I32), 7, torch.arange(8, dtype=I64), pos, ntp, pad)
    yield "num_reqs_padded below num_reqs", (idx, 1, qsl, pos, ntp, pad)
    yield "num_reqs_padded past max_num_reqs", (idx, 7, qsl, pos, ntp, pad)
    yield "num_reqs_padded a bool", (idx, True, qsl, pos, ntp, pad)
    yield "num_reqs_padded a tensor", (idx, torch.tensor(4), qsl, pos, ntp, pad)
    yield "query_start_loc too short", (idx, nrp, qsl[:2], pos, ntp, pad)
    yield "query_start_loc float", (idx, nrp, qsl.float(), pos, ntp, pad)
    yield "positions 2-D", (idx, nrp, qsl, pos.view(3, 1), ntp, pad)
    yield "num_tokens_padded past max_num_batched_tokens", (idx, nrp, qsl, pos, 33, pad)
    yield "num_tokens_padded negative", (idx, nrp, qsl, pos, -1, pad)
    yield "is_padding too short", (idx, nrp, qsl, pos, ntp, torch.zeros(7, dtype=torch.bool))
    yield "is_padding int", (idx, nrp, qsl, pos, ntp, torch.zeros(8, dtype=I32))

    class Sub(torch.Tensor):
        pass

    yield "a tensor subclass", (idx.as_subclass(Sub), nrp, qsl, pos, ntp, pad)


@pytest.mark.parametrize("case", list(_spoiled()), ids=lambda c: c[0])
def test_common_build_steps_aside(on_gpu, case):
    _, args = case
    assert _build_common(on_gpu._stage_config, *args) is None


def test_common_build_is_not_used_for_cpu_tables():
    """CPU tables take host inputs, whose values must be checked: the common build never serves them."""
    bt = tables()
    assert _build_common(bt._stage_config, *inputs()) is None
    idx, nrp, qsl, pos, ntp, pad = inputs()
    with pytest.raises(StageInputError, match=r"idx_mapping\[0\]=9 is outside"):
        bt.prepare_inputs(torch.tensor([9, 2], dtype=I32), qsl, pos, nrp, ntp)


def test_views_are_cached_per_size_and_equal_fresh_slices():
    bt = tables()
    idx, nrp, qsl, pos, ntp, _ = inputs()
    g1, s1 = bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    g2, s2 = bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert g1 is g2 and s1 is s2  # one view per size serves every call
    for view, table in zip(g1, bt.input_block_tables):
        fresh = table[:nrp]
        assert (view.data_ptr(), view.shape, view.stride()) == (fresh.data_ptr(), fresh.shape, fresh.stride())
    fresh = bt.slot_mappings[:, :ntp]
    assert (s1.data_ptr(), s1.shape, s1.stride()) == (fresh.data_ptr(), fresh.shape, fresh.stride())
    g3, s3 = bt.prepare_inputs(idx, qsl, pos, 3, 5)
    assert [v.shape[0] for v in g3] == [3, 3] and s3.shape == (2, 5)
    np.testing.assert_array_equal(s3.numpy(), bt.slot_mappings[:, :5].numpy())
    # a stage whose outputs were swapped (as a backend test may do) gets fresh slices of ITS buffers
    stage = _build(bt, "test", idx, nrp, qsl, pos, ntp)
    other = torch.zeros(2, 32, dtype=I64)
    stage.slot_mappings = other
    assert stage.slots().data_ptr() == other.data_ptr()


def test_writer_hands_the_stage_to_exactly_one_backend_call(monkeypatch):
    bt = tables()
    backend = bt.backend
    calls = []
    monkeypatch.setattr(backend, "apply", lambda batches: calls.append(("apply", len(batches))))
    real = type(backend).prepare_inputs

    def stage_call(batches, stage):
        calls.append(("stage", len(batches)))
        real(backend, batches, stage)

    monkeypatch.setattr(backend, "prepare_inputs", stage_call)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert calls == [("stage", 1), ("apply", 1)]  # the default prepare_inputs applies through `apply` itself
    assert bt._writer._stage is None
    calls.clear()
    bt.apply_staged_writes()  # nothing staged: no call; a later apply is a plain apply again
    bt.append_block_ids(1, ([9], []), overwrite=True)
    bt.apply_staged_writes()
    assert calls == [("apply", 1)]


def test_hand_off_is_cleared_when_the_apply_is_refused():
    bt = tables()
    bt.block_tables[0].tensor.resize_(3, 4)  # in place: refused at the next apply, writes kept
    idx, nrp, qsl, pos, ntp, _ = inputs()
    with pytest.raises(StagedWriteError, match="resized in place"):
        bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert bt._writer._stage is None
    assert bt.block_tables[0].num_staged_writes == 2


triton_stage = None
try:
    from multiwrite.backends import triton_stage
except ImportError:  # pragma: no cover - Triton missing
    pass


@pytest.mark.skipif(
    triton_stage is None or not triton_stage.INTERPRETED, reason="triton-cuda on CPU tables: interpreter only"
)
def test_fused_plan_is_reused_only_for_the_pristine_stage_and_the_same_batch():
    bt = tables("triton-cuda")
    writer = bt.backend.writer(bt.device)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    bt.prepare_inputs(idx, qsl, pos, nrp, ntp)  # first call: a batch list built for this apply
    bt.append_block_ids(1, ([9], []), overwrite=True)
    bt.prepare_inputs(idx, qsl, pos, nrp, ntp)  # the writer's repeat path: its own list, kept while valid
    plan = bt._stage_config.plans[writer]
    batch_tables = plan.batch_tables
    stage = _build(bt, "test", idx, nrp, qsl, pos, ntp)

    class Batch:
        tables = batch_tables

    assert triton_stage._plan(writer, Batch, stage) is plan
    other = type("Batch", (), {"tables": list(batch_tables)})  # equal tables, another list: checked, a new plan
    fresh = triton_stage._plan(writer, other, stage)
    assert fresh is not None and fresh is not plan and fresh.desc is plan.desc
    spoiled = _build(bt, "test", idx, nrp, qsl, pos, ntp)
    spoiled.slot_mappings = torch.zeros(2, 32, dtype=I64)
    mine = triton_stage._plan(writer, Batch, spoiled)
    assert mine is not None and mine.slots is spoiled.slot_mappings
    assert bt._stage_config.plans[writer] is not mine  # a one-off: not cached
    # The tables it gives are the reference's: both steps' writes and the gather of the second step.
    assert bt.input_block_tables[0][:2, :2].tolist() == [[5, 0], [1, 2]]


# -------------------------------------------------------------------------------------------------
# the direct path of an eager prepare_inputs (backends/triton_direct.py)
# -------------------------------------------------------------------------------------------------
needs_interpreter = pytest.mark.skipif(
    triton_stage is None or not triton_stage.INTERPRETED, reason="triton-cuda on CPU tables: interpreter only"
)


def gpu_tables(direct: bool = True, **kw) -> BlockTables:
    """Triton-cuda tables on the CPU, told they are on a GPU (device inputs: the case the direct path serves);
    `direct=False` keeps them on the general path."""
    bt = BlockTables([16, 32], 6, [4, 4], "cpu", [16, 16], backend="triton-cuda", max_num_batched_tokens=32, **kw)
    bt._stage_config.gpu = True
    if not direct:
        bt._direct = False
    return bt


class GeneralCalls:
    """Counts the calls that took the general path (`multiwrite.stage.prepare_inputs`)."""

    def __init__(self, monkeypatch):
        import multiwrite.stage as stage_module

        self.count = 0
        real = stage_module.prepare_inputs

        def counted(*args, **kw):
            self.count += 1
            return real(*args, **kw)

        monkeypatch.setattr(stage_module, "prepare_inputs", counted)


def warm(bt: BlockTables) -> None:
    """Two general steps: the first attaches the lent ring, the second binds the direct path."""
    idx, nrp, qsl, pos, ntp, _ = inputs()
    for req in (2, 4):
        bt.append_block_ids(req, ([1 + req], [2 + req]), overwrite=True)
        bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert callable(bt._direct) or bt._direct is False


def snapshot(bt: BlockTables, out) -> list[np.ndarray]:
    """Every table, device and host `num_blocks`, the gathered rows and slot mappings returned, as arrays."""
    gathered, slots = out
    arrays = [t.tensor.numpy() for t in bt.block_tables] + [bt.num_blocks_device.numpy(), bt.num_blocks]
    return [a.copy() for a in arrays + [g.numpy() for g in gathered] + [slots.numpy()]]


def _trace(seed: int, steps: int):
    """Random steps of staging and stage inputs: new requests, appends, a row staged twice (overlap: the direct
    path steps aside), steps with nothing staged, padding masks, int32 and int64 inputs, chunked prefill."""
    rng = np.random.default_rng(seed)
    held = np.zeros((2, 6), dtype=np.int64)  # manager blocks held per group and row
    caps = (4, 4)
    for step in range(steps):
        calls = []
        for _ in range(int(rng.integers(0, 3))):
            req = int(rng.integers(0, 6))
            new = bool(rng.random() < 0.4) or held[:, req].min() == 0
            ids = []
            for g in range(2):
                room = caps[g] - (0 if new else held[g, req])
                n = int(rng.integers(0 if not new else 1, min(2, room) + 1)) if room > 0 else 0
                ids.append([int(x) for x in rng.integers(0, 50, n)])
                held[g, req] = (0 if new else held[g, req]) + n
            calls.append((req, ids, new))
        live = [r for r in range(6) if held[:, r].min() > 0]
        rows = [int(r) for r in rng.permutation(live)[: int(rng.integers(0, len(live) + 1))]]
        qsl, pos = [0], []
        for _ in rows:
            k = int(rng.integers(1, 3))  # one decode token, or a chunk of two
            pos += [int(x) for x in rng.integers(0, 64, k)]
            qsl.append(qsl[-1] + k)
        dt = (I32, I64)[step % 2]
        ntp = min(len(pos) + int(rng.integers(0, 4)), 32)
        pad = None
        if step % 3 == 1:
            pad = torch.from_numpy(rng.random(ntp + 1) < 0.3)
        yield calls, (torch.tensor(rows, dtype=dt), torch.tensor(qsl, dtype=I64 if step % 4 else I32),
                      torch.tensor(pos, dtype=dt), min(len(rows) + int(rng.integers(0, 2)), 6), ntp, pad)  # fmt: skip


@needs_interpreter
def test_direct_path_equals_the_general_path_over_a_trace(monkeypatch):
    direct, general = gpu_tables(), gpu_tables(direct=False)
    calls = GeneralCalls(monkeypatch)
    steps = 0
    for step_calls, args in _trace(3, 24):
        for req, ids, new in step_calls:
            direct.append_block_ids(req, ids, new)
            general.append_block_ids(req, ids, new)
        a, b = snapshot(direct, direct.prepare_inputs(*args)), snapshot(general, general.prepare_inputs(*args))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        steps += 1
    assert callable(direct._direct)
    direct_steps = 2 * steps - calls.count  # every call of `general` counts; those of `direct` that stepped aside
    assert direct_steps >= steps // 2, f"the direct path served only {direct_steps} of {steps} steps"


@needs_interpreter
def test_direct_path_failed_launch_keeps_every_write_staged_and_a_retry_lands_them(monkeypatch):
    from multiwrite.errors import BackendError

    bt, ref = gpu_tables(), gpu_tables(direct=False)
    for t in (bt, ref):
        warm(t)
        t.append_block_ids(1, ([7, 8], [9]), overwrite=True)
        t.append_block_ids(3, ([10], []), overwrite=True)
    calls = GeneralCalls(monkeypatch)
    staged, host_counts = bt._arena.num_writes, bt.num_blocks.copy()
    ring, slot = bt._arena.lender.ring, bt._arena.lender.current
    real = triton_stage._FusedLauncher.launch

    def broken(self, *args):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(triton_stage._FusedLauncher, "launch", broken)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    with pytest.raises(BackendError, match=r"'triton-cuda'.*group 0, group 1, num_blocks.*launch failed") as err:
        bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert calls.count == 0  # the direct path raised it
    assert err.value.tables == ("group 0", "group 1", "num_blocks") and err.value.backend is bt.backend
    assert bt._arena.num_writes == staged and bt.block_tables[0].num_staged_writes == 2
    np.testing.assert_array_equal(bt.num_blocks, host_counts)
    assert ring.done_mv[slot] == ring.tokens[slot]  # the slot is free again
    monkeypatch.setattr(triton_stage._FusedLauncher, "launch", real)
    a, b = bt.prepare_inputs(idx, qsl, pos, nrp, ntp), ref.prepare_inputs(idx, qsl, pos, nrp, ntp)
    for x, y in zip(snapshot(bt, a), snapshot(ref, b)):
        np.testing.assert_array_equal(x, y)
    assert bt._arena.num_writes == 0
    np.testing.assert_array_equal(bt.num_blocks_device.numpy(), bt.num_blocks)


@needs_interpreter
@pytest.mark.parametrize("change", ["resize_", "set_", "set_ group 1"])
def test_direct_path_refuses_tables_resized_in_place(monkeypatch, change):
    bt = gpu_tables()
    warm(bt)
    bt.append_block_ids(1, ([7], [9]), overwrite=True)
    if change == "resize_":
        bt.block_tables[0].tensor.resize_(3, 4)
    elif change == "set_":
        bt.block_tables[0].tensor.set_(torch.zeros(6, 4, dtype=I32))
    else:
        bt.block_tables[1].tensor.set_(torch.zeros(6, 8, dtype=I32))
    idx, nrp, qsl, pos, ntp, _ = inputs()
    with pytest.raises(StagedWriteError, match="resized in place"):
        bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert bt._arena.num_writes == 3  # the two group writes and the counts row stay staged


@needs_interpreter
def test_direct_path_takes_tables_written_in_place_by_torch(monkeypatch):
    """A torch op writing a table in place (same layout) is accepted, as by the general path, and seen."""
    bt, ref = gpu_tables(), gpu_tables(direct=False)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    for t in (bt, ref):
        warm(t)
        t.block_tables[1].tensor[4].fill_(3)
        t.append_block_ids(2, ([11], []), overwrite=False)
    a, b = bt.prepare_inputs(idx, qsl, pos, nrp, ntp), ref.prepare_inputs(idx, qsl, pos, nrp, ntp)
    for x, y in zip(snapshot(bt, a), snapshot(ref, b)):
        np.testing.assert_array_equal(x, y)


@needs_interpreter
def test_direct_path_starts_a_new_batch_epoch(monkeypatch):
    """After a direct step, clearing a later batch restores `num_blocks` of that batch's rows only: the rows the
    direct step applied keep their applied counts (host equals device)."""
    bt = gpu_tables()
    warm(bt)
    calls = GeneralCalls(monkeypatch)
    bt.append_block_ids(1, ([7, 8], [9]), overwrite=True)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    bt.append_block_ids(1, ([12], []), overwrite=False)  # the same row again, in a new batch: no overlap
    assert not bt._arena.may_overlap
    bt.append_block_ids(5, ([13], [14]), overwrite=True)
    bt.clear_staged_writes()
    assert calls.count == 0
    np.testing.assert_array_equal(bt.num_blocks, bt.num_blocks_device.numpy())


@needs_interpreter
def test_direct_path_refuses_a_capture_before_doing_anything(monkeypatch):
    """A capturing stream: `GraphCaptureError` before anything is launched or dropped (the capture probe is
    faked: CPU tables told they are CUDA tables of device 0)."""
    import multiwrite.capture as capture
    from multiwrite.errors import GraphCaptureError

    bt = gpu_tables()
    warm(bt)
    direct = bt._direct.__self__
    monkeypatch.setattr(direct, "cuda", True)
    monkeypatch.setattr(direct, "index", 0)
    monkeypatch.setitem(capture._CUDA_INDEX, bt.device, 0)
    monkeypatch.setattr(capture, "_get_device", lambda: 0)
    monkeypatch.setattr(capture, "_is_capturing", lambda: True)
    launched = []
    monkeypatch.setattr(triton_stage._FusedLauncher, "launch", lambda *a: launched.append(a))
    bt.append_block_ids(1, ([7], [9]), overwrite=True)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    with pytest.raises(GraphCaptureError, match="BlockTables.prepare_inputs"):
        bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert not launched and bt._arena.num_writes == 3


def test_direct_path_is_bound_only_for_eager_triton_tables():
    bt = tables()
    idx, nrp, qsl, pos, ntp, _ = inputs()
    bt.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert bt._direct is False  # torch-cpu has none


@needs_interpreter
@pytest.mark.parametrize("case", ["overlap", "nothing staged", "host inputs"])
def test_direct_path_steps_aside_for_what_it_does_not_serve(monkeypatch, case):
    """Overlapping writes (a row staged twice: applied in rounds, which only the general path orders), a step
    with nothing staged, host (non-device) inputs, and anything else it does not check itself go through the
    general path, with the general path's results."""
    bt, ref = gpu_tables(), gpu_tables(direct=False)
    idx, nrp, qsl, pos, ntp, _ = inputs()
    for t in (bt, ref):
        warm(t)
        if case == "overlap":
            t.append_block_ids(2, ([20], [21]), overwrite=False)
            t.append_block_ids(2, ([22], []), overwrite=False)
        elif case != "nothing staged":
            t.append_block_ids(2, ([20], [21]), overwrite=False)
    if case == "overlap":
        assert bt._arena.may_overlap
    if case == "host inputs":
        idx = idx.numpy()
    calls = GeneralCalls(monkeypatch)
    if case == "host inputs":
        with pytest.raises(StageInputError):
            bt.prepare_inputs(idx, qsl, pos, nrp, ntp)  # refused by the general path's full check
        assert calls.count == 1 and bt._arena.num_writes == 3
        return
    a, b = bt.prepare_inputs(idx, qsl, pos, nrp, ntp), ref.prepare_inputs(idx, qsl, pos, nrp, ntp)
    assert calls.count == 2  # both took the general path
    for x, y in zip(snapshot(bt, a), snapshot(ref, b)):
        np.testing.assert_array_equal(x, y)


def _strided_inputs(which: str):
    """The step of `inputs()` with one input a strided (every other element) view of a larger buffer."""
    idx, nrp, qsl, pos, ntp, pad = inputs()
    pad = torch.tensor([False, True, False, False, False, False, False, False, True])

    def spread(t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((2 * t.shape[0],), 9 if t.dtype != torch.bool else True, dtype=t.dtype)
        buf[::2] = t
        return buf[::2]

    if which == "idx_mapping":
        idx = spread(idx)
    elif which == "query_start_loc":
        qsl = spread(qsl)
    elif which == "positions":
        pos = spread(pos)
    else:
        pad = spread(pad)
    assert not (idx.is_contiguous() and qsl.is_contiguous() and pos.is_contiguous() and pad.is_contiguous())
    return idx, qsl, pos, nrp, ntp, pad


@needs_interpreter
@pytest.mark.parametrize("which", ["idx_mapping", "query_start_loc", "positions", "is_padding"])
@pytest.mark.parametrize("direct", [True, False])
def test_strided_inputs_give_what_contiguous_ones_give(which, direct):
    """An input that is a strided view (a column of a 2-D buffer, `buf[::2]`) is read element by element as torch
    reads it, not as if it were contiguous from its first address (the kernels index it with stride 1)."""
    bt = gpu_tables(direct=direct)
    ref = BlockTables([16, 32], 6, [4, 4], "cpu", [16, 16], backend=CPU, max_num_batched_tokens=32)
    for t in (bt, ref):
        warm(t)
        t.append_block_ids(1, ([7, 8], [9]), overwrite=True)
    assert callable(bt._direct) is direct
    args = _strided_inputs(which)
    want = snapshot(ref, ref.prepare_inputs(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)))
    for x, y in zip(snapshot(bt, bt.prepare_inputs(*args)), want):
        np.testing.assert_array_equal(x, y)
