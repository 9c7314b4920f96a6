"""`TritonDevice`: what the Triton backends keep per device, and the one launch sequence every launch that reads
staging memory goes through (`launch_on`)."""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from multiwrite.backends.triton.kernels import apply, consume, stage
from multiwrite.backends.triton.launcher import Launcher, get_device, get_stream
from multiwrite.backends.triton.ring import SlotRing
from multiwrite.capture import settle, setup_calls
from multiwrite.plugins.backend import WriteBatch
from multiwrite.staging.arena import Lease, overlap_rounds
from multiwrite.staging.fields import _cstaging
from multiwrite.staging.table import self_overlaps

#: The apply kernel's preloaded batch size, as a plain int.
_PRELOADED = apply.PRELOADED_VALUES.value
#: Descriptor tables of `WriteBatch` applies kept per device (each `[num_tables, 5]` int64 on the device).
DESCRIPTOR_CACHE_SIZE = 64


def py_apply_grid(num_writes: int, num_values: int, rounds: int, tiling: tuple[int, int, int, int, int],
                  max_programs: int) -> tuple[int, int]:
    """`(tiles, column splits)`: the apply programs of a batch of `num_writes` writes and `num_values` values in
    `rounds` overlap rounds, `tiling = (decode_w, tile_w, preloaded, tile_l, max_splits)`. Overlapping rounds: one
    program (it applies them in order). A decode batch (`num_values <= preloaded`): tiles of `decode_w` writes,
    unsplit. Else tiles of `tile_w` writes, each split into runs of `tile_l` cells, at most `max_splits` and
    `max_programs` programs in all. `apply_grid` is `_cstaging.apply_grid` where that helper is built (the compiled
    stage entry tiles with the same C function), else this twin."""
    if rounds > 1:
        return 1, 1
    decode_w, tile_w, preloaded, tile_l, max_splits = tiling
    if num_values <= preloaded:
        return -(-num_writes // decode_w), 1
    tiles = -(-num_writes // tile_w)
    return tiles, max(1, min(-(-num_values // tile_l), max_splits, max_programs // max(tiles, 1)))


apply_grid = py_apply_grid if _cstaging is None else _cstaging.apply_grid


class LaunchParams(NamedTuple):
    """Launch parameters of one target family: `num_warps * warp_size` threads per program (at most 1024), tiles of
    `block_w` writes x `block_l` cells (a multiple of the wavefront, so a row's cells load as whole runs), at most
    `max_splits` column splits per tile; a decode-sized batch uses tiles of `decode_block_w` x `decode_block_l`, so
    that one program (no completion counter) takes all its writes."""

    num_warps: int
    warp_size: int
    block_w: int
    block_l: int
    max_splits: int
    decode_block_w: int = 128
    decode_block_l: int = 8


class Descriptors(NamedTuple):
    """The device descriptor table of some tables (base address, row stride, column stride, rows, columns)."""

    tensor: torch.Tensor
    addr: int
    num_tables: int
    aliased: bool  #: two of the tables' memory extents intersect: writes must land strictly in staging order


def descriptor_rows(tables: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int, int]]:
    """The five descriptor words of each table."""
    return [(t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1]) for t in tables]


def tables_alias(tables: Sequence[torch.Tensor]) -> bool:
    """Whether the memory extents of any two `tables` intersect, or a table's own cells overlap (writes to different
    (table, row) pairs, or rows, may then hit one cell). Disjoint slices of one allocation, as the groups of a
    `BlockTables`, do not alias."""
    extents = []
    for t in tables:
        if t.numel() == 0:
            continue
        if self_overlaps(t if t.dim() == 2 else t.unsqueeze(1)):
            return True
        lo = hi = 0
        for size, stride in zip(t.shape, t.stride()):
            reach = (size - 1) * stride
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        base, item = t.data_ptr(), t.element_size()
        extents.append((base + lo * item, base + (hi + 1) * item))
    extents.sort()
    return any(nxt[0] < cur[1] for cur, nxt in zip(extents, extents[1:]))


class TritonDevice:
    """One device's state of a Triton backend: launch parameters, staging rings, descriptors, launchers.

    Args:
        device: a CUDA/HIP device, or a CPU device when the kernels run through Triton's interpreter.
        params: the launch parameters.
        ring_depth: slots per staging ring (>= 2); default `$MULTIWRITE_TRITON_RING_DEPTH` or 8.
        launcher: `"auto"` (bind Triton's C launcher directly on NVIDIA, else `CompiledKernel.run`), `"run"` or
            `"jit"` (always Triton's JIT launch); default `$MULTIWRITE_TRITON_LAUNCHER` or `"auto"`.

    Threads: distinct arenas may be applied from distinct threads at once: a batch staged in a ring lent to its arena
    touches only that ring; the shared rings, descriptor cache misses and launcher binding run under locks.

    Raises:
        ValueError: `ring_depth < 2` or an unknown launcher.
    """

    def __init__(self, device: torch.device, params: LaunchParams, ring_depth: int | None = None,
                 launcher: str | None = None):  # fmt: skip
        depth = int(os.environ.get("MULTIWRITE_TRITON_RING_DEPTH") or 8) if ring_depth is None else int(ring_depth)
        launcher = (os.environ.get("MULTIWRITE_TRITON_LAUNCHER") or "auto") if launcher is None else launcher
        if depth < 2:
            raise ValueError(f"ring_depth={depth} (must be >= 2: an arena stages into one slot while a kernel reads "
                             "another)")  # fmt: skip
        if launcher not in ("auto", "run", "jit"):
            raise ValueError(f"launcher={launcher!r} (supported: auto, run, jit)")
        self.device = device
        self.params = params
        #: The apply kernel's tiling (`apply_grid`): decode tiles, tiles, the values it preloads, cells, splits.
        self.apply_tiling = (params.decode_block_w, params.block_w, _PRELOADED, params.block_l, params.max_splits)
        self._apply_consts: dict[tuple, dict] = {}  # the apply variants and their constexprs
        self.depth = depth
        self.launcher = launcher
        self.is_gpu = device.type != "cpu"
        self.index = device.index if device.index is not None else 0
        if self.is_gpu:
            sms = torch.cuda.get_device_properties(self.index).multi_processor_count
            self.max_programs = 8 * sms  # enough programs in flight to keep the reads of host memory going
        else:
            self.max_programs = 8  # the interpreter runs programs one after the other
        self.lock = threading.RLock()  # the shared rings, descriptor cache misses
        self._shared: dict[np.dtype, SlotRing] = {}
        self._descs: OrderedDict[tuple, Descriptors] = OrderedDict()
        self._retiring: list[SlotRing] = []
        pin = self.is_gpu
        # The validation word of fast launchers, and a zeroed scratch for launches that read nothing.
        self.validation_t = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self.validation_word = self.validation_t.numpy()
        self.validation_addr = self.validation_t.data_ptr()
        self.validation_token = 0  # the last token a validation launch was given
        self.scratch = torch.zeros(32, dtype=torch.int64, device=device)
        self.validation_counter = self.scratch.data_ptr() + 8 * 31
        settle(device)  # the zeroed words are complete whatever stream launches next
        scratch = self.scratch.data_ptr()
        self.apply_launcher = Launcher(self, apply.apply_kernel, params.num_warps, apply.noop_args)
        self.stage_launcher = Launcher(self, stage.stage_kernel, stage.NUM_WARPS,
                                       functools.partial(_stage_noop, scratch=scratch))  # fmt: skip
        self.consume_launcher = Launcher(self, consume.consume_kernel, consume.NUM_WARPS, _no_noop)

    # -- staging memory --------------------------------------------------------------------------------------
    def lend(self, np_dtype: type[np.generic]) -> SlotRing:
        """A ring of its own for one staging arena, whose slots it stages into in place."""
        self._prune()
        with setup_calls(self.device):
            return SlotRing(self, self.depth, np_dtype, f"lent ({np.dtype(np_dtype).name} arena)")

    def retire(self, ring: SlotRing) -> None:
        """Keep a ring whose arena is gone until no launched kernel reads it (freed at the next `retire` or `lend`
        that finds it idle)."""
        self._retiring.append(ring)
        self._prune()

    def _prune(self) -> None:
        retiring = self._retiring  # pruned in place: `retire` may append from another thread (or the collector)
        for ring in [r for r in retiring if r.idle()]:
            try:
                retiring.remove(ring)
            except ValueError:  # pruned by another thread meanwhile
                pass

    def descriptors(self, tables: Sequence[torch.Tensor]) -> Descriptors:
        """The descriptor table of `tables` (a device copy, made once per layout of the tables, kept for the 64 most
        recent layouts; each launch keeps its own alive through the staging memory it reads)."""
        key = (*map(torch.Tensor.data_ptr, tables), *map(torch.Tensor.size, tables), *map(torch.Tensor.stride, tables))
        found = self._descs.get(key)
        if found is not None:
            return found
        with self.lock, setup_calls(self.device):
            found = self._descs.get(key)
            if found is None:
                tensor = torch.tensor(descriptor_rows(tables), dtype=torch.int64).to(self.device)  # complete on return
                found = self._descs[key] = Descriptors(tensor, tensor.data_ptr(), len(tables), tables_alias(tables))
                if len(self._descs) > DESCRIPTOR_CACHE_SIZE:
                    self._descs.popitem(last=False)
            return found

    # -- the launch sequence -----------------------------------------------------------------------------------
    def launch_on(
        self,
        lease: Lease,
        launcher: Launcher,
        variant: tuple,
        consts: dict,
        grid0: int,
        grid1: int,
        lead: tuple,
        tail: tuple,
        keep: object,
    ) -> None:
        """Launch a kernel that reads the staging memory `lease` (a slot of one of this device's rings): arguments
        `lead`, then the slot's completion counter, word and next token, then `tail`. `keep` (its descriptors) stays
        alive until the slot is released; `lease.launches` (and `launcher.launches`) count the launch once it is
        issued, and the ring records `lease` as the memory its slot's word guards.

        A launch that raises an `Exception` launched nothing: the slot is free again, nothing is counted, and the
        error propagates. An interrupt (`KeyboardInterrupt`) at any point is resolved before it propagates
        (`resolve`): once the stream has run what it holds, the slot's word tells whether the kernel ran (then it
        is counted), so the caller lands the batch exactly when it was applied.
        """
        ring: SlotRing = lease.lender  # type: ignore[assignment]
        token = None
        try:
            token = ring.hand_over(lease, keep)
            args = (*lead, ring.counter_addrs[lease.slot], lease.done_addr, token, *tail)
            fire = launcher.fire.get(variant)
            if fire is not None and self.index == get_device():  # (`Launcher.launch`'s common case, one call less)
                fire(grid0, grid1, get_stream(self.index), args)
                launcher.launches += 1
            else:
                launcher.launch(variant, consts, grid0, grid1, args)
        except Exception:
            if token is not None:
                ring.launch_failed(lease, token)
            raise
        except BaseException:
            if token is not None:
                self.resolve(lease, token)
            raise
        lease.launches += 1

    def resolve(self, lease: Lease, token: int) -> None:
        """After an interrupt around the launch that was to read `lease` with `token`: let the stream run what it
        holds (`drain`), then count the launch when its kernel stored the token, else free the slot. Further
        interrupts meanwhile are held back and the last one re-raised once this is decided (the decision is what
        keeps the arena and the tables in agreement)."""
        held: BaseException | None = None
        while True:
            try:
                self.drain()
                if lease.released():
                    lease.launches += 1
                else:
                    lease.lender.launch_failed(lease, token)  # type: ignore[union-attr]
                break
            except BaseException as exc:  # noqa: PERF203 - a second interrupt while resolving the first
                held = exc
        if held is not None:
            raise held

    def drain(self) -> None:
        """Wait until the current stream of the device has run every launch it holds (nothing to wait for under the
        interpreter, which runs each launch when it is issued)."""
        if self.is_gpu:
            torch.cuda.current_stream(self.device).synchronize()

    # -- WriteBatch applies (FusedStagedWriter) ----------------------------------------------------------------
    def apply(self, batches: Sequence[WriteBatch], backend: str) -> None:
        """One launch of the apply kernel per batch with values, on the current stream; no host synchronization.

        A batch staged in a ring this device lent (`batch.lease`) without overlapping writes is read in place; any
        other is copied into a slot of the device's shared ring of its dtype (overlapping writes reordered into
        rounds first). Every batch is checked before any is launched when it is not `checked`.
        """
        for batch in batches:
            if not batch.checked:
                batch.check_bounds(backend)
        for batch in batches:
            values = batch.values
            v = values.shape[0]
            if not v:
                continue  # only empty writes
            desc = self.descriptors(batch.tables)
            meta = batch.meta
            w = meta.shape[0]
            lease = batch.lease
            ring = None if lease is None else lease.lender
            if ring.__class__ is SlotRing and ring.owner is self and not batch.may_overlap:  # type: ignore[union-attr]
                self.launch_apply(lease, desc, w, v, 1, values.dtype)
                continue
            with self.lock:  # the shared ring: held from taking the slot until the launch is issued
                shared = self._shared.get(values.dtype)
                if shared is None:
                    shared = self._shared[values.dtype] = SlotRing(self, self.depth, values.dtype, "shared")
                lease = shared.acquire(w, v)
                rounds = 1
                if batch.may_overlap:
                    perm, bounds = overlap_rounds(meta, sequential=desc.aliased)
                    meta = meta[perm]
                    rounds = bounds.shape[0] - 1
                    lease.bounds[: rounds + 1] = bounds
                lease.meta[:w] = meta
                lease.values[:v] = values
                self.launch_apply(lease, desc, w, v, rounds, values.dtype)

    def launch_apply(self, lease: Lease, desc: Descriptors, w: int, v: int, rounds: int, np_dtype: type) -> None:
        """One launch of the apply kernel on the batch of `w` writes and `v` values in `lease` (`rounds` overlap
        rounds, their bounds in the lease), through `launch_on`."""
        p = self.params
        grid0, grid1 = apply_grid(w, v, rounds, self.apply_tiling, self.max_programs)
        decode = rounds == 1 and v <= self.apply_tiling[2]  # (apply_grid's decode batch: the kernel's variant)
        variant = (np.dtype(np_dtype).char, decode)
        consts = self._apply_consts.get(variant)
        if consts is None:  # (per device: the launch parameters are the backend's)
            bw, bl = (p.decode_block_w, p.decode_block_l) if decode else (p.block_w, p.block_l)
            consts = self._apply_consts[variant] = {"VALUE_DTYPE": _TL[np.dtype(np_dtype).char], "BLOCK_W": bw,
                                                    "BLOCK_L": bl}  # fmt: skip
        self.launch_on(lease, self.apply_launcher, variant, consts, grid0, grid1,
                       (desc.addr, lease.meta_addr, lease.values_addr, lease.bounds_addr),
                       (desc.num_tables, w, v, rounds), desc)  # fmt: skip


def _stage_noop(done_addr: int, counter_addr: int, token: int, *, scratch: int) -> tuple:
    return stage.noop_args(done_addr, counter_addr, token, scratch)


def _no_noop(done_addr: int, counter_addr: int, token: int) -> tuple:
    raise RuntimeError("the consume kernel is launched through the JIT only")


#: The Triton dtype of each values dtype char.
_TL: dict[str, object] = {}


def _tl_dtypes() -> None:
    import triton.language as tl

    _TL.update({np.dtype(np.int32).char: tl.int32, np.dtype(np.int64).char: tl.int64,
                np.dtype(np.float32).char: tl.float32})  # fmt: skip


_tl_dtypes()
