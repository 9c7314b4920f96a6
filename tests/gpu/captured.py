"""The graph-mode workload of the GPU graph tests: a `BlockTables` of G3 whose apply is captured once in a graph, with
its reference.

Each captured apply graph also copies the tables and `num_blocks_device` into snapshot buffers right after the apply,
as an engine's model step would read them: a snapshot shows what THAT replay left, even when the host has committed
later steps before the replay ran.
"""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import CONFIGS, max_blocks_per_group
from tests.gpu.helpers import gpu_backend

BLOCK_SIZES, KERNEL_BLOCK_SIZES = CONFIGS["G3"]


class Captured:
    """A graph-mode BlockTables of G3 at concurrency `reqs` (on a fresh backend: `backend_kw`, e.g. `ring_depth=2`), its
    reference, and a graph that applies the batch of its commit and snapshots the tables."""

    def __init__(self, device, backend_name: str, reqs: int = 40, **backend_kw):
        widths = self.widths = max_blocks_per_group(BLOCK_SIZES)
        self.bt = BlockTables(BLOCK_SIZES, reqs, widths, device, KERNEL_BLOCK_SIZES,
                              backend=gpu_backend(backend_name, **backend_kw), cuda_graphs=True)  # fmt: skip
        self.ref = ReferenceBlockTables(BLOCK_SIZES, reqs, widths, KERNEL_BLOCK_SIZES)
        self.snaps = [torch.empty_like(t.tensor) for t in self.bt.block_tables]
        self.snap_counts = torch.empty_like(self.bt.num_blocks_device)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.bt.apply_staged_writes()
            for s, t in zip(self.snaps, self.bt.block_tables):
                s.copy_(t.tensor)
            self.snap_counts.copy_(self.bt.num_blocks_device)
        torch.cuda.synchronize(device)
        ring = self.bt.graph.ring
        assert (ring.published, ring.runs) == (0, 0) and not self.bt[0].tensor.any()  # the capture ran nothing

    def stage(self, calls) -> None:
        for req, ids, overwrite in calls:
            self.bt.append_block_ids(req, ids, overwrite)
            self.ref.append_block_ids(req, ids, overwrite)

    def expected(self) -> tuple[list[np.ndarray], np.ndarray]:
        return [t.copy() for t in self.ref.tables], self.ref.num_blocks.copy()

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Copies of the snapshot buffers, taken in stream order after the last replay."""
        return [s.clone() for s in self.snaps], self.snap_counts.clone()

    def live(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t.tensor for t in self.bt.block_tables], self.bt.num_blocks_device


def mismatches(got: tuple[list[torch.Tensor], torch.Tensor], want: tuple[list[np.ndarray], np.ndarray]) -> int:
    bad = sum(int(np.count_nonzero(g.cpu().numpy() != w)) for g, w in zip(got[0], want[0]))
    return bad + int(np.count_nonzero(got[1].cpu().numpy() != want[1]))


def values_of(calls, k=(1, 2, 1)) -> int:
    """Values a step's calls stage (kernel block ids and the counts rows)."""
    return sum(sum(len(ids) * kk for ids, kk in zip(groups, k)) + len(groups) for _, groups, _ in calls)


def full_rows(c: Captured, rows, seed: int) -> list:
    """Calls that overwrite `rows` with fresh ids over their whole width: more than 256 values, a batch that stays in
    its staging slot."""
    rng = np.random.default_rng(seed)
    calls = [(r, [rng.integers(1, 100_000, w).tolist() for w in c.widths], True) for r in rows]
    assert values_of(calls) > 256
    return calls
