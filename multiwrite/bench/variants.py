"""The designs `multiwrite bench` compares, behind one small interface, and their check against the reference.

Every variant takes a scheduler step's `append_block_ids` calls in `stage(calls)` (host work only),
sends them to the device in `apply()`, and exposes its final state through `snapshot()`:

- `fused`: one `BlockTables` holding every KV-cache group; one `apply_staged_writes` per step (one
  backend call for all groups and `num_blocks`).
- `per-group`: one single-group `BlockTables` per KV-cache group, each staged and applied on its own
  (one backend call per group and step).
- `naive`: plain device tables. Staging expands the manager ids into kernel block ids in a Python list
  and keeps `num_blocks` on the host; `apply()` builds one device tensor per write from its list
  (`torch.tensor(list, dtype=int32, device=...)`), slice-assigns it into the table, then copies
  `num_blocks` to the device once. The split puts all device work in `apply()`, as the naive design of
  the project's performance anchors (BENCHMARKS.md) measured it (its apply time is nearly its step time).

The floors (`floor`, `floor-triton`, `floor-torch`) are the cheapest possible `apply()`: nothing to stage,
one empty backend call on a CPU, one empty kernel launch on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from multiwrite.plugins.backend import Backend
from multiwrite.reference import ReferenceBlockTables
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import StagedCall


@dataclass
class Snapshot:
    """A variant's final state on the host: per group its table `[rows, width]`, and `num_blocks`
    `[num_groups, rows]` as the host keeps it and as the device holds it."""

    tables: list[np.ndarray]
    num_blocks: np.ndarray
    num_blocks_device: np.ndarray


@dataclass
class Mismatch:
    """How a snapshot differs from the reference: `cells` differing in all, and the first one as text."""

    cells: int
    first: str


def compare(snapshot: Snapshot, reference: ReferenceBlockTables | Any) -> Mismatch | None:
    """None when `snapshot` equals `reference` everywhere, else the number of differing cells and the first.

    `reference` is a `ReferenceBlockTables`, or anything with its `tables` and `num_blocks` attributes.
    Tables, host `num_blocks` and device `num_blocks` are each compared cell by cell.
    """
    parts = [(f"group {g} table", t, reference.tables[g]) for g, t in enumerate(snapshot.tables)]
    parts += [("num_blocks (host)", snapshot.num_blocks, reference.num_blocks)]
    parts += [("num_blocks (device)", snapshot.num_blocks_device, reference.num_blocks)]
    cells, first = 0, ""
    for what, got, want in parts:
        if got.shape != want.shape:
            cells += max(got.size, want.size)
            first = first or f"{what}: shape {got.shape}, reference {want.shape}"
            continue
        bad = np.argwhere(got != want)
        if bad.size:
            cells += bad.shape[0]
            if not first:
                idx = tuple(int(i) for i in bad[0])
                first = f"{what}[{', '.join(map(str, idx))}] = {got[idx]}, reference {want[idx]}"
    return Mismatch(cells, first) if cells else None


class TablesSpec(NamedTuple):
    """The tables a variant builds: the arguments of every variant's constructor."""

    block_sizes: Sequence[int]
    kernel_block_sizes: Sequence[int]
    max_num_reqs: int
    max_blocks: Sequence[int]
    device: torch.device | str
    backend: str | None


class _Variant:
    """A staging design under test on the tables `spec` describes: `stage(calls)` (host only), `apply()`,
    `snapshot()`."""

    name = ""

    def __init__(self, spec: TablesSpec) -> None:
        self.tables = self.build(spec)

    def build(self, spec: TablesSpec) -> Any:
        """The variant's tables."""
        raise NotImplementedError

    def stage(self, calls: Sequence[StagedCall]) -> None:
        """Stage a step's calls (host only): one `append_block_ids` per call."""
        append = self.tables.append_block_ids
        for req, ids, overwrite in calls:
            append(req, ids, overwrite)

    def apply(self) -> None:
        """One `apply_staged_writes` (asynchronous on a GPU)."""
        self.tables.apply_staged_writes()

    def table_tensors(self) -> list[torch.Tensor]:
        """The group tables, on the device."""
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        """Final tables and num_blocks, copied to the host."""
        t = self.tables
        return Snapshot([x.cpu().numpy() for x in self.table_tensors()], t.num_blocks.copy(),
                        t.num_blocks_device.cpu().numpy())  # fmt: skip


class FusedVariant(_Variant):
    """`BlockTables.apply_staged_writes`: every group's writes in one backend call."""

    name = "fused"

    def build(self, spec: TablesSpec) -> BlockTables:
        return BlockTables(spec.block_sizes, spec.max_num_reqs, spec.max_blocks, spec.device, spec.kernel_block_sizes,
                           backend=spec.backend)  # fmt: skip

    def table_tensors(self) -> list[torch.Tensor]:
        return [s.tensor for s in self.tables.block_tables]


class PerGroupVariant(_Variant):
    """One single-group `BlockTables` per KV-cache group, staged and applied one after another."""

    name = "per-group"

    def build(self, spec: TablesSpec) -> list[BlockTables]:
        return [
            BlockTables([bs], spec.max_num_reqs, [m], spec.device, [kbs], backend=spec.backend)
            for bs, kbs, m in zip(spec.block_sizes, spec.kernel_block_sizes, spec.max_blocks)
        ]

    def stage(self, calls: Sequence[StagedCall]) -> None:
        """Stage each call's ids of group g into table g (host only)."""
        appends = [t.append_block_ids for t in self.tables]
        for req, ids, overwrite in calls:
            for append, group_ids in zip(appends, ids):
                append(req, (group_ids,), overwrite)

    def apply(self) -> None:
        """One `apply_staged_writes` per group (one backend call each where something is staged)."""
        for t in self.tables:
            t.apply_staged_writes()

    def snapshot(self) -> Snapshot:
        """Final tables and num_blocks, copied to the host."""
        return Snapshot(
            [t.block_tables[0].tensor.cpu().numpy() for t in self.tables],
            np.concatenate([t.num_blocks for t in self.tables]),
            np.concatenate([t.num_blocks_device.cpu().numpy() for t in self.tables]),
        )


class NaiveTables:
    """Plain int32 device tables written one write at a time, from Python lists.

    Attributes:
        tables: per group, `[max_num_reqs, max_blocks[g] * k_g]` on `device`.
        num_blocks: host int32 `[num_groups, max_num_reqs]`, kernel blocks held per request and group.
        num_blocks_device: its device copy as of the last `apply_staged_writes()`.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        kernel_block_sizes: Sequence[int],
        max_num_reqs: int,
        max_blocks: Sequence[int],
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        self.k = [bs // kbs for bs, kbs in zip(block_sizes, kernel_block_sizes)]
        self.tables = [
            torch.zeros((max_num_reqs, m * k), dtype=torch.int32, device=device) for m, k in zip(max_blocks, self.k)
        ]
        self.num_blocks = np.zeros((len(self.k), max_num_reqs), dtype=np.int32)
        self.num_blocks_device = torch.zeros((len(self.k), max_num_reqs), dtype=torch.int32, device=device)
        self._pending: list[tuple[torch.Tensor, int, int, list[int]]] = []
        self._dirty = False

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Expand the ids into kernel block ids (a Python list per write) and update host `num_blocks`."""
        for g, ids in enumerate(new_block_ids):
            if not ids and not overwrite:
                continue
            k = self.k[g]
            start = 0 if overwrite else int(self.num_blocks[g, req_index])
            expanded = list(ids) if k == 1 else [b * k + j for b in ids for j in range(k)]
            if expanded:
                self._pending.append((self.tables[g], req_index, start, expanded))
            self.num_blocks[g, req_index] = start + len(expanded)
            self._dirty = True

    def apply_staged_writes(self) -> None:
        """Per write: a device tensor from its list, slice-assigned; then `num_blocks` to the device once."""
        device = self.device
        for table, row, start, expanded in self._pending:
            table[row, start : start + len(expanded)] = torch.tensor(expanded, dtype=torch.int32, device=device)
        self._pending.clear()
        if self._dirty:
            self.num_blocks_device.copy_(torch.from_numpy(self.num_blocks))
            self._dirty = False


class NaiveVariant(_Variant):
    """`NaiveTables`: one device tensor and one slice assignment per write (`apply`: every write of the step to
    the device, then num_blocks)."""

    name = "naive"

    def build(self, spec: TablesSpec) -> NaiveTables:
        return NaiveTables(spec.block_sizes, spec.kernel_block_sizes, spec.max_num_reqs, spec.max_blocks, spec.device)

    def table_tensors(self) -> list[torch.Tensor]:
        return self.tables.tables


#: The verified variants, in the order the tables print them.
VARIANTS = (FusedVariant, PerGroupVariant, NaiveVariant)


class Floor:
    """The cheapest `apply()` there is on a device; `stage` does nothing. Not verified (writes nothing)."""

    name = "floor"

    def stage(self, calls: Sequence[StagedCall]) -> None:
        """Nothing to stage."""

    def apply(self) -> None:
        raise NotImplementedError


class CpuFloor(Floor):
    """One empty backend call: `backend.apply([])`."""

    name = "floor"

    def __init__(self, backend: Backend):
        self._apply = backend.apply

    def apply(self) -> None:
        """`backend.apply([])`."""
        self._apply([])


class TorchLaunchFloor(Floor):
    """One one-element torch kernel launch: `x.add_(1)` on a 1-element device tensor."""

    name = "floor-torch"

    def __init__(self, device: torch.device):
        self._x = torch.zeros(1, dtype=torch.int32, device=device)

    def apply(self) -> None:
        """`x.add_(1)` (asynchronous)."""
        self._x.add_(1)


class TritonLaunchFloor(Floor):
    """One empty Triton kernel launch: a kernel with one pointer argument, grid `(1,)`."""

    name = "floor-triton"

    def __init__(self, device: torch.device):
        from multiwrite.bench.floor_kernel import empty_kernel  # imports Triton only on a GPU run

        self._kernel = empty_kernel
        self._x = torch.zeros(1, dtype=torch.int32, device=device)
        self._grid = (1,)
        empty_kernel[self._grid](self._x)  # compile now, never inside a timed call

    def apply(self) -> None:
        """`empty_kernel[(1,)](x)` (asynchronous)."""
        self._kernel[self._grid](self._x)


def floors(device: torch.device, backend: Backend) -> list[Floor]:
    """The floors measured on `device`: on a GPU the empty Triton launch (when Triton imports) and the
    torch launch; on a CPU one empty call of `backend`."""
    if device.type != "cuda":
        return [CpuFloor(backend)]
    out: list[Floor] = []
    try:
        out.append(TritonLaunchFloor(device))
    except Exception:  # no usable Triton: the torch launch stays the floor
        pass
    out.append(TorchLaunchFloor(device))
    return out
