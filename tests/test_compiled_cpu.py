"""The compiled-cpu backend's own contract: checks before writing, and a clear reason when not built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from multiwrite.backends import compiled_cpu

import multiwrite

pytestmark = pytest.mark.skipif(compiled_cpu.scatter_writes is None, reason="multiwrite._cstaging is not built")


def test_a_write_outside_its_table_writes_nothing():
    table = torch.zeros(2, 4, dtype=torch.int32)
    descriptors = np.array([(table.data_ptr(), 4, 1, 2, 4)], dtype=np.int64)
    meta = np.array([[0, 0, 0, 2, 0], [0, 1, 3, 2, 2]], dtype=np.int32)  # the second ends at column 5 of 4
    values = np.array([7, 8, 9, 10], dtype=np.int32)
    with pytest.raises(ValueError, match=r"write 1 \(table 0, row 1, start 3, length 2\)"):
        compiled_cpu.scatter_writes(meta, values, descriptors)
    assert table.sum() == 0
    meta[1, 2] = 2
    compiled_cpu.scatter_writes(meta, values, descriptors)
    assert table.tolist() == [[7, 8, 0, 0], [0, 0, 9, 10]]


def test_strided_tables_and_eight_byte_values():
    table = torch.zeros(3, 4, dtype=torch.int64).t()  # [4, 3] view with strides (1, 4)
    descriptors = np.array([(table.data_ptr(), 1, 4, 4, 3)], dtype=np.int64)
    meta = np.array([[0, 2, 0, 3, 0], [0, 2, 1, 1, 3]], dtype=np.int32)  # overlapping: the later wins
    compiled_cpu.scatter_writes(meta, np.array([1, 2, 3, -(2**40)], dtype=np.int64), descriptors)
    assert table[2].tolist() == [1, -(2**40), 3]


def test_not_built_is_a_reason_and_torch_cpu_takes_over(monkeypatch):
    monkeypatch.delenv("MULTIWRITE_BACKEND", raising=False)
    monkeypatch.setattr(compiled_cpu, "scatter_writes", None)
    status = {s.name: s for s in multiwrite.available_backends("cpu")}["compiled-cpu"]
    assert status.reasons == ["multiwrite._cstaging is not built (no C compiler or Python headers at install time)"]
    assert multiwrite.select_backend("cpu").NAME == "torch-cpu"
