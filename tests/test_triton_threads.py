"""Distinct objects on distinct threads at once, one device, one backend singleton (issue 8, fault 2).

Each thread owns its `BlockTables`, its `StagedWriteTensor`s (two arenas of one dtype, so a fused apply
goes through the Triton writer's shared ring) and its `FusedStagedWriter`; every table must end equal to
its thread's reference. Run on every backend (the Triton ones through the interpreter, few applies: it is
slow) and, for the Triton writer's host logic, many applies with the kernel replaced by a numpy emulator
that follows the kernel's contract (descriptors, metadata and values by address, completion token).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference


class ThreadWork:
    """One thread's objects and references, driven by its own seeded generator."""

    def __init__(self, seed: int, device, backend):
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.bs, self.kbs, self.widths, self.reqs = [16, 32], [16, 16], [6, 4], 5
        self.bt = BlockTables(self.bs, self.reqs, self.widths, device, self.kbs, backend=backend)
        self.ref = ReferenceBlockTables(self.bs, self.reqs, self.widths, self.kbs)
        self.x = StagedWriteTensor((4, 9), torch.int32, device, name=f"x{seed}")
        self.y = StagedWriteTensor((3, 7), torch.int32, device, name=f"y{seed}")
        self.refs = [np.zeros((4, 9)), np.zeros((3, 7))]
        self.writer = FusedStagedWriter(device, backend=backend)

    def step(self) -> None:
        rng = self.rng
        for _ in range(int(rng.integers(1, 4))):
            req = int(rng.integers(0, self.reqs))
            overwrite = bool(rng.random() < 0.4)
            ids = []
            for g, k in enumerate(self.bt.kernel_blocks_per_block):
                room = (self.widths[g] * k - (0 if overwrite else int(self.ref.num_blocks[g, req]))) // k
                n = int(rng.integers(0, min(room, 3) + 1)) if room > 0 else 0
                ids.append((self.seed * 1000 + rng.integers(0, 1000, n)).tolist())
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)
        self.bt.apply_staged_writes()
        for t, ref in zip((self.x, self.y), self.refs):
            for _ in range(int(rng.integers(1, 4))):  # same rows again now and then: overlapping writes
                rows, cols = ref.shape
                row, n = int(rng.integers(0, rows)), int(rng.integers(0, 4))
                start = int(rng.integers(0, cols - n + 1))
                vals = (self.seed * 1000 + rng.integers(0, 1000, n)).tolist()
                t.stage_write(row, start, vals)
                apply_writes_reference(ref, [(row, start, vals)])
        self.writer.apply([self.x, self.y])

    def mismatches(self) -> list[str]:
        bad = []
        for g, t in enumerate(self.bt.block_tables):
            if not np.array_equal(t.tensor.cpu().numpy(), self.ref.tables[g]):
                bad.append(f"thread {self.seed}: group {g}")
        if not np.array_equal(self.bt.num_blocks_device.cpu().numpy(), self.ref.num_blocks):
            bad.append(f"thread {self.seed}: num_blocks_device")
        for t, ref in zip((self.x, self.y), self.refs):
            if not np.array_equal(t.tensor.cpu().numpy(), ref):
                bad.append(f"thread {self.seed}: {t.name}")
        return bad


def run_threads(num_threads: int, steps: int, device, backend) -> list[str]:
    """`num_threads` threads, each `steps` steps on its own objects, started together; the mismatches."""
    works = [ThreadWork(seed, device, backend) for seed in range(1, num_threads + 1)]
    barrier = threading.Barrier(num_threads)
    errors: list[BaseException] = []

    def body(work: ThreadWork) -> None:
        try:
            barrier.wait()
            for _ in range(steps):
                work.step()
        except BaseException as exc:  # reported below, with the thread's result
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show up within few steps
    try:
        threads = [threading.Thread(target=body, args=(w,)) for w in works]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return [m for w in works for m in w.mismatches()]


def test_eight_threads_with_separate_objects(backend):
    steps = 3 if backend.name.startswith("triton") else 40  # the interpreter runs about 50 launches a second
    assert run_threads(8, steps, backend.device, backend.name) == []


# -- the Triton writer's host logic under many interleavings, with an emulated kernel -----------------------
def _array(addr: int, dtype, n: int) -> np.ndarray:
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(addr), dtype=dtype)


def emulated_kernel(grid0, grid1, stream, args, np_dtype) -> None:
    """What `_write_kernel_fn` does, in numpy: every write in order (rounds are in order already), cells
    outside a descriptor's shape masked, then the completion token stored."""
    desc_addr, meta_addr, values_addr, _bounds, _counter, done_addr, token, num_tables, w, v, _rounds = args
    desc = _array(desc_addr, np.int64, num_tables * 5).reshape(num_tables, 5)
    meta = _array(meta_addr, np.int32, w * 5).reshape(w, 5)
    values = _array(values_addr, np_dtype, v)
    itemsize = np.dtype(np_dtype).itemsize
    for t, row, start, length, offset in meta.tolist():
        base, row_stride, col_stride, rows, cols = desc[t].tolist()
        if row >= rows:
            continue
        for c in range(start, min(start + length, cols)):
            _array(base + (row * row_stride + c * col_stride) * itemsize, np_dtype, 1)[0] = values[offset + c - start]
    _array(done_addr, np.int32, 1)[0] = token


@pytest.fixture
def emulated_triton(monkeypatch):
    """A triton-cuda backend whose CPU writer launches the emulated kernel (no interpreter)."""
    pytest.importorskip("triton")
    from multiwrite.backends.triton_cuda import TritonCudaBackend
    from multiwrite.backends.triton_kernel import INTERPRETED

    if not INTERPRETED:  # pragma: no cover - a GPU machine: tests/gpu has the real thing
        pytest.skip("needs the interpreter build of the kernel module (CPU tables)")
    backend = TritonCudaBackend(ring_depth=2)
    writer = backend.writer(torch.device("cpu"))
    for dt in (np.int32, np.int64, np.float32):
        for decode in (False, True):
            writer._fire[(np.dtype(dt), decode)] = functools.partial(emulated_kernel, np_dtype=dt)
    return backend


@pytest.mark.parametrize("num_threads, steps", [(2, 1000), (8, 300)])  # each failed 3 of 3 runs before the fix
def test_threads_share_one_triton_writer_without_corruption(emulated_triton, num_threads, steps):
    assert run_threads(num_threads, steps, torch.device("cpu"), emulated_triton) == []
