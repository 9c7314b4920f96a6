"""Per-thread work for the thread tests of this room: one thread's objects and references, and a runner that starts
them together (`test_threads.py` with the real kernels, `test_triton_threads.py` with an emulated one)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor, apply_writes
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from tests.support.tables import host


class ThreadWork:
    """One thread's objects and references, driven by its own seeded generator."""

    def __init__(self, seed: int, device, backend):
        self.rng = np.random.default_rng(seed)
        self.seed, self.device, self.backend = seed, device, backend
        self.bs, self.kbs, self.widths, self.reqs = [16, 32], [16, 16], [6, 4], 5
        self.bt = BlockTables(self.bs, self.reqs, self.widths, device, self.kbs, backend=backend)
        self.ref = ReferenceBlockTables(self.bs, self.reqs, self.widths, self.kbs)
        self.x = StagedWriteTensor((4, 9), torch.int32, device, name=f"x{seed}")
        self.y = StagedWriteTensor((3, 7), torch.int32, device, name=f"y{seed}")
        self.refs = [np.zeros((4, 9)), np.zeros((3, 7))]
        self.writer = FusedStagedWriter(device, backend=backend)
        self.problems: list[str] = []

    def _calls(self):
        """A few append_block_ids calls that fit the rows as they are staged now."""
        rng = self.rng
        counts = self.bt.num_blocks.copy()
        for _ in range(int(rng.integers(1, 4))):
            req = int(rng.integers(0, self.reqs))
            overwrite = bool(rng.random() < 0.4)
            ids = []
            for g, k in enumerate(self.bt.kernel_blocks_per_block):
                held = 0 if overwrite else int(counts[g, req])
                room = (self.widths[g] * k - held) // k
                n = int(rng.integers(0, min(room, 3) + 1)) if room > 0 else 0
                ids.append((self.seed * 1000 + rng.integers(0, 1000, n)).tolist())
                if n or overwrite:
                    counts[g, req] = held + n * k
            yield req, ids, overwrite

    def step(self, i: int) -> None:
        rng = self.rng
        if i % 3 == 2:  # staged, then dropped
            for req, ids, overwrite in self._calls():
                self.bt.append_block_ids(req, ids, overwrite)
            self.bt.clear_staged_writes()
        for req, ids, overwrite in self._calls():
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)
        self.bt.apply_staged_writes()
        for t, ref in zip((self.x, self.y), self.refs):
            for _ in range(int(rng.integers(1, 4))):  # the same rows again now and then: overlapping writes
                rows, cols = ref.shape
                row, n = int(rng.integers(0, rows)), int(rng.integers(0, 4))
                start = int(rng.integers(0, cols - n + 1))
                vals = (self.seed * 1000 + rng.integers(0, 1000, n)).tolist()
                t.stage_write(row, start, vals)
                apply_writes_reference(ref, [(row, start, vals)])
        self.writer.apply([self.x, self.y])
        short = StagedWriteTensor((2, 1 + (self.seed * 7 + i) % 23), torch.int32, self.device, name="short")
        short.stage_write(1, 0, [self.seed + i])
        if self.backend is None:
            apply_writes(short)  # this thread's shared writer of the device (the auto-selected backend)
        else:
            FusedStagedWriter(self.device, backend=self.backend).apply([short])
        if host(short.tensor)[1, 0] != self.seed + i:
            self.problems.append(f"thread {self.seed}: short-lived table of step {i}")

    def mismatches(self) -> list[str]:
        bad = list(self.problems)
        for g, t in enumerate(self.bt.block_tables):
            if not np.array_equal(host(t.tensor), self.ref.tables[g]):
                bad.append(f"thread {self.seed}: group {g}")
        if not np.array_equal(host(self.bt.num_blocks_device), self.ref.num_blocks):
            bad.append(f"thread {self.seed}: num_blocks_device")
        for t, ref in zip((self.x, self.y), self.refs):
            if not np.array_equal(host(t.tensor), ref):
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
            for i in range(steps):
                work.step(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show within few steps
    try:
        threads = [threading.Thread(target=body, args=(w,)) for w in works]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return [m for w in works for m in w.mismatches()]
