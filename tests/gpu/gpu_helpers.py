"""Workloads and helpers shared by the GPU tests: random batches with their references, a busy stream."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from multiwrite.replay import count_mismatches

#: Cycles per second that `busy` assumes (an H200 boosts to about 1.98 GHz; only the order matters).
CLOCK_HZ = 2.0e9


def busy(seconds: float) -> None:
    """Hold the current CUDA stream busy for about `seconds` (`torch.cuda._sleep` spins on the device)."""
    torch.cuda._sleep(int(seconds * CLOCK_HZ))


def gpu_backend(name: str, **kw):
    """A fresh backend instance (own writers, rings, caches) of `name`, e.g. `ring_depth=2`."""
    if name == "triton-rocm":
        from multiwrite.backends.triton_rocm import TritonRocmBackend

        return TritonRocmBackend(**kw)
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    return TritonCudaBackend(**kw)


class RandomBlockTables:
    """A `BlockTables` of three groups plus its reference, driven by random `append_block_ids` calls
    (overwrites, appends, several calls on one row per step: overlapping writes)."""

    def __init__(self, device, backend, rng: np.random.Generator, reqs: int = 48):
        bs, kbs = [16, 32, 8], [16, 16, 8]
        self.widths = [40, 24, 60]
        self.bt = BlockTables(bs, reqs, self.widths, device, kbs, backend=backend)
        self.ref = ReferenceBlockTables(bs, reqs, self.widths, kbs)
        self.k = self.bt.kernel_blocks_per_block
        self.rng = rng
        self.reqs = reqs

    def stage_step(self, max_calls: int = 12) -> None:
        rng = self.rng
        for _ in range(int(rng.integers(1, max_calls + 1))):
            r = int(rng.integers(0, self.reqs))
            overwrite = bool(rng.random() < 0.3)
            ids = []
            for g, k in enumerate(self.k):
                room = (self.widths[g] * k - (0 if overwrite else int(self.ref.num_blocks[g, r]))) // k
                n = int(rng.integers(0, min(room, 3 if rng.random() < 0.9 else 40) + 1)) if room > 0 else 0
                ids.append(rng.integers(1, 100_000, n).tolist())
            if not overwrite and not any(ids):
                continue
            self.bt.append_block_ids(r, ids, overwrite)
            self.ref.append_block_ids(r, ids, overwrite)

    def step(self) -> None:
        self.stage_step()
        self.bt.apply_staged_writes()

    def mismatches(self) -> int:
        """Cells of the tables and of host and device `num_blocks` that differ (synchronizes)."""
        return count_mismatches(self.bt, self.ref)


class RandomTensors:
    """Three `StagedWriteTensor`s (int32 with k=2, int64, float32 1-D) applied together by one writer: three
    arenas, so every apply goes through the Triton writer's shared ring."""

    def __init__(self, device, backend, rng: np.random.Generator):
        self.tabs = [
            StagedWriteTensor((16, 300), torch.int32, device, name="i32", kernel_blocks_per_block=2),
            StagedWriteTensor((8, 70), torch.int64, device, name="i64"),
            StagedWriteTensor(33, torch.float32, device, name="f32"),
        ]
        self.refs = [np.zeros((16, 300)), np.zeros((8, 70)), np.zeros((33, 1))]
        self.ks = [2, 1, 1]
        self.writer = FusedStagedWriter(device, backend=backend)
        self.rng = rng

    def stage_step(self) -> None:
        rng = self.rng
        for _ in range(int(rng.integers(1, 10))):
            j = int(rng.integers(0, 3))
            rows, cols = self.refs[j].shape
            k = self.ks[j]
            row = int(rng.integers(0, rows))
            n = int(rng.integers(0, cols // k + 1)) if rng.random() < 0.1 else int(rng.integers(0, 4))
            n = min(n, cols // k)
            start = int(rng.integers(0, cols - n * k + 1))
            vals = rng.integers(0, 1 << 20, n)
            vals = vals + 0.5 if j == 2 else vals
            self.tabs[j].stage_write(row, start, vals)
            apply_writes_reference(self.refs[j], [(row, start, vals)], k)

    def step(self) -> None:
        self.stage_step()
        self.writer.apply(self.tabs)

    def mismatches(self) -> int:
        bad = 0
        for t, ref in zip(self.tabs, self.refs):
            got = t.tensor.cpu().numpy().reshape(ref.shape).astype(np.float64)
            bad += int(np.count_nonzero(got != ref))
        return bad


def warm_up(device, backend) -> None:
    """Compile and bind every kernel variant the workloads use (int32/int64/float32, decode and general
    tiles), so no compilation or launcher validation runs inside a test's measured or racing part."""
    rng = np.random.default_rng(0)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    for big in (False, True):
        for r in range(rb.reqs if big else 4):  # 4 requests: at most 256 values, the decode tile
            rb.bt.append_block_ids(r, ([1] * (10 if big else 1), [2], [3]), overwrite=True)
        rb.bt.apply_staged_writes()
        for t, n in zip(rt.tabs, (150, 70, 1)):
            for row in range(t.tensor.shape[0]):
                t.stage_write(row, 0, [1] * (n if big else 1))
        rt.writer.apply(rt.tabs)
    torch.cuda.synchronize(device)
