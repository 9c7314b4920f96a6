"""The staging arena: staged writes of one or more tables of one dtype, in staging order, in memory a kernel can
read in place; the memory it stages into (a `Lease`) and who lends it (`StagingBuffers`)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StagedWriteError, TableMovedError
from multiwrite.staging.fields import CLOCK, ArenaFields, LeaseFields
from multiwrite.staging.layout import META_COLUMNS, META_LENGTH, META_ROW, META_TABLE, META_VALUE_OFFSET

_uids = itertools.count(1)


class Lease(LeaseFields):
    """Staging memory: metadata int32 `[meta_cap, 5]` and values `[values_cap]` (numpy arrays over host memory,
    pinned where a kernel reads them in place), with optional overlap-round bounds (int32 `[meta_cap + 1]`) and,
    for memory a kernel reads in place, its completion word (`done_addr`) and token.

    Args:
        meta, values: the arrays (C-contiguous).
        bounds: int32 array for the first write of each overlap round, or None.
        done_addr: address of the int32 word a kernel stores its token into when it has read this memory (0: none).
        slot: the lender's index of this memory (-1: not lent).
        lender: the `StagingBuffers` that lent it, or None.
    """

    __slots__ = ("meta", "values", "meta_bytes", "values_flat", "bounds", "lender", "keep", "launches")

    def __init__(
        self,
        meta: np.ndarray,
        values: np.ndarray,
        bounds: np.ndarray | None = None,
        done_addr: int = 0,
        slot: int = -1,
        lender: StagingBuffers | None = None,
    ):
        super().__init__()  # (the Python twin of the fields sets its defaults; the C type has nothing to do)
        self.meta, self.values, self.bounds, self.lender = meta, values, bounds, lender
        self.keep: object = None  # what the launch reading this memory needs alive until it is released
        self.launches = 0  # launches known to have been issued on this memory (a lender counts them)
        self.meta_bytes = meta.data.cast("B")
        self.values_flat = values.data
        self.meta_addr, self.values_addr = meta.ctypes.data, values.ctypes.data
        self.bounds_addr = 0 if bounds is None else bounds.ctypes.data
        self.meta_cap, self.values_cap = meta.shape[0], values.shape[0]
        self.done_addr, self.slot = done_addr, slot

    @classmethod
    def plain(cls, np_dtype: type[np.generic], write_capacity: int, value_capacity: int) -> Lease:
        """Plain numpy arrays of the capacities given, nobody's but the arena's."""
        meta = np.zeros((write_capacity, META_COLUMNS), np.int32)
        return cls(meta, np.zeros(value_capacity, np_dtype), np.zeros(write_capacity + 1, np.int32))


class StagingBuffers:
    """Lends a `StagingArena` the memory it stages into: memory a backend's kernels read in place (pinned host
    memory a GPU reads over unified virtual addressing), so that an apply hands the staged writes over without a
    copy. `Backend.staging_buffers` returns one; the default, no lender, stages into plain numpy arrays.

    An apply that hands the arena's lease to a kernel first takes the NEXT lease (`acquire`), then launches, then
    lands the arena on it: so nothing can fail after the launch, and a failure before it changes nothing.
    """

    def acquire(self, write_capacity: int, value_capacity: int, why: Callable[[str], str] | None = None) -> Lease:
        """Memory no launched kernel reads, with room for `write_capacity` writes and `value_capacity` values
        (waits while a kernel still reads it; `why(how long)`, when given, is the message of a long wait). Raises,
        having lent nothing, when it cannot."""
        raise NotImplementedError

    def grow(self, lease: Lease, write_capacity: int, value_capacity: int) -> Lease:
        """Larger memory replacing `lease` (staged into, not launched); the arena copies what it staged."""
        raise NotImplementedError

    def release(self, lease: Lease) -> None:
        """`lease`, acquired and never staged into nor launched, goes back (an apply that failed before its
        launch)."""

    def handed_over(self, lease: Lease) -> None:
        """`lease` (an arena's memory, perhaps grown since it was lent) is about to be read by a kernel: a launch,
        or a graph-mode publish that a consume kernel reads. A lender whose slots are guarded by completion words
        records it as the memory its slot's word now guards (the next `acquire` of that slot waits on it)."""

    def close(self) -> None:
        """The arena is being destroyed: its memory may be freed once no launched kernel reads it."""


class LayoutGuard:
    """The tables of an owner that never resizes or moves them (a `BlockTables`): the check that they were not resized
    or `set_` in place since (`check`: one read of their shared storage's version counter in the common case), and
    the check that none was re-pointed to other memory (`check_addresses`: one `data_ptr()` each; `tensor.data =
    other` keeps the version counter, so only the address shows it).

    Args:
        tables: `(tensor, what)` pairs, every tensor a view of `base`.
        base: the allocation they are views of.
        why: why they cannot move, for the message.
        since: what a re-pointing found by `check_addresses` may have cost before it was found, for the message.
    """

    __slots__ = ("tables", "tensors", "layouts", "addresses", "base", "version", "why", "since")

    def __init__(self, tables: Sequence[tuple[Any, str]], base: Any, why: str = "", since: str = "") -> None:
        self.tables = list(tables)
        self.tensors = [t for t, _ in self.tables]
        self.layouts = [_layout(t) for t in self.tensors]
        self.addresses = [layout[0] for layout in self.layouts]  # (as `list(map(_PTR, tensors))` reads them)
        self.base = base
        self.version = _version(base)
        self.why = why or "they share one allocation"
        self.since = since

    def check(self) -> None:  # (callers may read `base._version != version` first: the check's own fast path)
        """Raise `StagedWriteError` naming the table and the change if one was resized or moved."""
        version = _version(self.base)
        if version == self.version and version >= 0:
            return
        for (tensor, what), layout in zip(self.tables, self.layouts):
            now = _layout(tensor)
            if now != layout:
                change = (
                    f"shape {tuple(layout[1])} -> {tuple(now[1])}" if now[1] != layout[1]
                    else f"strides {layout[2]} -> {now[2]}" if now[2] != layout[2]
                    else "moved to other memory (set_, a storage resize, or tensor.data = ... and a write)"
                )  # fmt: skip
                raise StagedWriteError(
                    f"{what} was resized in place ({change}): it cannot be resized or moved, {self.why}; build a new "
                    "BlockTables with the new sizes. Nothing was written and every staged write stays staged"
                )
        self.version = version  # written in place by torch ops: same storage, shape and strides

    def check_addresses(self, call: str) -> None:
        """Raise `TableMovedError` naming the first tensor whose `data_ptr()` is not the one it had at construction,
        both addresses, and `call` (the method that found it). One `data_ptr()` per tensor when none moved.

        (Only the address: a resize or `set_` in place, which changes the shape or strides, is `check`'s; a tensor
        re-pointed at its own address with another shape still has the memory the kernels write.)
        """
        if list(map(_PTR, self.tensors)) == self.addresses:
            return
        for (tensor, what), old in zip(self.tables, self.addresses):
            new = tensor.data_ptr()
            if new != old:
                raise TableMovedError(
                    f"{call}: {what} was re-pointed to other memory (tensor.data = ... or the like): its address was "
                    f"{old:#x} at construction and is {new:#x} now (shape {tuple(tensor.shape)}). What keeps the "
                    f"addresses of construction (the Triton backends' descriptors, every captured launch) keeps "
                    f"reading and writing the memory at {old:#x}: {self.since}. It cannot be re-pointed, {self.why}. "
                    "Nothing of this call was staged, written or recorded and every staged write stays staged: point "
                    "it back (tensor.data = the original tensor) and they land, or build a new BlockTables",
                    what, old, new,
                )  # fmt: skip


_PTR = torch.Tensor.data_ptr


def _layout(t: Any) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride()


def _version(t: Any) -> int:
    """The version counter shared by `t` and its views (every in-place op bumps it), or -1 for inference tensors."""
    try:
        return t._version
    except RuntimeError:
        return -1


class StagingArena(ArenaFields):
    """Staged writes of one or more tables of one dtype, in staging order, in the memory of its `lease`.

    Values are appended in staging order with no gaps: write `w`'s value offset is the sum of the lengths of the
    writes before it. `meta[:num_writes]` holds one int32 row per write with the `META_*` columns,
    `values[:num_values]` the values. `may_overlap` turns true once two staged writes hit the same row of the same
    table (backends must then keep staging order where they overlap). `batch` is the number of the staged batch:
    it grows by one at every `clear` and `land` (the overlap epoch of `BlockTables`).

    Args:
        np_dtype: numpy dtype of the values.
        write_capacity, value_capacity: initial room (grows geometrically).
        lender: lends the memory (`StagingBuffers`), or None for plain numpy arrays.
    """

    __slots__ = ("np_dtype", "targets", "lender", "stamped", "guard", "refusal", "__weakref__")

    #: `pack_meta(meta_bytes, write_index * 20, table, row, start, length, value_offset)` stores one metadata row
    #: in one C call, raising `struct.error` when a field overflows int32.
    pack_meta = staticmethod(struct.Struct(f"{META_COLUMNS}i").pack_into)

    def __init__(
        self,
        np_dtype: type[np.generic],
        write_capacity: int = 64,
        value_capacity: int = 1024,
        lender: StagingBuffers | None = None,
    ):
        super().__init__()  # (as for Lease)
        self.np_dtype = np_dtype
        self.uid = next(_uids)
        self.lender = lender
        self.adopt(Lease.plain(np_dtype, write_capacity, value_capacity) if lender is None
                   else lender.acquire(write_capacity, value_capacity))  # fmt: skip
        self.targets: list[Any] = []  # the `StagedWriteTensor`s that stage here, in table-index order
        # True when an owner (BlockTables) detects overlaps of its own writes: a write staged through `commit`
        # then always counts as overlapping (correct, merely slower to apply).
        self.stamped = False
        self.guard: LayoutGuard | None = None  # the owner's tables never resize (BlockTables)
        self.refusal: str | None = None  # why a FusedStagedWriter must not apply these tables (graph mode)

    @property
    def meta(self) -> np.ndarray:
        """int32 `[meta_cap, 5]`: the staged metadata rows are `meta[:num_writes]`."""
        return self.lease.meta

    @property
    def values(self) -> np.ndarray:
        """`[values_cap]`: the staged values are `values[:num_values]`."""
        return self.lease.values

    def attach(self, lender: StagingBuffers) -> None:
        """Stage into `lender`'s memory from now on (the arena must be empty)."""
        assert self.num_writes == 0, "attach a lender to an empty arena"
        self.adopt(lender.acquire(self.meta_cap, self.values_cap))
        self.lender = lender

    def next_lease(self, why: Callable[[str], str] | None = None) -> Lease | None:
        """The lease to land on after an apply hands the current one to a kernel (from the lender: may wait; `why`
        describes the wait to a caller that knows better what it waits for), or None when there is no lender (the
        arena keeps its arrays). It is taken as large as it is: staging grows it when a batch needs more (after a
        prefill burst the next decode steps never pay for memory they do not use).

        Never the arena's own lease: an apply interrupted after the lender handed it a lease and before it could
        use or return it leaves the lender one lease ahead, and a lender of two leases then comes round to the one
        the arena stages into; that one is passed by (landing on it would let the next step's staging rewrite
        memory the kernel just launched still reads)."""
        lender = self.lender
        if lender is None:
            return None
        lease = lender.acquire(0, 0, why)
        own = self.lease  # (by slot too: the arena's lease may be a grown copy of the lender's record of it)
        if lease is own or 0 <= lease.slot == own.slot:
            lease = lender.acquire(0, 0, why)
        return lease

    def land_after(self, launch: Callable[..., None], *args: Any) -> None:
        """Hand the staged batch to `launch(lease, *args)`, which applies it from the arena's lease, then land on the
        next lease (taken first, so that nothing can fail once the batch is applied). When `launch` raises, the arena
        is as before (the next lease goes back, every write stays staged), unless a kernel was launched on the lease
        (`lease.launches` counts launches issued, also those an interrupt cut short): then the batch has landed and
        so does the arena. An interrupt at any point leaves one of the two: landed (launched) or staged (not)."""
        lease = self.lease
        launches = lease.launches
        nxt = None
        try:
            nxt = self.next_lease()
            launch(lease, *args)
        except BaseException:
            if lease.launches != launches:
                self.land(nxt)  # (None when the interrupt came before the next lease: the arena keeps its lease)
            elif nxt is not None:
                self.lender.release(nxt)
            raise
        self.land(nxt)

    def add_target(self, target: Any) -> int:
        """Register a table that stages here; returns its table index in this arena's metadata."""
        if len(self.targets) >= 1 << 16:
            raise StagedWriteError("a staging arena holds at most 65536 tables")
        self.targets.append(target)
        return len(self.targets) - 1

    def reserve(self, writes: int, values: int) -> None:
        """Make room for `writes` more writes and `values` more values (geometric growth; the staged writes are
        copied over, and nothing changes if the new memory cannot be had)."""
        w_cap, v_cap = self.meta_cap, self.values_cap
        if self.num_writes + writes <= w_cap and self.num_values + values <= v_cap:
            return
        if self.num_writes + writes > w_cap:
            w_cap = max(self.num_writes + writes, 2 * w_cap)
        if self.num_values + values > v_cap:
            v_cap = max(self.num_values + values, 2 * v_cap)
        old = self.lease
        lease = Lease.plain(self.np_dtype, w_cap, v_cap) if self.lender is None else self.lender.grow(old, w_cap, v_cap)
        lease.meta[: old.meta.shape[0]] = old.meta  # the rows of a call being staged (not yet counted) too
        lease.values[: old.values.shape[0]] = old.values
        self.adopt(lease)

    def __del__(self) -> None:
        lender = getattr(self, "lender", None)
        if lender is not None:
            lender.close()

    def push(self, table: int, row: int, start: int, values: Any, length: int) -> None:
        """Append one write whose row, start and length were validated. `values` is a list, tuple or numpy array;
        a value the dtype cannot hold raises (TypeError, ValueError or OverflowError) and then nothing is staged:
        the counters move only after every store succeeded."""
        self.reserve(1, length)
        v0 = self.num_values
        if length:
            if length <= 8 and not isinstance(values, np.ndarray):
                flat = self.lease.values_flat
                for i, v in enumerate(values, v0):
                    flat[i] = v
            else:
                self.lease.values[v0 : v0 + length] = values
        self.commit(table, row, start, length, v0)

    def commit(self, table: int, row: int, start: int, length: int, value_offset: int) -> None:
        """Record the metadata of a write whose values already sit at `values[value_offset:]`."""
        self.reserve(1, 0)
        if CLOCK[0] != self.uid:
            self.begin_run()
        self.pack_meta(self.lease.meta_bytes, self.num_writes * META_COLUMNS * 4, table, row, start, length,
                       value_offset)  # fmt: skip
        key = row << 16 | table
        if key in self.rows_seen or self.stamped:
            self.may_overlap = True
        else:
            self.rows_seen.add(key)
        self.num_writes += 1
        self.num_values = value_offset + length

    def order_rounds(self) -> int:
        """Reorder the staged metadata in place into overlap rounds (`overlap_rounds`: later writes to a (table, row)
        land in later rounds; order within one is kept, so the result is unchanged), write each round's first write
        into the lease's bounds, and return the number of rounds. The writes then form one run on the clock."""
        w = self.num_writes
        meta = self.meta[:w]
        perm, bounds = overlap_rounds(meta)
        meta[:] = meta[perm]
        self.lease.bounds[: bounds.shape[0]] = bounds
        del self.runs[1:]
        if self.runs:
            self.runs[0] = (self.runs[0][0], 0)
        return bounds.shape[0] - 1

    def count_for(self, table: int) -> int:
        """Number of staged writes of one table."""
        if len(self.targets) == 1:
            return self.num_writes
        return int(np.count_nonzero(self.meta[: self.num_writes, META_TABLE] == table))

    def drop_tables(self, tables: Sequence[int]) -> None:
        """Drop the staged writes of some tables, keeping the others' in staging order (and gap-free)."""
        if len(tables) == len(self.targets):
            self.clear()
            return
        meta = self.meta[: self.num_writes]
        keep = ~np.isin(meta[:, META_TABLE], np.asarray(tables, dtype=np.int32))
        kept = meta[keep]
        runs = remap_runs(list(self.runs), keep)
        lengths = kept[:, META_LENGTH].astype(np.int64)
        new_offsets = np.cumsum(lengths) - lengths
        gather = np.repeat(kept[:, META_VALUE_OFFSET].astype(np.int64) - new_offsets, lengths)
        gather += np.arange(int(lengths.sum()))
        values = self.values
        values[: gather.size] = values[gather]
        kept[:, META_VALUE_OFFSET] = new_offsets
        self.meta[: kept.shape[0]] = kept
        rows = set(((kept[:, META_ROW].astype(np.int64) << 16) | kept[:, META_TABLE]).tolist())
        self.num_writes, self.num_values = kept.shape[0], int(gather.size)
        self.may_overlap = self.stamped or len(rows) < kept.shape[0]
        self.rows_seen.clear()
        self.rows_seen.update(rows)
        self.runs[:] = runs  # (the batch number stays: the kept writes' stamps still count)
        if CLOCK[0] == self.uid:  # the next write starts a run of its own (writes were taken out before it)
            CLOCK[0] = 0


def remap_runs(runs: list[tuple[int, int]], keep: np.ndarray) -> list[tuple[int, int]]:
    """The runs `(clock, first write)` of an arena's writes after keeping only the writes where `keep` (bool
    `[num_writes]`) is true; runs left with no writes are dropped."""
    if not runs:
        return []
    before = np.concatenate(([0], np.cumsum(keep)))
    moved = [(clock, int(before[first])) for clock, first in runs]
    n = int(before[-1])  # a run left with no writes starts where the next one does, or at the end
    return [r for i, r in enumerate(moved) if r[1] < n and (i + 1 == len(moved) or moved[i + 1][1] != r[1])]


def overlap_rounds(meta: np.ndarray, sequential: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """How to apply writes that may overlap in independent rounds, the later write winning.

    A write's round is its occurrence index among the writes to the same (table, row); writes are stable-sorted by
    round, so round r's writes touch distinct rows and may land in any order. With `sequential` (tables sharing
    memory, where writes to different (table, row) pairs may still hit one cell) every write is a round of its own.

    Returns:
        (the permutation of the writes, int32 `[num_rounds + 1]` first write of each round, then the count).
    """
    w = meta.shape[0]
    if sequential or w == 0:
        return np.arange(w), np.arange(w + 1, dtype=np.int32)
    key = (meta[:, META_TABLE].astype(np.int64) << 32) | meta[:, META_ROW].astype(np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    first = np.empty(w, dtype=bool)
    first[0] = True
    np.not_equal(sk[1:], sk[:-1], out=first[1:])
    group_start = np.maximum.accumulate(np.where(first, np.arange(w), 0))
    rounds = np.empty(w, dtype=np.int64)
    rounds[order] = np.arange(w) - group_start
    perm = np.argsort(rounds, kind="stable")
    counts = np.bincount(rounds)
    bounds = np.zeros(counts.shape[0] + 1, dtype=np.int32)
    np.cumsum(counts, out=bounds[1:])
    return perm, bounds
