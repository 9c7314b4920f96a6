"""`FusedStagedWriter`: applies the staged writes of any number of `StagedWriteTensor`s in one backend call."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import torch

from multiwrite.capture import refuse_capture, setup_calls
from multiwrite.errors import OWN_ERRORS, StagedWriteError
from multiwrite.plugins.backend import Backend, WriteBatch, backend_error
from multiwrite.plugins.checked import lender, refuse_unsupported
from multiwrite.plugins.dispatch import select_backend
from multiwrite.staging.arena import Lease, StagingArena, remap_runs
from multiwrite.staging.layout import META_TABLE, META_VALUE_OFFSET, dtype_name, resolve_device, shape_text
from multiwrite.staging.table import StagedWriteTensor

_local = threading.local()  # each thread's shared writers (`default_for`): a writer is not thread-safe


class FusedStagedWriter:
    """Applies the staged writes of any number of `StagedWriteTensor`s on one device, together.

    Args:
        device: the device of every table this writer applies to (`"cuda"` means the current CUDA device at
            construction).
        backend: a backend name or instance to force; None picks the best available backend for the device (or
            `$MULTIWRITE_BACKEND` when set).

    Not thread-safe: one thread at a time per writer and per table; distinct writers with distinct tables may be
    used from distinct threads at once.

    Raises:
        BackendUnavailableError: no backend can run on `device`, or the forced one cannot.
    """

    def __init__(self, device: torch.device | str, backend: str | Backend | None = None):
        self.device = resolve_device(device)
        self.backend = (
            refuse_unsupported(backend, self.device)
            if isinstance(backend, Backend)
            else select_backend(self.device, backend)
        )

    @classmethod
    def default_for(cls, device: torch.device | str) -> FusedStagedWriter:
        """This thread's shared writer for `device`, with the auto-selected backend."""
        device = resolve_device(device)
        writers = getattr(_local, "writers", None)
        if writers is None:
            writers = _local.writers = {}
        writer = writers.get(device)
        if writer is None:
            writer = writers[device] = cls(device)
        return writer

    def apply(self, tensors: Iterable[StagedWriteTensor]) -> None:
        """Apply the staged writes of all `tensors` in one backend call, then clear them.

        `tensors` is any iterable (read once); a table listed twice counts once. Writes land in staging order, also
        across tables that share memory (views of one tensor: the write staged later wins where two touch the same
        cell). On a GPU backend this enqueues one kernel launch per dtype on the current stream and returns without
        waiting. With nothing staged, the backend is not called.

        Raises:
            TypeError: an item is not a `StagedWriteTensor` (the message names its position and type).
            StagedWriteError: a table is on another device than the writer's, was resized below its staged writes,
                belongs to a `BlockTables` that was resized in place (re-pointed: `TableMovedError`) or runs in graph
                mode, or shares memory with a table of another dtype in the same call. Raised before anything is
                written; every write stays staged.
            GraphCaptureError: the current CUDA stream is capturing a graph; nothing recorded, writes kept.
            BackendError: the backend raised (its exception is the cause); every write of this call stays staged.
            BackendContractError: after the writes landed (nothing stays staged), the backend's `staging_buffers`
                returned neither a `StagingBuffers` nor None; the backend is set aside (docs/backends.md).
        """
        refuse_capture(self.device, "FusedStagedWriter.apply")
        tensors = list(tensors)
        groups = self._group_by_arena(tensors)
        by_dtype: dict[torch.dtype, list[tuple[WriteBatch, list[tuple[int, int]]]]] = {}
        for arena, indices in groups.values():
            if arena.num_writes:
                batch, runs = _arena_batch(arena, indices)
                if batch.num_writes:
                    by_dtype.setdefault(batch.dtype, []).append((batch, runs))
        if not by_dtype:
            return
        if len(by_dtype) > 1:
            _refuse_aliasing_across_dtypes(by_dtype)
        batches = [parts[0][0] if len(parts) == 1 else _merge(parts) for parts in by_dtype.values()]
        # Arenas whose whole batch goes to the backend in place land on their next lease afterwards: take it first,
        # so that nothing can fail once the backend has read the batch.
        landing: list[tuple[StagingArena, Lease | None, int]] = []
        try:
            for batch in batches:
                if batch.lease is not None:
                    arena = next(a for a, _ in groups.values() if a.lease is batch.lease)
                    landing.append((arena, arena.next_lease(), batch.lease.launches))
            self.backend.apply(batches)
        except Exception as exc:
            _release(landing)
            if isinstance(exc, OWN_ERRORS):  # a refusal or a stalled ring: as it is
                raise
            raise backend_error(self.backend, self.device, [t.name for t in tensors],
                                sum(b.num_writes for b in batches), exc) from exc  # fmt: skip
        except BaseException:  # an interrupt: a batch a kernel has read in place has landed, the others not
            _release([entry for entry in landing if entry[0].lease.launches == entry[2]])
            for arena, lease, launches in landing:
                if arena.lease.launches != launches:
                    arena.land(lease)
            raise
        for arena, lease, _ in landing:
            arena.land(lease)
        for arena, indices in groups.values():
            if arena.num_writes:
                arena.drop_tables(indices)
        self._lend(groups)

    def _group_by_arena(self, tensors: list[StagedWriteTensor]) -> dict[int, tuple[StagingArena, list[int]]]:
        """The tables by arena (each table once), every check that raises before anything is written done."""
        groups: dict[int, tuple[StagingArena, list[int]]] = {}
        for position, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(
                    f"FusedStagedWriter.apply: item {position} is a {type(t).__module__}.{type(t).__qualname__}, "
                    "not a StagedWriteTensor; nothing was written"
                )
            table = t.installed_table()
            if table.device != self.device:
                raise StagedWriteError(
                    f"{t.name} (shape {shape_text(t.shape)}, {dtype_name(table.dtype)}) is on {table.device}, but "
                    f"this writer applies to {self.device}; nothing was written and its {t.num_staged_writes} staged "
                    "writes stay staged"
                )
            arena = t.arena
            entry = groups.get(id(arena))
            if entry is None:
                if arena.refusal is not None:
                    raise StagedWriteError(
                        f"{t.name} {arena.refusal}. Nothing was written and every staged write stays staged"
                    )
                if arena.guard is not None:  # (a BlockTables' tables: never resized nor re-pointed)
                    arena.guard.check()
                    arena.guard.check_addresses("FusedStagedWriter.apply")
                groups[id(arena)] = (arena, [t.index])
            elif t.index not in entry[1]:
                entry[1].append(t.index)
        return groups

    def _lend(self, groups: dict[int, tuple[StagingArena, list[int]]]) -> None:
        """After an apply of a whole arena of this writer's tables: stage it into the backend's memory from now on
        (read in place at the next apply)."""
        for arena, indices in groups.values():
            if arena.lender is None and arena.num_writes == 0 and len(indices) == len(arena.targets):
                with setup_calls(self.device):
                    lent = lender(self.backend, self.device, arena.np_dtype)
                    if lent is not None:
                        arena.attach(lent)

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, backend={self.backend.NAME!r})"


def apply_writes(*tables: StagedWriteTensor) -> None:
    """Apply the staged writes of `tables` now, through this thread's shared writer of their device (the
    auto-selected backend).

    Raises:
        BackendUnavailableError: no backend can run on the tables' device.
        StagedWriteError, BackendError: as `FusedStagedWriter.apply`.
    """
    for position, t in enumerate(tables):
        if not isinstance(t, StagedWriteTensor):
            raise TypeError(f"apply_writes: argument {position} is a {type(t).__name__}, not a StagedWriteTensor")
    by_device: dict[torch.device, list[StagedWriteTensor]] = {}
    for t in tables:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        FusedStagedWriter.default_for(device).apply(group)


def _release(landing: list[tuple[StagingArena, Lease | None, int]]) -> None:
    for arena, lease, _ in landing:
        if lease is not None:
            arena.lender.release(lease)


def _arena_batch(arena: StagingArena, indices: list[int]) -> tuple[WriteBatch, list[tuple[int, int]]]:
    """The writes of `indices` (tables of `arena`) as a batch whose tables are in `indices` order, and their runs on
    the staging clock `(clock, first write of the batch)`. A whole arena goes as it is (its lease, read in place)."""
    targets = arena.targets
    meta = arena.meta[: arena.num_writes]
    values = arena.values[: arena.num_values]
    if indices == list(range(len(targets))):
        tables = [t.installed_table() for t in targets]
        return WriteBatch(tables, meta, values, arena.may_overlap, True, arena.lease, True), list(arena.runs)
    remap = np.full(len(targets), -1, dtype=np.int32)
    remap[np.asarray(indices)] = np.arange(len(indices), dtype=np.int32)
    new_table = remap[meta[:, META_TABLE]]
    keep = new_table >= 0
    sub = meta[keep].copy()
    sub[:, META_TABLE] = new_table[keep]
    batch = WriteBatch([targets[i].installed_table() for i in indices], sub, values, arena.may_overlap, checked=True)
    return batch, remap_runs(list(arena.runs), keep)


def _storages(tables: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tables if t.numel()}


def _refuse_aliasing_across_dtypes(by_dtype: dict) -> None:
    """Tables of different dtypes over the same memory cannot keep staging order (one backend batch per dtype):
    refuse them, before anything is written."""
    seen: dict[int, torch.dtype] = {}
    for dtype, parts in by_dtype.items():
        for batch, _ in parts:
            for ptr in _storages(batch.tables):
                if seen.setdefault(ptr, dtype) != dtype:
                    raise StagedWriteError(
                        f"tables of dtypes {dtype_name(seen[ptr])} and {dtype_name(dtype)} share memory in one apply: "
                        "their writes cannot be kept in staging order; apply them in separate calls. Nothing was "
                        "written and every staged write stays staged"
                    )


def _merge(parts: list[tuple[WriteBatch, list[tuple[int, int]]]]) -> WriteBatch:
    """One batch from several batches of one dtype (tables of several arenas), writes in true staging order: each
    arena's runs sorted by the staging clock. Tables of different arenas that share memory make the batch
    `may_overlap`, so backends keep that order where they overlap."""
    metas, values, segments = [], [], []
    table_base = value_base = 0
    for i, (p, runs) in enumerate(parts):
        m = p.meta.copy()
        m[:, META_TABLE] += table_base
        m[:, META_VALUE_OFFSET] += value_base
        metas.append(m)
        values.append(p.values)
        table_base += len(p.tables)
        value_base += p.values.shape[0]
        if not runs or runs[0][1] != 0:  # writes before any recorded run: the oldest
            runs = [(0, 0), *runs]
        for j, (clock, first) in enumerate(runs):
            end = runs[j + 1][1] if j + 1 < len(runs) else p.num_writes
            if end > first:
                segments.append((clock, i, first, end))
    natural = sorted(segments, key=lambda s: (s[1], s[2]))
    segments.sort()
    storages = [_storages(p.tables) for p, _ in parts]
    shared = len(set().union(*storages)) < sum(map(len, storages))
    return WriteBatch(
        [t for p, _ in parts for t in p.tables],
        np.concatenate([metas[i][first:end] for _, i, first, end in segments]),
        np.concatenate(values),
        shared or any(p.may_overlap for p, _ in parts),
        segments == natural and all(p.values_in_order for p, _ in parts),
        checked=True,
    )
