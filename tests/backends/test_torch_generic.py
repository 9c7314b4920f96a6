"""`torch-generic`: the fallback of every torch device type, at the lowest built-in priority: where it runs, where
it does not (devices that hold no data), that it is never chosen over a native backend, and that it writes tables
spread over several storages in one batch exactly (one index_put_ per storage), the later overlapping write winning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BackendUnavailableError, WriteBatch, available_backends, select_backend
from multiwrite.reference import apply_writes_reference
from tests.support.tables import host


def test_it_runs_on_any_device_type_with_data_and_never_wins_where_a_native_backend_runs(auto_selection):
    statuses = {s.name: s for s in available_backends("cpu")}
    assert statuses["torch-generic"].reasons == [] and statuses["torch-generic"].priority == -100
    assert select_backend("cpu").NAME != "torch-generic"
    meta = {s.name: s for s in available_backends("meta")}["torch-generic"]
    assert meta.reasons == ["device type meta holds no data (supported: every other torch device type)"]
    with pytest.raises(BackendUnavailableError, match="torch-generic.*holds no data"):
        select_backend("meta", "torch-generic")
    reasons = select_backend("cpu", "torch-generic").not_supported_reasons(torch.device("cpu"), [torch.float16])
    assert reasons == ["dtype=float16 (supported: float32, int32, int64)"]


def test_tables_of_several_storages_and_overlapping_writes_in_one_batch():
    be = select_backend("cpu", "torch-generic")
    shared = torch.zeros(6, 5, dtype=torch.int64)
    tables = [shared[:3], shared[3:].t(), torch.zeros(4, 2, dtype=torch.int64)]  # two views of one storage, another
    refs = [np.zeros((3, 5)), np.zeros((5, 3)), np.zeros((4, 2))]
    writes = [(0, 1, 0, [1, 2, 3]), (2, 3, 0, [2**40, -5]), (1, 4, 1, [7, 8]), (0, 1, 1, [9]), (2, 3, 1, [6])]
    meta, values = [], []
    for t, row, start, vals in writes:
        meta.append((t, row, start, len(vals), len(values)))
        values.extend(vals)
        apply_writes_reference(refs[t], [(row, start, vals)])
    be.apply([WriteBatch(tables, np.asarray(meta, np.int32), np.asarray(values, np.int64), True)])
    for t, ref in zip(tables, refs):
        np.testing.assert_array_equal(host(t), ref)
    assert shared[4, 4].item() == 7 and tables[2][3].tolist() == [2**40, 6]
