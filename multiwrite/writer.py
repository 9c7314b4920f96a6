"""`FusedStagedWriter`: applies the staged writes of many tables in one backend call."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import torch

from multiwrite.backend import Backend, WriteBatch
from multiwrite.capture import refuse_capture
from multiwrite.dispatch import _device, select_backend
from multiwrite.errors import BackendError, BackendUnavailableError, StagedWriteError
from multiwrite.staging import (
    META_TABLE,
    META_VALUE_OFFSET,
    StagedWriteTensor,
    StagingArena,
    dtype_name,
    remap_runs,
    shape_text,
    table_layout,
)

_LAYOUT = table_layout
_local = threading.local()  # each thread's shared writers (`default_for`): a writer is not thread-safe


class FusedStagedWriter:
    """Applies the staged writes of any number of `StagedWriteTensor`s on one device, together.

    Args:
        device: the device of every table this writer applies to (`"cuda"` means the current CUDA
            device at construction).
        backend: a backend name or instance to force; None picks the best available backend for the
            device (or `$MULTIWRITE_BACKEND` when set).

    Not thread-safe: one thread at a time per writer and per table. Distinct writers with distinct
    tables may be used from distinct threads at once (see the README's thread-safety section).

    Raises:
        BackendUnavailableError: no backend can run on `device`, or the forced one cannot.
    """

    def __init__(self, device: torch.device | str, backend: str | Backend | None = None):
        self.device = _device(device)
        if isinstance(backend, Backend):
            reasons = backend.not_supported_reasons(self.device)
            if reasons:
                raise BackendUnavailableError(
                    f"backend {backend.NAME!r} cannot run on {self.device}: {'; '.join(reasons)}"
                )
            self.backend = backend
        else:
            self.backend = select_backend(self.device, backend)
        # The repeat fast path, set after an apply of every table of one arena: (tensors, arena, its
        # layout_version, the 2-D tables, the user tensors, their version counter, their layouts).
        self._fast: tuple | None = None
        # Set by `BlockTables.prepare_inputs` for one apply: the backend call of that apply is then
        # `backend.prepare_inputs(batches, stage)` (and clears this), not `backend.apply(batches)`.
        self._stage = None

    @classmethod
    def default_for(cls, device: torch.device | str) -> FusedStagedWriter:
        """This thread's shared writer for `device`, with the auto-selected backend."""
        device = _device(device)
        writers = getattr(_local, "writers", None)
        if writers is None:
            writers = _local.writers = {}
        writer = writers.get(device)
        if writer is None:
            writer = writers[device] = cls(device)
        return writer

    def apply(self, tensors: Iterable[StagedWriteTensor]) -> None:
        """Apply the staged writes of all `tensors` in one backend call, then clear them.

        `tensors` is any iterable (read once); a table listed twice counts once. Writes land in staging
        order, also across tables that share memory (views of one tensor: the write staged later wins
        where two touch the same cell). On a GPU backend this enqueues one kernel launch per dtype on
        the current stream and returns without waiting. Tensors with nothing staged cost nothing; with
        nothing staged at all, the backend is not called.

        Raises:
            TypeError: an item is not a `StagedWriteTensor` (the message names its position and type).
            StagedWriteError: a table is on another device than the writer's, was resized below its
                staged writes, is a `BlockTables` group resized in place, or shares memory with a table
                of another dtype in the same call. Raised before anything is written; every staged
                write stays staged.
            GraphCaptureError: the current CUDA stream is capturing a graph (see `multiwrite.capture`);
                raised before anything is recorded; every staged write stays staged.
            BackendError: the backend raised (its exception is the cause); every write of this call
                stays staged, and applying again lands them (see `Backend.apply`).
        """
        if self._stage is None:  # (`BlockTables.prepare_inputs` has just checked, naming itself)
            refuse_capture(self.device, "FusedStagedWriter.apply")
        if type(tensors) is not list:
            tensors = list(tensors)
        fast = self._fast
        if fast is not None:
            try:  # identical items compare by identity; anything else (a numpy array...) is not the same
                if not (fast[0] == tensors and fast[1].layout_version == fast[2]):
                    fast = None
            except Exception:
                fast = None
        if fast is not None:
            users = fast[4]
            try:
                same = users[0]._version == fast[5]
            except RuntimeError:  # inference tensors track no version: compare the layouts
                same = False
            if not same and fast[1].frozen is not None:
                _check_frozen(fast[1])  # a BlockTables resized in place: refused, before anything is written
            if not same and list(map(_LAYOUT, users)) == fast[6]:
                same = True  # written in place by torch ops, same storage, shape and strides
                try:
                    self._fast = fast = (*fast[:5], users[0]._version, fast[6])
                except RuntimeError:
                    pass
            if same:
                # The same tables as last time (one arena, none replaced or resized since): every check
                # below already passed for them; hand the staging buffers over as they are.
                arena = fast[1]
                if arena.num_writes:
                    meta, values = arena.meta[: arena.num_writes], arena.values[: arena.num_values]
                    batch = WriteBatch(fast[3], meta, values, arena.may_overlap, True, arena.lender)
                    self._call_backend([batch], tensors)
                    arena.clear()
                    arena.rotate()
                return
        self._fast = None
        groups: dict[int, tuple[StagingArena, list[int]]] = {}
        for position, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(
                    f"FusedStagedWriter.apply: item {position} is a {type(t).__module__}.{type(t).__qualname__}, "
                    "not a StagedWriteTensor; nothing was written"
                )
            table = t._current_table()
            if table.device != self.device:
                raise StagedWriteError(
                    f"{t.name} (shape {shape_text(t.shape)}, {dtype_name(table.dtype)}) is on {table.device}, "
                    f"but this writer applies to {self.device}; nothing was written and its "
                    f"{t.num_staged_writes} staged writes stay staged"
                )
            arena = t._arena
            entry = groups.get(id(arena))
            if entry is None:
                if arena.frozen is not None:
                    _check_frozen(arena)
                    if getattr(arena.lender, "graph_stage", None) is not None:
                        raise StagedWriteError(
                            f"{t.name} belongs to a BlockTables created with cuda_graphs=True: its writes are applied "
                            "in commit order by BlockTables.apply_staged_writes() or a graph replay, never by a "
                            "writer directly. Nothing was written and every staged write stays staged"
                        )
                groups[id(arena)] = (arena, [t._index])
            elif t._index in entry[1]:
                continue  # listed twice
            else:
                entry[1].append(t._index)
            if table.shape != (t._rows, t._cols):  # resized since the last check: do the staged writes fit?
                t.check_staged_fit((table.shape[0], table.shape[1]))
                t._rows, t._cols = table.shape
        by_dtype: dict[torch.dtype, list[tuple[WriteBatch, list[tuple[int, int]]]]] = {}
        for arena, indices in groups.values():
            if arena.num_writes:
                batch, runs = _arena_batch(arena, indices)
                if batch.num_writes:
                    by_dtype.setdefault(batch.dtype, []).append((batch, runs))
        if len(by_dtype) > 1:
            _refuse_aliasing_across_dtypes(by_dtype)
        if by_dtype:
            self._call_backend(
                [parts[0][0] if len(parts) == 1 else _merge(parts) for parts in by_dtype.values()], tensors
            )
        for arena, indices in groups.values():
            if arena.num_writes:
                arena.drop_tables(indices)
        if len(groups) == 1:
            arena, indices = next(iter(groups.values()))
            if indices == list(range(len(arena.targets))):
                if arena.lender is None and arena.num_writes == 0:
                    lender = self.backend.staging_buffers(self.device, arena.np_dtype)
                    if lender is not None:
                        arena.attach(lender)
                tables = [t._table for t in arena.targets]
                users = [t._user_tensor for t in arena.targets]
                try:
                    version = users[0]._version
                except RuntimeError:
                    version = -1
                self._fast = (list(tensors), arena, arena.layout_version, tables, users, version,
                              list(map(_LAYOUT, users)))  # fmt: skip

    def _call_backend(self, batches: list[WriteBatch], tensors: list[StagedWriteTensor]) -> None:
        """`backend.apply(batches)`, any exception wrapped in a `BackendError` naming backend and tables."""
        stage = self._stage
        try:
            if stage is None:
                self.backend.apply(batches)
            else:
                self._stage = None  # exactly one backend call takes the stage
                self.backend.prepare_inputs(batches, stage)
        except Exception as exc:
            raise backend_error(self.backend, self.device, tensors, sum(b.num_writes for b in batches), exc) from exc

    def forget(self) -> None:
        """Drop the references the repeat fast path keeps to the tables of the last apply."""
        self._fast = None

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, backend={self.backend.NAME!r})"


def backend_error(
    backend: Backend, device: torch.device, tensors: Iterable[StagedWriteTensor], writes: int, exc: Exception
) -> BackendError:
    """The `BackendError` of a failed backend call applying `writes` staged writes to `tensors` on `device`:
    names the backend (name and class), the tables (in argument order, each once) and `exc`, and says that every
    staged write is still staged. The caller raises it `from exc`."""
    names = tuple(dict.fromkeys(t.name for t in tensors))
    return BackendError(
        f"backend {backend.NAME!r} ({type(backend).__module__}.{type(backend).__qualname__}) "
        f"failed applying {writes} staged writes to {', '.join(names)} on {device}: "
        f"{type(exc).__name__}: {exc}. The tables may hold part of the writes; every staged write is "
        "still staged, and applying again lands them all",
        backend,
        names,
    )


def apply_writes(*tables: StagedWriteTensor) -> None:
    """Apply the staged writes of `tables` now, through this thread's shared writer of their device
    (the auto-selected backend), keeping no reference to them afterwards.

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
        writer = FusedStagedWriter.default_for(device)
        try:
            writer.apply(group)
        finally:
            writer.forget()  # the shared writer must not keep these tables alive


def _check_frozen(arena: StagingArena) -> None:
    """Refuse an arena whose owner (`BlockTables`) fixed its tables' layouts, when one changed."""
    assert arena.frozen is not None
    for tensor, layout, what in arena.frozen:
        now = _LAYOUT(tensor)
        if now != layout:
            change = (
                f"shape {shape_text(layout[1])} -> {shape_text(now[1])}"
                if now[1] != layout[1]
                else f"strides {layout[2]} -> {now[2]}"
                if now[2] != layout[2]
                else "moved to other memory (set_ or a storage resize)"
            )
            raise StagedWriteError(
                f"{what} was resized in place ({change}): a BlockTables' tables cannot be resized, its tables "
                "and num_blocks share one allocation; build a new BlockTables with the new sizes. Nothing was "
                "written and every staged write stays staged"
            )


def _arena_batch(arena: StagingArena, indices: list[int]) -> tuple[WriteBatch, list[tuple[int, int]]]:
    """The writes of `indices` (tables of `arena`), as a batch whose tables are in `indices` order, and
    their runs on the staging clock `(clock, first write of the batch)`."""
    targets = arena.targets
    meta = arena.meta[: arena.num_writes]
    values = arena.values[: arena.num_values]
    if len(indices) == len(targets) and indices == list(range(len(targets))):
        return WriteBatch([t._table for t in targets], meta, values, arena.may_overlap, True), arena.runs
    remap = np.full(len(targets), -1, dtype=np.int32)
    remap[np.asarray(indices)] = np.arange(len(indices), dtype=np.int32)
    new_table = remap[meta[:, META_TABLE]]
    keep = new_table >= 0
    sub = meta[keep].copy()
    sub[:, META_TABLE] = new_table[keep]
    batch = WriteBatch([targets[i]._table for i in indices], sub, values, arena.may_overlap)
    return batch, remap_runs(arena.runs, keep)


def _storages(tables: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tables if t.numel()}


def _refuse_aliasing_across_dtypes(by_dtype: dict) -> None:
    """Tables of different dtypes over the same memory cannot keep staging order (one backend batch per
    dtype): refuse them, before anything is written."""
    seen: dict[int, tuple[torch.dtype, torch.Tensor]] = {}
    for dtype, parts in by_dtype.items():
        for batch, _ in parts:
            for t in batch.tables:
                if not t.numel():
                    continue
                ptr = t.untyped_storage().data_ptr()
                other = seen.setdefault(ptr, (dtype, t))
                if other[0] != dtype:
                    raise StagedWriteError(
                        f"tables of dtypes {dtype_name(other[0])} and {dtype_name(dtype)} share memory in one apply: "
                        "their writes cannot be kept in staging order; apply them in separate calls. Nothing was "
                        "written and every staged write stays staged"
                    )


def _merge(parts: list[tuple[WriteBatch, list[tuple[int, int]]]]) -> WriteBatch:
    """One batch from several batches of one dtype (tables of several arenas), writes in true staging
    order: each arena's runs sorted by the staging clock. Tables of different arenas that share memory
    make the batch `may_overlap`, so backends keep that order where they overlap."""
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
        if not runs or runs[0][1] != 0:  # (never expected) writes before any recorded run: oldest
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
    )
