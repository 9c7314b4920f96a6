"""`FusedStagedWriter`: applies the staged writes of many tables in one backend call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.backend import Backend, WriteBatch
from multiwrite.capture import refuse_capture
from multiwrite.dispatch import _device, select_backend
from multiwrite.errors import StagedWriteError
from multiwrite.staging import META_TABLE, META_VALUE_OFFSET, StagedWriteTensor, StagingArena, dtype_name

_SHAPE = torch.Tensor.size
_default_writers: dict[torch.device, FusedStagedWriter] = {}


class FusedStagedWriter:
    """Applies the staged writes of any number of `StagedWriteTensor`s on one device, together.

    Args:
        device: the device of every table this writer applies to (`"cuda"` means the current CUDA
            device at construction).
        backend: a backend name or instance to force; None picks the best available backend for the
            device (or `$MULTIWRITE_BACKEND` when set).

    Not thread-safe: one thread at a time per writer and per table.

    Raises:
        BackendUnavailableError: no backend can run on `device`, or the forced one cannot.
    """

    def __init__(self, device: torch.device | str, backend: str | Backend | None = None):
        self.device = _device(device)
        if isinstance(backend, Backend):
            reasons = backend.not_supported_reasons(self.device)
            if reasons:
                from multiwrite.errors import BackendUnavailableError

                raise BackendUnavailableError(
                    f"backend {backend.NAME!r} cannot run on {self.device}: {'; '.join(reasons)}"
                )
            self.backend = backend
        else:
            self.backend = select_backend(self.device, backend)
        # (tensors, arena, layout_version, tables, shapes) of the last apply, for the repeat fast path
        self._fast: tuple | None = None

    @classmethod
    def default_for(cls, device: torch.device | str) -> FusedStagedWriter:
        """A shared writer for `device` with the auto-selected backend."""
        device = _device(device)
        writer = _default_writers.get(device)
        if writer is None:
            writer = _default_writers[device] = cls(device)
        return writer

    def apply(self, tensors: Sequence[StagedWriteTensor]) -> None:
        """Apply the staged writes of all `tensors` in one backend call, then clear them.

        Writes land in staging order; where two touch the same cell the later one wins. On a GPU backend
        this enqueues one kernel launch per dtype on the current stream and returns without waiting.
        Tensors with nothing staged cost nothing; with nothing staged at all, the backend is not called.

        Raises:
            StagedWriteError: a table is on another device than the writer's, or was resized below its
                staged writes. Raised before anything is written; every staged write stays staged.
            GraphCaptureError: the current CUDA stream is capturing a graph (see `multiwrite.capture`);
                raised before anything is recorded; every staged write stays staged.
        """
        refuse_capture(self.device, "FusedStagedWriter.apply")
        fast = self._fast
        if (
            fast is not None
            and fast[0] == tuple(tensors)
            and fast[1].layout_version == fast[2]
            and list(map(_SHAPE, fast[3])) == fast[4]
        ):
            # The same tables as last time (one arena, none replaced or resized in place since): every
            # check below already passed for them; hand the staging buffers over as they are.
            arena = fast[1]
            if arena.num_writes:
                meta, values = arena.meta[: arena.num_writes], arena.values[: arena.num_values]
                self.backend.apply([WriteBatch(fast[3], meta, values, arena.may_overlap, True, arena.lender)])
                arena.clear()
                arena.rotate()
            return
        groups: dict[int, tuple[StagingArena, list[int]]] = {}
        for t in tensors:
            table = t._table
            if table.device != self.device:
                raise StagedWriteError(
                    f"{t.name} (shape {tuple(table.shape)}, {dtype_name(table.dtype)}) is on {table.device}, "
                    f"but this writer applies to {self.device}; nothing was written and its "
                    f"{t.num_staged_writes} staged writes stay staged"
                )
            if table.shape != (t._rows, t._cols):  # resized in place since staging
                t.check_staged_fit((table.shape[0], table.shape[1]))
                t._rows, t._cols = table.shape
            arena = t._arena
            entry = groups.get(id(arena))
            if entry is None:
                groups[id(arena)] = (arena, [t._index])
            else:
                entry[1].append(t._index)
        by_dtype: dict[torch.dtype, list[WriteBatch]] = {}
        for arena, indices in groups.values():
            if arena.num_writes:
                batch = _arena_batch(arena, indices)
                if batch.num_writes:
                    by_dtype.setdefault(batch.dtype, []).append(batch)
        if by_dtype:
            self.backend.apply([parts[0] if len(parts) == 1 else _merge(parts) for parts in by_dtype.values()])
        for arena, indices in groups.values():
            if arena.num_writes:
                arena.drop_tables(indices)
        self._fast = None
        if len(groups) == 1:
            arena, indices = next(iter(groups.values()))
            if indices == list(range(len(arena.targets))):
                if arena.lender is None and arena.num_writes == 0:
                    lender = self.backend.staging_buffers(self.device, arena.np_dtype)
                    if lender is not None:
                        arena.attach(lender)
                tables = [t._table for t in arena.targets]
                self._fast = (tuple(tensors), arena, arena.layout_version, tables, list(map(_SHAPE, tables)))

    def forget(self) -> None:
        """Drop the references the repeat fast path keeps to the tables of the last apply."""
        self._fast = None

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, backend={self.backend.NAME!r})"


def _arena_batch(arena: StagingArena, indices: list[int]) -> WriteBatch:
    """The writes of `indices` (tables of `arena`), as a batch whose tables are in `indices` order."""
    targets = arena.targets
    meta = arena.meta[: arena.num_writes]
    values = arena.values[: arena.num_values]
    if len(indices) == len(targets) and indices == list(range(len(targets))):
        return WriteBatch([t._table for t in targets], meta, values, arena.may_overlap, True)
    remap = np.full(len(targets), -1, dtype=np.int32)
    remap[np.asarray(indices)] = np.arange(len(indices), dtype=np.int32)
    new_table = remap[meta[:, META_TABLE]]
    sub = meta[new_table >= 0].copy()
    sub[:, META_TABLE] = new_table[new_table >= 0]
    return WriteBatch(
        [targets[i]._table for i in indices],
        sub,
        values,
        arena.may_overlap,
    )


def _merge(parts: list[WriteBatch]) -> WriteBatch:
    """One batch from several batches of one dtype (tables of several arenas)."""
    metas, values = [], []
    table_base = value_base = 0
    for p in parts:
        m = p.meta.copy()
        m[:, META_TABLE] += table_base
        m[:, META_VALUE_OFFSET] += value_base
        metas.append(m)
        values.append(p.values)
        table_base += len(p.tables)
        value_base += p.values.shape[0]
    return WriteBatch(
        [t for p in parts for t in p.tables],
        np.concatenate(metas),
        np.concatenate(values),
        any(p.may_overlap for p in parts),
        all(p.values_in_order for p in parts),
    )
