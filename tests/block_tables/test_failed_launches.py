"""A stage job whose launch fails moves nothing (issue 23, item 2): the rows a gather leaves non-zero are counted
only once its launch was issued, so the next gather still zeroes the rows an earlier, larger one filled (vLLM
0.33's rule: rows up to the larger of `num_reqs_padded` and the previous gather's rows). On every backend, with
the issue's shapes: int64 inputs, three groups of other widths, a padded batch of 12 after a gather of 16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BackendError, BlockTables
from multiwrite.plugins.backend import TablesPlan
from tests.support.tables import host

WIDTHS = [4, 2, 6]


class FailingPlan(TablesPlan):
    """A backend's plan whose `prepare` and `stage` raise `exc` while `failing`, launching nothing (a `TablesPlan`, as
    the host requires of a plan; every other job is the real plan's)."""

    def __init__(self, plan, exc: BaseException):  # (not TablesPlan's: the real plan already holds the arena)
        self.plan, self.exc, self.failing = plan, exc, False

    def apply(self):
        return self.plan.apply()

    def refresh(self):
        return self.plan.refresh()

    def _maybe_fail(self, job, step):
        if self.failing:
            raise self.exc
        return job(step)

    def prepare(self, step):
        return self._maybe_fail(self.plan.prepare, step)

    def stage(self, step):
        return self._maybe_fail(self.plan.stage, step)

    def __getattr__(self, name):
        return getattr(self.plan, name)


@pytest.fixture
def tables(backend, monkeypatch):
    """(BlockTables of 16 rows on `backend` whose plan can be made to fail, that plan)."""
    from multiwrite.plugins.dispatch import select_backend

    instance = select_backend(backend.device, backend.name)
    real = type(instance).plan
    plans = []

    def plan(self, layout, arena):
        plans.append(FailingPlan(real(self, layout, arena), RuntimeError("launch failed")))
        return plans[-1]

    monkeypatch.setattr(type(instance), "plan", plan)
    bt = BlockTables([16, 32, 8], 16, WIDTHS, backend.device, [16, 16, 8], backend=instance,
                     max_num_batched_tokens=32)  # fmt: skip
    for r in range(16):
        bt.append_block_ids(r, [[r + 1] * 2, [r + 100], [r + 200] * 3], True)
    bt.apply_staged_writes()
    return bt, plans[0]


def _idx(rows, device):
    return torch.tensor(rows, dtype=torch.int64, device=device)


@pytest.mark.parametrize("exc", [RuntimeError("launch failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("job", ["prepare_inputs", "gather_block_tables"])
def test_a_failed_gather_leaves_the_rows_to_zero_counted(tables, backend, job, exc):
    bt, plan = tables
    d = backend.device
    bt.gather_block_tables(_idx(list(range(16)), d), 16)  # fills all 16 rows
    plan.failing, plan.exc = True, exc
    bt.append_block_ids(3, [[50], [], []], False)  # (a write staged: prepare_inputs applies it in the launch)
    idx = _idx(list(range(10)), d)
    with pytest.raises(BackendError if isinstance(exc, Exception) else KeyboardInterrupt):
        if job == "prepare_inputs":
            qsl, pos = torch.arange(11, dtype=torch.int64, device=d), torch.zeros(10, dtype=torch.int64, device=d)
            bt.prepare_inputs(idx, qsl, pos, 12, 10)
        else:
            bt.gather_block_tables(idx, 12)
    plan.failing = False
    assert bt.num_staged_writes == 2  # nothing applied
    out = bt.gather_block_tables(_idx([5, 2, 7, 0, 1, 3, 4, 6], d), 12)
    assert [o.shape[0] for o in out] == [12, 12, 12]
    rows = [5, 2, 7, 0, 1, 3, 4, 6]
    for g, t in enumerate(bt.input_block_tables):
        got = host(t)
        want = np.zeros_like(got)
        want[:8] = host(bt[g].tensor)[rows]
        np.testing.assert_array_equal(
            got,
            want,
            err_msg=f"group {g}: rows 8..15 must be zero (the gather of 16 filled them; the failed call ran nothing)",
        )
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[3, :3].tolist() == [4, 4, 50]
