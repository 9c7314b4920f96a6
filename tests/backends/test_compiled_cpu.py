"""`compiled-cpu`: the C scatter of the compiled staging helper. What only it checks (the values' item type, one dtype
per batch), and what happens where the helper was not built: a reason in `multiwrite info`, torch-cpu takes over,
and BlockTables still stages (through the Python twin) and lands the same results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from multiwrite import StagedWriteError, WriteBatch, select_backend
from multiwrite.staging.fields import COMPILED

pytestmark = pytest.mark.skipif(not COMPILED, reason="multiwrite.staging._cstaging is not built")

#: A fresh interpreter where the helper cannot be imported (as on an install without a C compiler).
WITHOUT_HELPER = r"""
import json, sys
sys.modules["multiwrite.staging._cstaging"] = None
out = {}
import multiwrite
status = {s.name: s for s in multiwrite.available_backends("cpu")}["compiled-cpu"]
out["reasons"] = status.reasons
out["selected"] = multiwrite.select_backend("cpu").NAME
try:
    from multiwrite import BlockTables
    bt = BlockTables([16, 32], 4, [4, 4], "cpu", [16, 16])
    bt.append_block_ids(1, ([1, 2], [3]), True)
    bt.append_block_ids_batch([2, 1], [([5], []), ([4], [6])], overwrite=False)
    bt.apply_staged_writes()
    out["tables"] = [t.tensor.tolist() for t in bt.block_tables] + [bt.num_blocks_device.tolist()]
except Exception as exc:
    out["tables"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def without_helper() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MULTIWRITE_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_HELPER], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_the_helper_it_reports_why_and_torch_cpu_takes_over(without_helper):
    assert len(without_helper["reasons"]) == 1 and "multiwrite.staging._cstaging is not built" in without_helper[
        "reasons"][0]  # fmt: skip
    assert without_helper["selected"] == "torch-cpu"


def test_without_the_helper_block_tables_land_the_same_results(without_helper):
    k16 = [[0] * 4, [1, 2, 4, 0], [5, 0, 0, 0], [0] * 4]
    k32 = [[0] * 8, [6, 7, 12, 13, 0, 0, 0, 0], [0] * 8, [0] * 8]
    assert without_helper["tables"] == [k16, k32, [[0, 3, 1, 0], [0, 4, 0, 0]]]


def test_values_of_another_item_type_than_the_tables_are_refused():
    """The C scatter copies raw items: int64 values for int32 tables would be written as the wrong bytes."""
    be = select_backend("cpu", "compiled-cpu")
    table = torch.zeros(2, 4, dtype=torch.int32)
    batch = WriteBatch([table], np.array([(0, 0, 0, 2, 0)], np.int32), np.array([1, 2], np.int64), False)
    with pytest.raises(StagedWriteError, match=r"compiled-cpu: values of dtype int64 for int32 tables"):
        be.apply([batch])
    assert not table.any()


def test_tables_of_two_dtypes_in_one_batch_are_refused():
    be = select_backend("cpu", "compiled-cpu")
    a, b = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.float32)
    batch = WriteBatch([a, b], np.array([(0, 0, 0, 1, 0), (1, 0, 0, 1, 1)], np.int32), np.array([1, 2], np.int32),
                       False)  # fmt: skip
    with pytest.raises(StagedWriteError, match=r"must share one supported dtype, got \['float32', 'int32'\]"):
        be.apply([batch])
    assert not a.any() and not b.any()
