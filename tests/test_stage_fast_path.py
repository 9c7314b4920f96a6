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
