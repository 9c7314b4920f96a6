"""Reallocated tables on a GPU (the `.tensor` setter, `resize_`, `set_`): writes land in the storage installed now, and
the old storage (or whatever reuses its memory) is never written; a BlockTables group cannot be replaced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from tests.gpu.helpers import RandomBlockTables, gpu_backend, warm_up


@pytest.fixture
def writer(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    return FusedStagedWriter(device, backend=backend)


def _stage(t, ref, rng, n=20, cols=None):
    rows, cols = ref.shape[0], cols or ref.shape[1]
    for _ in range(n):
        row, m = int(rng.integers(0, rows)), int(rng.integers(1, 5))
        start = int(rng.integers(0, cols - m + 1))
        vals = rng.integers(1, 1 << 30, m)
        t.stage_write(row, start, vals)
        ref[row, start : start + m] = vals


def _applied(device, writer, name, seed):
    """A `(32, 64)` int32 table on `device` with 20 random writes applied by `writer` (not synchronized), its reference
    and the generator to go on with."""
    rng = np.random.default_rng(seed)
    t = StagedWriteTensor((32, 64), torch.int32, device, name=name)
    ref = np.zeros((32, 64), np.int64)
    _stage(t, ref, rng)
    writer.apply([t])
    return t, ref, rng


def test_replaced_through_the_setter(device, writer):
    t, ref, rng = _applied(device, writer, "a", 11)
    old = t.tensor
    old_snapshot = old.cpu().numpy().copy()
    new = old.clone()
    _stage(t, ref, rng)  # staged for the old tensor, applied to the new one
    t.tensor = new
    _stage(t, ref, rng)
    writer.apply([t])
    torch.cuda.synchronize(device)
    np.testing.assert_array_equal(new.cpu().numpy(), ref)
    np.testing.assert_array_equal(old.cpu().numpy(), old_snapshot)


def test_resized_in_place_to_more_columns(device, writer):
    t, ref, rng = _applied(device, writer, "b", 12)
    torch.cuda.synchronize(device)
    t.tensor.resize_(32, 96)  # reallocates: the old block goes back to the caching allocator
    t.tensor.zero_()
    canary = torch.full((32, 64), -7, dtype=torch.int32, device=device)  # may reuse the freed block
    ref = np.zeros((32, 96), np.int64)
    _stage(t, ref, rng, cols=64)
    _stage(t, ref, rng, n=5)  # and writes that only fit the new width
    writer.apply([t])
    torch.cuda.synchronize(device)
    np.testing.assert_array_equal(t.tensor.cpu().numpy(), ref)  # row stride 96 used, not 64
    assert bool((canary == -7).all())


def test_set_to_another_storage(device, writer):
    t, ref, rng = _applied(device, writer, "c", 13)
    old_alias = t.tensor.view(32, 64)  # keeps the old storage alive and visible
    old_snapshot = old_alias.cpu().numpy().copy()
    t.tensor.set_(t.tensor.clone())  # same shape and strides: only the pointer changes
    _stage(t, ref, rng)
    writer.apply([t])
    torch.cuda.synchronize(device)
    np.testing.assert_array_equal(t.tensor.cpu().numpy(), ref)
    np.testing.assert_array_equal(old_alias.cpu().numpy(), old_snapshot)


def test_a_block_tables_group_replaced_mid_run_is_refused_and_changes_nothing(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rb = RandomBlockTables(device, backend, np.random.default_rng(14))
    for _ in range(50):
        rb.step()
    torch.cuda.synchronize(device)
    old = rb.bt[1].tensor
    old_snapshot = old.cpu().numpy().copy()
    with pytest.raises(StagedWriteError):
        rb.bt[1].tensor = old.clone()
    assert rb.bt[1].tensor is old
    np.testing.assert_array_equal(old.cpu().numpy(), old_snapshot)
    for _ in range(50):
        rb.step()
    torch.cuda.synchronize(device)
    assert rb.mismatches() == 0
