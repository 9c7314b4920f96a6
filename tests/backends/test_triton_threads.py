"""The Triton backends' host logic (lent rings, the shared ring under its lock, the descriptor cache, tokens) under
many thread interleavings: the interpreter is too slow for many steps, so the apply kernel is replaced by a numpy
emulator that follows its contract (descriptors, metadata and values read by address, rounds in order, cells outside
a descriptor masked, the completion token stored last). White-box: the emulator is bound as the apply launcher's
fast launcher of each variant."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from multiwrite.backends.triton.backend import TritonCudaBackend
from tests.backends.thread_work import run_threads

CPU = torch.device("cpu")


def _array(addr: int, dtype, n: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(addr), dtype=dtype)


def emulated_apply(grid0, grid1, stream, args, np_dtype) -> None:
    """What the apply kernel does, in numpy: every write in order (the rounds are in order already), cells outside a
    descriptor's shape masked, then the completion token stored into the slot's word."""
    desc_addr, meta_addr, values_addr, _bounds, _counter, done_addr, token, num_tables, w, v, _rounds = args
    desc = _array(desc_addr, np.int64, num_tables * 5).reshape(num_tables, 5)
    meta = _array(meta_addr, np.int32, w * 5).reshape(w, 5)
    values = _array(values_addr, np_dtype, v)
    item = np.dtype(np_dtype).itemsize
    for t, row, start, length, offset in meta.tolist():
        base, row_stride, col_stride, rows, cols = desc[t].tolist()
        if not 0 <= row < rows:
            continue
        for c in range(max(start, 0), min(start + length, cols)):
            _array(base + (row * row_stride + c * col_stride) * item, np_dtype, 1)[0] = values[offset + c - start]
    _array(done_addr, np.int32, 1)[0] = token


@pytest.fixture
def emulated_triton() -> TritonCudaBackend:
    """A triton-cuda backend of two-slot rings whose CPU apply launches run the emulator."""
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine: tests/gpu has the real thing
        pytest.skip("emulates the kernel for CPU tables")
    backend = TritonCudaBackend(ring_depth=2)
    launcher = backend.device_state(CPU).apply_launcher
    for dt in (np.int32, np.int64, np.float32):
        for decode in (False, True):
            launcher.fire[(np.dtype(dt).char, decode)] = lambda g0, g1, s, a, dt=dt: emulated_apply(g0, g1, s, a, dt)
    return backend


@pytest.mark.parametrize("num_threads, steps", [(2, 600), (8, 150)])
def test_threads_share_one_triton_device_without_corruption(emulated_triton, num_threads, steps):
    assert run_threads(num_threads, steps, CPU, emulated_triton) == []
    state = emulated_triton.device_state(CPU)
    assert state.apply_launcher.launches > 2 * num_threads * steps and state.stage_launcher.launches == 0
