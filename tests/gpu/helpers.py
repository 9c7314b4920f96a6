"""Workloads and helpers of the GPU tests: random batches with their references, a busy stream, fresh backends."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from multiwrite.replay import count_mismatches

#: Cycles per second that `busy` assumes (an H200 boosts to about 1.98 GHz; only the order of magnitude matters).
CLOCK_HZ = 2.0e9


def busy(seconds: float) -> None:
    """Hold the current CUDA stream busy for about `seconds` (`torch.cuda._sleep` spins on the device)."""
    torch.cuda._sleep(int(seconds * CLOCK_HZ))


def gpu_backend(name: str, **kw):
    """A fresh instance of the backend `name` (rings, descriptors, launchers of its own), e.g. `ring_depth=2`."""
    from multiwrite.backends.triton.backend import TritonCudaBackend, TritonRocmBackend

    return (TritonRocmBackend if name == "triton-rocm" else TritonCudaBackend)(**kw)


class RandomBlockTables:
    """A `BlockTables` of three groups plus its reference, driven by random `append_block_ids` calls (overwrites,
    appends, several calls on one row per step: overlapping writes)."""

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
    """Three `StagedWriteTensor`s (int32 with k=2, int64, float32 1-D) applied together by one writer, three arenas (a
    fused apply goes through the backend's shared ring), and, with `aliasing`, two more int32 tables over one tensor
    (the second a transposed view of the first): writes through both must land in true staging order."""

    def __init__(self, device, backend, rng: np.random.Generator, aliasing: bool = False):
        self.tabs = [
            StagedWriteTensor((16, 300), torch.int32, device, name="i32", kernel_blocks_per_block=2),
            StagedWriteTensor((8, 70), torch.int64, device, name="i64"),
            StagedWriteTensor(33, torch.float32, device, name="f32"),
        ]
        self.refs = [np.zeros((16, 300)), np.zeros((8, 70)), np.zeros((33, 1))]
        self.ks = [2, 1, 1]
        self.aliasing = aliasing
        if aliasing:
            base = torch.zeros(12, 12, dtype=torch.int32, device=device)
            a = StagedWriteTensor((12, 12), torch.int32, device, name="alias")
            b = StagedWriteTensor((12, 12), torch.int32, device, name="alias.T")
            a.tensor, b.tensor = base, base.t()
            self.tabs += [a, b]
            self.base_ref = np.zeros((12, 12))
            self.ks += [1, 1]
        self.writer = FusedStagedWriter(device, backend=backend)
        self.rng = rng

    def stage_step(self) -> None:
        rng = self.rng
        for _ in range(int(rng.integers(1, 10))):
            j = int(rng.integers(0, len(self.tabs)))
            ref = self.refs[j] if j < 3 else (self.base_ref if j == 3 else self.base_ref.T)
            rows, cols = ref.shape
            k = self.ks[j]
            row = int(rng.integers(0, rows))
            n = int(rng.integers(0, cols // k + 1)) if rng.random() < 0.1 else int(rng.integers(0, 4))
            n = min(n, cols // k)
            start = int(rng.integers(0, cols - n * k + 1))
            vals = rng.integers(0, 1 << 20, n)
            vals = vals + 0.5 if j == 2 else vals
            self.tabs[j].stage_write(row, start, vals)
            apply_writes_reference(ref, [(row, start, vals)], k)

    def step(self) -> None:
        self.stage_step()
        self.writer.apply(self.tabs)

    def mismatches(self) -> int:
        bad = 0
        for t, ref in zip(self.tabs[:3], self.refs):
            got = t.tensor.cpu().numpy().reshape(ref.shape).astype(np.float64)
            bad += int(np.count_nonzero(got != ref))
        if self.aliasing:
            bad += int(np.count_nonzero(self.tabs[3].tensor.cpu().numpy() != self.base_ref))
        return bad


def warm_up(device, backend) -> None:
    """Compile and bind every kernel variant the workloads use (int32/int64/float32, decode and general tiles), so
    that no compilation or launcher validation runs inside a test's racing part."""
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


def count_waits(monkeypatch) -> list[int]:
    """Count the waits of the Triton backends' staging rings for a slot (white-box: the ring's `wait_until`); the
    returned list grows by one per wait."""
    import multiwrite.backends.triton.ring as ring_module

    waits: list[int] = []
    real = ring_module.wait_until

    def counted(*args, **kwargs):
        waits.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ring_module, "wait_until", counted)
    return waits
