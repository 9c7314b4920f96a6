"""The Triton kernel shared by `triton-cuda` and `triton-rocm`, its launcher and host-side caches.

Import this module only where `import triton` works (the backends import it lazily, on first use, so a
missing Triton becomes a `not_supported_reasons` entry). `TRITON_INTERPRET` is read when the kernel is
decorated, i.e. when this module is first imported: set it before.

Per apply and dtype the host does two numpy copies (metadata and values into one slot of a pinned ring)
and one kernel launch; no pinned allocation, no host-to-device copy, no event, no synchronization. The
kernel reads the slot directly through unified virtual addressing (every pointer is passed as an int64
address), finds each write's table through a cached device descriptor table, and finally marks the slot
free again by storing a token into a pinned host word that the host polls before reusing the slot.
Under the interpreter the same code runs on CPU tensors and plain host addresses.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from multiwrite.backend import WriteBatch
from multiwrite.staging import META_COLUMNS, META_ROW, META_TABLE, StagingBuffers

#: Kernel parameters that vary per apply; none may become a specialization key (no recompiles).
DO_NOT_SPECIALIZE = (
    "desc_addr", "meta_addr", "values_addr", "bounds_addr", "counter_addr", "done_addr",
    "token", "num_tables", "num_writes", "num_values", "num_rounds",
)  # fmt: skip
#: int64 columns of one descriptor row: base address, row stride, column stride (elements), rows, columns.
DESC_COLUMNS = 5
#: Tables whose descriptors every program loads up front (more tables: one dependent load per write).
MAX_PRELOADED_TABLES: tl.constexpr = tl.constexpr(8)
#: A batch of at most this many values (a decode step) is loaded whole by every program, at the same
#: time as the metadata, so values do not wait for a second PCIe round trip; larger batches load each
#: tile's values once its metadata is known.
PRELOADED_VALUES: tl.constexpr = tl.constexpr(256)
TL_DTYPES = {torch.int32: tl.int32, torch.int64: tl.int64, torch.float32: tl.float32}


def _write_kernel_fn(
    desc_addr: tl.int64,  # device int64 [num_tables, 5] descriptors
    meta_addr: tl.int64,  # int32 [num_writes, 5] metadata rows (pinned host memory on a GPU)
    values_addr: tl.int64,  # [num_values] of VALUE_DTYPE (pinned host memory on a GPU)
    bounds_addr: tl.int64,  # int32 [num_rounds + 1] first write of each round (read only if num_rounds > 1)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished
    done_addr: tl.int64,  # int32 host word: receives `token` when every program has finished
    token: tl.int32,
    num_tables: tl.int32,
    num_writes: tl.int32,
    num_values: tl.int32,
    num_rounds: tl.int32,
    VALUE_DTYPE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Apply `num_writes` staged writes (one launch): write w sets `length` cells of its table's row
    from column `start` to `values[voff:voff + length]` (kernel block ids were expanded at staging).

    Every address is an int64 scalar: host slot addresses are UVA pointers to pinned memory. Cells
    outside a descriptor's rows/columns and values past `num_values` are masked off. Grid: (tiles of
    BLOCK_W writes, column splits); with `num_rounds > 1` a single program applies the rounds in order.
    """
    # Axis 0 walks tiles of BLOCK_W writes, axis 1 splits their cells into column chunks of BLOCK_L.
    pid_w = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_w = tl.num_programs(0)
    n_s = tl.num_programs(1)
    desc = desc_addr.to(tl.pointer_type(tl.int64))
    meta = meta_addr.to(tl.pointer_type(tl.int32))
    values = values_addr.to(tl.pointer_type(VALUE_DTYPE))
    bounds = bounds_addr.to(tl.pointer_type(tl.int32))
    lanes_w = tl.arange(0, BLOCK_W)
    lanes_l = tl.arange(0, BLOCK_L)
    multi = num_rounds > 1
    # Descriptors of up to MAX_PRELOADED_TABLES tables, loaded once per program, before any write is known: each
    # write then picks its table's fields with a one-hot reduction instead of a dependent memory load.
    lanes_t = tl.arange(0, MAX_PRELOADED_TABLES)
    few = num_tables <= MAX_PRELOADED_TABLES
    t_ok = lanes_t < num_tables
    d_all = desc + lanes_t.to(tl.int64) * 5
    base_all = tl.load(d_all + 0, mask=t_ok, other=0)
    row_stride_all = tl.load(d_all + 1, mask=t_ok, other=0)
    col_stride_all = tl.load(d_all + 2, mask=t_ok, other=0)
    rows_all = tl.load(d_all + 3, mask=t_ok, other=0)
    cols_all = tl.load(d_all + 4, mask=t_ok, other=0)
    lanes_v = tl.arange(0, PRELOADED_VALUES)
    small = num_values <= PRELOADED_VALUES
    preload = num_values * small.to(tl.int32)  # values to load up front: all of them, or none
    values_all = tl.load(values + lanes_v, mask=lanes_v < preload, other=0, cache_modifier=".cv")
    # Rounds (only with overlapping writes, launched as one program): round r's writes land before r+1's.
    for r in range(0, num_rounds):
        w_begin = tl.load(bounds + r, mask=multi, other=0, cache_modifier=".cv")
        w_end = tl.load(bounds + r + 1, mask=multi, other=num_writes, cache_modifier=".cv")
        for w0 in range(w_begin + pid_w * BLOCK_W, w_end, n_w * BLOCK_W):
            w = w0 + lanes_w
            live = w < w_end
            m = meta + w * 5
            t = tl.load(m + 0, mask=live, other=-1, cache_modifier=".cv")
            row = tl.load(m + 1, mask=live, other=-1, cache_modifier=".cv")
            start = tl.load(m + 2, mask=live, other=-1, cache_modifier=".cv")
            length = tl.load(m + 3, mask=live, other=0, cache_modifier=".cv")
            voff = tl.load(m + 4, mask=live, other=0, cache_modifier=".cv")
            live = live & (t >= 0) & (t < num_tables) & (row >= 0) & (start >= 0) & (length > 0)
            if few:
                pick = t[:, None] == lanes_t[None, :]
                base = tl.sum(tl.where(pick, base_all[None, :], 0), axis=1)
                row_stride = tl.sum(tl.where(pick, row_stride_all[None, :], 0), axis=1)
                col_stride = tl.sum(tl.where(pick, col_stride_all[None, :], 0), axis=1)
                rows = tl.sum(tl.where(pick, rows_all[None, :], 0), axis=1)
                cols = tl.sum(tl.where(pick, cols_all[None, :], 0), axis=1)
            else:
                d = desc + t.to(tl.int64) * 5
                base = tl.load(d + 0, mask=live, other=0)
                row_stride = tl.load(d + 1, mask=live, other=0)
                col_stride = tl.load(d + 2, mask=live, other=0)
                rows = tl.load(d + 3, mask=live, other=0)
                cols = tl.load(d + 4, mask=live, other=0)
            live = live & (row.to(tl.int64) < rows)
            cells = tl.where(live, length, 0)
            dst = base.to(tl.pointer_type(VALUE_DTYPE)) + row.to(tl.int64) * row_stride
            max_cells = tl.max(cells, axis=0)
            for c0 in range(pid_s * BLOCK_L, max_cells, n_s * BLOCK_L):
                pos = c0 + lanes_l
                col = start[:, None].to(tl.int64) + pos[None, :]
                vidx = voff[:, None] + pos[None, :]
                keep = (pos[None, :] < cells[:, None]) & (col < cols[:, None]) & (vidx < num_values)
                if small:
                    flat = tl.reshape(tl.where(keep, vidx, 0), [BLOCK_W * BLOCK_L])
                    v = tl.reshape(tl.gather(values_all, flat, 0), [BLOCK_W, BLOCK_L])
                else:
                    v = tl.load(values + vidx, mask=keep, other=0, cache_modifier=".cv")
                tl.store(dst[:, None] + col * col_stride[:, None], v, mask=keep)
        tl.debug_barrier()
    # Completion: the last program to finish (all the others' slot reads are done) resets the counter
    # and hands the slot back to the host. A launch of one program needs no counter.
    tl.debug_barrier()
    done = done_addr.to(tl.pointer_type(tl.int32))
    if n_w * n_s == 1:
        tl.store(done, token, cache_modifier=".wt")
    else:
        counter = counter_addr.to(tl.pointer_type(tl.int32))
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        last = finished == n_w * n_s - 1
        tl.atomic_xchg(counter, 0, mask=last, sem="acq_rel", scope="gpu")
        tl.store(done, token, mask=last, cache_modifier=".wt")


#: The runtime kernel (an `InterpretedFunction` when TRITON_INTERPRET was set at import).
_write_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(_write_kernel_fn)
INTERPRETED = not isinstance(_write_kernel, triton.runtime.JITFunction)


def compilable_kernel() -> triton.runtime.JITFunction:
    """The kernel as a `JITFunction` with the runtime's `do_not_specialize`, even under the interpreter
    (for `triton.compile` and specialization tests)."""
    if not INTERPRETED:
        return _write_kernel
    return triton.runtime.JITFunction(_write_kernel_fn, do_not_specialize=DO_NOT_SPECIALIZE)


class LaunchParams(NamedTuple):
    """Launch parameters of one target family (all compile-time constants of the kernel).

    `num_warps * warp_size` (threads per program) is at most 1024; `block_l` is a multiple of the
    wavefront so a row's cells load as whole-wavefront contiguous runs.
    """

    num_warps: int
    warp_size: int
    block_w: int  #: writes per program tile
    block_l: int  #: cells per write per column chunk
    max_splits: int  #: most column-chunk programs per tile (second grid axis)
    decode_block_w: int = 128  #: tile of a batch of at most PRELOADED_VALUES values (a decode step):
    decode_block_l: int = 8  #: many short writes, so that one program (no completion counter) takes it all


def cuda_launch_params() -> LaunchParams:
    """NVIDIA: 4 warps of 32 lanes, tiles of 16 writes x 64 cells: a decode step of up to 16 writes is
    one program (no completion counter), each row still loads as 256 contiguous bytes; no spills."""
    return LaunchParams(num_warps=4, warp_size=32, block_w=16, block_l=64, max_splits=64)


def rocm_launch_params(warp_size: int = 64) -> LaunchParams:
    """AMD: 256 lanes per program whatever the wavefront (4 wavefronts of 64 on CDNA, 8 of 32 on RDNA),
    tiles of 16 writes x 64 cells: each row loads as one whole 64-lane run.

    Raises:
        ValueError: a wavefront size other than 32 or 64.
    """
    if warp_size not in (32, 64):
        raise ValueError(f"wavefront size {warp_size} (supported: 32, 64)")
    params = LaunchParams(num_warps=256 // warp_size, warp_size=warp_size, block_w=16, block_l=64, max_splits=64)
    assert params.num_warps * params.warp_size <= 1024
    return params


def overlap_rounds(meta: np.ndarray, sequential: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Order writes so that overlapping ones land in staging order with independent rounds.

    A write's round is its occurrence index among the writes to the same (table, row); writes are
    stable-sorted by round. With `sequential` (tables of the batch share memory, so two writes to
    different (table, row) pairs may still hit one cell), every write is a round of its own, in staging
    order. Returns (meta rows reordered, int32 `[num_rounds + 1]` round boundaries).
    """
    w = meta.shape[0]
    if sequential:
        return meta, np.arange(w + 1, dtype=np.int32)
    key = (meta[:, META_TABLE].astype(np.int64) << 32) | meta[:, META_ROW].astype(np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    new_group = np.empty(w, dtype=bool)
    new_group[0] = True
    np.not_equal(sk[1:], sk[:-1], out=new_group[1:])
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(w), 0))
    rounds = np.empty(w, dtype=np.int64)
    rounds[order] = np.arange(w) - group_start
    perm = np.argsort(rounds, kind="stable")
    counts = np.bincount(rounds)
    bounds = np.zeros(counts.shape[0] + 1, dtype=np.int32)
    np.cumsum(counts, out=bounds[1:])
    return meta[perm], bounds


_ALIGN = 64
#: PRELOADED_VALUES as a plain int: comparing with the constexpr would make a constexpr (slow, and not a bool key).
_PRELOADED = int(PRELOADED_VALUES.value)
#: Triton's interpreter keeps the current program ids in module-level state: one interpreted launch at a time.
_INTERPRETER_LOCK = threading.Lock()
_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride


# The current device and raw stream of torch, as the C functions themselves (no Python frame per call);
# absent from CPU-only builds of torch, where only the interpreter path (which never calls them) runs.
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", lambda: 0)
_get_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)


def fire_on(fire: Callable, index: int, grid0: int, grid1: int, args: tuple) -> None:
    """`fire(grid0, grid1, stream, args)` (a bound fast launcher) on the current stream of GPU `index`, making
    that GPU current for the call when it is not (a launch goes to the current device's context)."""
    if index == _get_device():
        fire(grid0, grid1, _get_stream(index), args)
    else:
        with torch.cuda.device(index):
            fire(grid0, grid1, _get_stream(index), args)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Slot:
    """One ring slot in (pinned) host memory: `[meta int32 [wcap, 5] | bounds int32 [wcap + 1] | values
    [vcap] x 8 bytes]`, with typed numpy views for the copies and the addresses the kernel reads.

    `desc` holds the descriptor table of the last launch that read the slot: it stays alive (its device
    memory unreused) until the slot is reused, i.e. until that launch has finished, whichever thread or
    stream launched it and whenever the descriptor cache drops it.
    """

    __slots__ = ("buf", "wcap", "vcap", "meta", "bounds", "views", "meta_addr", "bounds_addr", "values_addr", "desc",
                 "lent")  # fmt: skip

    def __init__(self, wcap: int, vcap: int, pin: bool):
        self.wcap, self.vcap = wcap, vcap
        self.desc: _Descriptors | None = None
        # Set by the `_LentRing` lending the slot: (meta, values, meta_bytes, values_flat, meta_addr,
        # values_addr, meta rows, values items), what a compiled rotation hands the arena (`_cstaging.rotate_lent`).
        self.lent: tuple | None = None
        b_off = _align(wcap * META_COLUMNS * 4)
        v_off = b_off + _align((wcap + 1) * 4)
        self.buf = torch.empty(v_off + vcap * 8, dtype=torch.uint8, pin_memory=pin)
        raw = self.buf.numpy()
        self.meta = raw[:b_off].view(np.int32)[: wcap * META_COLUMNS].reshape(wcap, META_COLUMNS)
        self.bounds = raw[b_off:v_off].view(np.int32)
        self.views = {np.dtype(d): raw[v_off:].view(d) for d in (np.int32, np.int64, np.float32)}
        addr = self.buf.data_ptr()
        self.meta_addr, self.bounds_addr, self.values_addr = addr, addr + b_off, addr + v_off


class _Descriptors(NamedTuple):
    tensor: torch.Tensor  #: int64 [num_tables, 5] on the device
    addr: int
    num_tables: int
    aliased: bool  #: two of the tables' memory extents intersect (views of one tensor, a replaced alias...)


def tables_alias(tables: Sequence[torch.Tensor]) -> bool:
    """Whether the memory extents of any two `tables` intersect (then writes to different (table, row)
    pairs may hit one cell, and only a fully sequential order keeps the later write winning).

    A table's extent is `[data_ptr, data_ptr + span)` with span from its shape and (possibly zero or
    negative) strides; disjoint slices of one allocation, as the groups of a `BlockTables`, do not alias.
    """
    extents = []
    for t in tables:
        if t.numel() == 0:
            continue
        lo = hi = 0
        for size, stride in zip(t.shape, t.stride()):
            reach = (size - 1) * stride
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        base, item = t.data_ptr(), t.element_size()
        extents.append((base + lo * item, base + (hi + 1) * item))
    extents.sort()
    return any(nxt[0] < cur[1] for cur, nxt in zip(extents, extents[1:]))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _value_units(count: int, itemsize: int) -> int:
    """8-byte slot units that hold `count` values of `itemsize` bytes."""
    return -(-count * itemsize // 8)


class RingWaitWarning(RuntimeWarning):
    """An apply has waited longer than `TritonWriter.wait_warn_s` for a ring slot to be released."""


class RingStallError(RuntimeError):
    """A ring slot was never released although the device was synchronized: the kernel that read it
    never completed its launch (captured into a CUDA graph, or never ran). The slot is not reused."""


class _Ring:
    """`depth` slots of host memory (pinned on a GPU) that kernels read in place, each with its guard.

    A slot is handed out by `take` only once the kernel that last read it has finished: the kernel's last
    program stores the launch's token into the slot's pinned `done` word (`guard="kernel"`, no driver
    call), or a CUDA event recorded after the launch has completed (`guard="event"`). Words past `depth`
    (`extra_words`) are for validation launches. `name` says whose ring it is, for messages.

    Not locked: the writer's shared ring is used under `TritonWriter._lock`; a lent ring belongs to one
    arena, which one thread at a time stages into.
    """

    def __init__(self, owner: TritonWriter, depth: int, extra_words: int = 0, name: str = "shared"):
        self.owner = owner
        self.name = name
        self.depth = depth
        self.kernel_guard = owner._kernel_guard  # (read by the compiled rotation and commit)
        n = depth + extra_words
        self.done_t = torch.zeros(n, dtype=torch.int32, pin_memory=owner.is_gpu)
        self.done = self.done_t.numpy()
        self.done_mv = memoryview(self.done)  # type: ignore[arg-type]  # reads the pinned words directly
        self.counters = torch.zeros(n, dtype=torch.int32, device=owner.device)
        if owner.is_gpu:
            torch.cuda.synchronize(owner.device)  # the zeroing must be complete whatever stream launches next
        done0, cnt0 = self.done_t.data_ptr(), self.counters.data_ptr()
        self.done_addr = [done0 + 4 * i for i in range(n)]
        self.counter_addr = [cnt0 + 4 * i for i in range(n)]
        self.slots = [_Slot(64, 1024, owner.is_gpu) for _ in range(depth)]
        self.tokens = [0] * depth
        self.events: list = [None] * depth
        self.succ = [(i + 1) % depth for i in range(depth)]
        self.next = 0

    def take(self, w: int, units: int) -> int:
        """The next slot, once free, with room for `w` writes and `units` 8-byte values."""
        i = self.next
        self.next = self.succ[i]
        if self.owner._kernel_guard:
            if self.done_mv[i] != self.tokens[i]:
                self.wait(i)
        elif self.events[i] is not None and not self.events[i].query():
            self.wait(i)
        slot = self.slots[i]
        if w > slot.wcap or units > slot.vcap:
            self.grow(i, w, units)
        return i

    def _released(self, i: int) -> bool:
        if self.owner._kernel_guard:
            return self.done_mv[i] == self.tokens[i]
        return self.events[i].query()

    def wait(self, i: int) -> None:
        """Block until the kernel that last read slot `i` has finished: poll (sleeping up to 1 ms between
        polls), warn with `RingWaitWarning` after `owner.wait_warn_s`, synchronize the device after
        `owner.wait_timeout_s`.

        Raises:
            RingStallError: the slot's completion token is still missing after the device synchronized
                (the slot is then never handed out: a captured kernel may still read it).
        """
        owner = self.owner
        owner.waits += 1  # (a statistic: increments from concurrent threads may be lost)
        t0 = time.perf_counter()
        warn_at, deadline = t0 + owner.wait_warn_s, t0 + owner.wait_timeout_s
        warned = False
        pause = 0.0
        while not self._released(i):
            now = time.perf_counter()
            if not warned and now >= warn_at:
                warnings.warn(RingWaitWarning(self._waiting(i, now - t0)), stacklevel=2)
                warned = True
            if now >= deadline:
                if owner._kernel_guard:
                    if owner.is_gpu:
                        torch.cuda.synchronize(owner.device)
                    if self.done_mv[i] != self.tokens[i]:
                        raise RingStallError(self._stalled(i, time.perf_counter() - t0))
                else:
                    self.events[i].synchronize()
                return
            time.sleep(pause)
            pause = min(pause * 2 or 2e-6, 1e-3)

    def _where(self, i: int) -> str:
        return (
            f"slot {i} of the {self.name} ring (depth {self.depth}) of the multiwrite Triton writer on "
            f"{self.owner.device}"
        )

    def _waiting(self, i: int, waited: float) -> str:
        guard = (
            f"completion token {self.tokens[i]}, its word holds {int(self.done[i])}"
            if self.owner._kernel_guard
            else "its completion event has not completed"
        )
        return (
            f"an apply has waited {waited:.1f} s for {self._where(i)} to be released by the kernel that read it "
            f"({guard}). Likely causes: the stream that kernel was launched on is held up by long work queued "
            "before it (a long kernel, torch.cuda._sleep, a blocked stream); more applies in flight than ring slots "
            "(MULTIWRITE_TRITON_RING_DEPTH); or the kernel was captured into a CUDA graph and never ran. After "
            f"{self.owner.wait_timeout_s:.0f} s the device is synchronized."
        )

    def _stalled(self, i: int, waited: float) -> str:
        return (
            f"{self._where(i)} was never released: after {waited:.1f} s and a device synchronization the kernel "
            f"that read it has still not stored its completion token {self.tokens[i]} (the word holds "
            f"{int(self.done[i])}). That kernel never ran as launched: most likely it was captured into a CUDA "
            "graph (not supported; a replay would still read the slot), or the launch was lost. The slot is not "
            "reused."
        )

    def grow(self, i: int, w: int, units: int) -> _Slot:
        """Replace free slot `i` by a larger one (geometric growth; a pinned allocation, rare)."""
        old = self.slots[i]
        slot = _Slot(max(w, 2 * old.wcap), max(units, 2 * old.vcap), self.owner.is_gpu)
        self.slots[i] = slot
        return slot

    def next_token(self, i: int) -> int:
        """The token the next launch reading slot `i` stores when done."""
        token = self.tokens[i] % 0x7FFFFFFF + 1
        self.tokens[i] = token
        return token

    def idle(self) -> bool:
        """True when no launched kernel may still read any slot."""
        if self.owner._kernel_guard:
            return all(self.done_mv[i] == t for i, t in enumerate(self.tokens))
        return all(ev is None or ev.query() for ev in self.events)

    def launched(self, i: int) -> None:
        """Record the completion event of the launch that just read slot `i` (event guard only)."""
        if not self.owner._kernel_guard:
            ev = self.events[i]
            if ev is None:
                ev = self.events[i] = torch.cuda.Event()
            index = self.owner._index
            if index == _get_device():
                ev.record()  # on the current stream, like the launch
            else:
                ev.record(torch.cuda.current_stream(self.owner.device))


class _LentRing(StagingBuffers):
    """A ring whose slots a `StagingArena` stages into directly, so an apply launches on them in place:
    no copy on the host, none to the device. One per arena (its own slots and done words)."""

    def __init__(self, owner: TritonWriter, np_dtype: type[np.generic]):
        self.owner = owner
        self.np_dtype = np.dtype(np_dtype)
        self.ring = _Ring(owner, owner.depth, name=f"lent ({self.np_dtype.name} arena)")
        self.current = 0  # the slot the arena stages into

    def _lend(self, slot: _Slot) -> tuple[np.ndarray, np.ndarray, int, int]:
        meta, values = slot.meta, slot.views[self.np_dtype]
        if slot.lent is None:  # what the compiled rotation hands over (`_cstaging.rotate_lent`)
            slot.lent = (meta, values, meta.data.cast("B"), values.data, slot.meta_addr, slot.values_addr,
                         meta.shape[0], values.shape[0])  # fmt: skip
        return meta, values, slot.meta_addr, slot.values_addr

    def acquire(self, write_capacity: int, value_capacity: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The next free slot of the ring, big enough; see `StagingBuffers.acquire`."""
        self.current = i = self.ring.take(write_capacity, _value_units(value_capacity, self.np_dtype.itemsize))
        return self._lend(self.ring.slots[i])

    def grow(self, write_capacity: int, value_capacity: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """A larger slot in place of the current one (not launched yet); see `StagingBuffers.grow`."""
        units = _value_units(value_capacity, self.np_dtype.itemsize)
        return self._lend(self.ring.grow(self.current, write_capacity, units))

    def release(self) -> None:
        """The arena is gone: its pinned slots are freed once no launched kernel reads them."""
        self.owner._retiring.append(self.ring)


def bind_fast_launcher(
    kernel, consts: tuple, device: torch.device, launcher: str, validate: Callable[[Callable], None]
) -> tuple[Callable | None, str]:
    """A launch function `fire(grid0, grid1, stream, args)` for a compiled `kernel` that bypasses the JIT,
    and the launch path it gives (`TritonWriter.launch_path`'s vocabulary); (None, why) when none works.

    Candidates, fastest first: Triton's compiled C launcher called directly (NVIDIA, Triton 3.6 and 3.9
    calling conventions, no scratch memory; only with `launcher == "auto"`), then `CompiledKernel.run`.
    `validate(fire)` must pass (one no-op launch of the caller's choosing) before a candidate is used.
    Shared by the apply kernel's writer and the fused stage launcher (`triton_stage`).
    """
    reasons = []
    try:
        from triton import knobs

        hook = getattr(knobs.runtime, "launch_enter_hook", None)
        if hook is not None and getattr(hook, "calls", True):
            raise RuntimeError("Triton launch hooks are installed (profiling): keep the JIT path")
        run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    except Exception as exc:
        return None, f"jit (no fast launcher: {type(exc).__name__}: {exc})"
    candidates = []
    launch = getattr(run, "launch", None)
    if launcher == "auto" and device.type == "cuda" and torch.version.hip is None and launch is not None:
        scratch = (getattr(run, "global_scratch_size", 1), getattr(run, "profile_scratch_size", 1))
        coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
        if scratch == (0, 0) and coop is not None and pdl is not None and not getattr(run, "gsan_enabled", False):
            if hasattr(run, "arg_annotations"):  # Triton 3.9: (..., hooks, scratch, annotations, sig, args)
                ann, ksig = run.arg_annotations, run.kernel_signature

                def fire(g0, g1, stream, args):
                    launch(g0, g1, 1, stream, function, coop, pdl, packed, None, None, None, None, None,
                           ann, ksig, (*args, *consts))  # fmt: skip

            else:  # Triton 3.6: (..., scratch, scratch, metadata, launch metadata, hooks, *args)

                def fire(g0, g1, stream, args):
                    launch(g0, g1, 1, stream, function, coop, pdl, None, None, packed, None, None, None,
                           *args, *consts)  # fmt: skip

            candidates.append(("c-launcher", fire))
        else:
            reasons.append(f"c-launcher: scratch={scratch} cooperative={coop} pdl={pdl}")

    def fire_run(g0, g1, stream, args):
        run(g0, g1, 1, stream, function, packed, None, None, None, *args, *consts)

    candidates.append(("compiled-kernel-run", fire_run))
    for name, fire in candidates:
        try:
            validate(fire)
        except Exception as exc:
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        path = f"{name} (triton {triton.__version__})"
        return fire, path + (f"; not used: {'; '.join(reasons)}" if reasons else "")
    return None, f"jit (no fast launcher: {'; '.join(reasons)})"


class TritonWriter:
    """Applies `WriteBatch`es to the tables of one device with one kernel launch per batch.

    Args:
        device: a CUDA/HIP device, or a CPU device when the kernel runs through Triton's interpreter.
        params: the launch parameters (`cuda_launch_params()` or `rocm_launch_params(...)`).
        ring_depth: slots in the pinned ring (>= 1); a slot is reused only once the kernel that read it
            has finished. Default `$MULTIWRITE_TRITON_RING_DEPTH` or 8.
        guard: how the host learns that a slot is free again: `"kernel"` (the kernel stores a token into a
            pinned host word; no driver call) or `"event"` (one CUDA event record per apply and a query
            before reuse: two driver calls). Default `$MULTIWRITE_TRITON_GUARD` or `"kernel"`.
        launcher: `"auto"` (after the first JIT launch, bind Triton's C launcher directly on NVIDIA, else
            `CompiledKernel.run`), `"run"` (`CompiledKernel.run` only) or `"jit"` (always Triton's JIT
            launch path). Default `$MULTIWRITE_TRITON_LAUNCHER` or `"auto"`.
        wait_timeout_s: after this long waiting for a slot, synchronize the device instead of polling
            (then `RingStallError` if the slot is still not released).
        wait_warn_s: after this long waiting for a slot, warn once (`RingWaitWarning`) naming the device,
            ring, slot and likely causes.

    Attributes:
        launch_path: how launches are issued: `"interpreter"`; `"jit"` (Triton's `kernel[grid](...)`, used
            for the first launch of each dtype); after that `"c-launcher (triton X)"` (the compiled C
            launcher called directly) or `"compiled-kernel-run (triton X)"` (`CompiledKernel.run`), each
            bound only after one validated no-op launch; or `"jit (...)"` with why no fast path was bound.
        waits: applies that found their slot still in use and waited (approximate when several threads
            apply at once).

    Threads: one writer per device serves every table of the process. Distinct arenas (distinct
    `BlockTables`, `StagedWriteTensor`s) may be applied from distinct threads at once: a batch staged in a
    lent ring touches only that ring and lock-free reads (the descriptor cache, the bound launchers); the
    shared ring, descriptor cache misses, launcher binding and validation run under `_lock`; each launch
    keeps its descriptor table alive through its ring slot. Under Triton's interpreter (global state)
    launches are serialized process-wide.

    Raises:
        ValueError: `ring_depth < 1`, an unknown guard or launcher.
    """

    DESCRIPTOR_CACHE_SIZE = 64

    def __init__(
        self,
        device: torch.device,
        params: LaunchParams,
        ring_depth: int | None = None,
        guard: str | None = None,
        launcher: str | None = None,
        wait_timeout_s: float = 10.0,
        wait_warn_s: float = 1.0,
    ):
        depth = _env_int("MULTIWRITE_TRITON_RING_DEPTH", 8) if ring_depth is None else int(ring_depth)
        guard = (os.environ.get("MULTIWRITE_TRITON_GUARD") or "kernel") if guard is None else guard
        if depth < 1:
            raise ValueError(f"ring_depth={depth} (must be >= 1)")
        launcher = (os.environ.get("MULTIWRITE_TRITON_LAUNCHER") or "auto") if launcher is None else launcher
        if guard not in ("kernel", "event"):
            raise ValueError(f"guard={guard!r} (supported: kernel, event)")
        if launcher not in ("auto", "run", "jit"):
            raise ValueError(f"launcher={launcher!r} (supported: auto, run, jit)")
        self.device = device
        self.params = params
        self.depth = depth
        self.is_gpu = device.type != "cpu"
        self.guard = guard if self.is_gpu else "kernel"
        self.launcher = launcher
        self.wait_timeout_s = wait_timeout_s
        self.wait_warn_s = wait_warn_s
        self.waits = 0
        self._lock = threading.RLock()  # the shared ring, descriptor cache misses, launcher binding
        self._index = device.index if device.index is not None else 0
        if self.is_gpu:
            sms = torch.cuda.get_device_properties(self._index).multi_processor_count
            self._max_programs = 8 * sms  # enough programs in flight to keep UVA reads going
        else:
            self._max_programs = 8  # the interpreter runs programs one after the other
        self._kernel_guard = self.guard == "kernel"
        self._ring = _Ring(self, depth, extra_words=1)  # for batches that arrive as plain arrays
        self._retiring: list[_Ring] = []  # rings of dead arenas, kept alive while kernels may read them
        self._descs: OrderedDict[tuple, _Descriptors] = OrderedDict()
        self._fire: dict = {}  # (values numpy dtype, decode?) -> bound fast launch, or None when it cannot be
        # (key, descriptors) of the last batch: ONE attribute, so that a thread never pairs another
        # thread's key with its own descriptors (two attributes are not written atomically).
        self._last: tuple = (None, None)
        self._bw, self._bl, self._max_splits = params.block_w, params.block_l, params.max_splits
        self._bw1, self._bl1 = params.block_w - 1, params.block_l - 1
        self._dbw, self._dbw1 = params.decode_block_w, params.decode_block_w - 1
        self.launch_path = "interpreter" if INTERPRETED else "jit"

    # -- descriptors ------------------------------------------------------------------------------
    def _new_descriptors(self, key: tuple, tables: Sequence[torch.Tensor]) -> _Descriptors:
        """The descriptor table of `key` (the tables' pointers, shapes, strides), created under the lock.

        A descriptor is a pure function of its key, so a cache hit read without the lock is right even
        while another thread inserts or evicts. Evicting needs no synchronization: every launch keeps its
        descriptors alive through its ring slot (`_Slot.desc`) until the host sees it finished.
        """
        with self._lock:
            d = self._descs.get(key)
            if d is not None:
                return d
            rows = [(t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1]) for t in tables]
            tensor = torch.tensor(rows, dtype=torch.int64).to(self.device)  # synchronous: complete on return
            d = _Descriptors(tensor, tensor.data_ptr(), len(rows), tables_alias(tables))
            self._descs[key] = d
            if len(self._descs) > self.DESCRIPTOR_CACHE_SIZE:
                self._descs.popitem(last=False)
            return d

    # -- staging buffers ---------------------------------------------------------------------------
    def lend(self, np_dtype: type[np.generic]) -> _LentRing:
        """Staging buffers for one arena: a ring of its own whose slots it stages into in place."""
        retiring = self._retiring  # pruned in place: `release` may append from another thread (or the GC)
        for ring in [r for r in retiring if r.idle()]:
            try:
                retiring.remove(ring)
            except ValueError:  # pruned by another thread meanwhile
                pass
        return _LentRing(self, np_dtype)

    # -- apply ------------------------------------------------------------------------------------
    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """One kernel launch per batch with values, on the current stream of `device`; no host sync.

        Per batch: a descriptor-cache lookup keyed by every table's (data_ptr, shape, strides), then the
        launch. A batch staged in one of this writer's lent rings (`batch.buffers`) is read in place, with
        no lock; any other takes a free slot of the writer's shared ring (a read of a pinned word) and two
        memcpys, under `_lock` until launched.
        """
        for batch in batches:
            values = batch.values
            v = values.shape[0]
            if not v:
                continue  # only empty writes
            tables = batch.tables
            key = (*map(_PTR, tables), *map(_SIZE, tables), *map(_STRIDE, tables))
            last = self._last
            if key == last[0]:
                desc = last[1]
            else:
                found = self._descs.get(key)
                desc = self._new_descriptors(key, tables) if found is None else found
                self._last = (key, desc)
            meta = batch.meta
            w = meta.shape[0]
            lent = batch.buffers
            lock = None
            if lent.__class__ is _LentRing and lent.owner is self and not batch.may_overlap:  # type: ignore[union-attr]
                ring, i = lent.ring, lent.current  # type: ignore[union-attr]  # staged in place: no copy
                slot = ring.slots[i]
                rounds = 1
            else:
                lock = self._lock  # the shared ring: held from taking the slot until the launch is recorded
                lock.acquire()
                try:
                    ring = self._ring
                    i = ring.take(w, v)
                    slot = ring.slots[i]
                    if batch.may_overlap:
                        meta, bounds = overlap_rounds(meta, sequential=desc.aliased)
                        rounds = bounds.shape[0] - 1
                        slot.bounds[: rounds + 1] = bounds
                    else:
                        rounds = 1
                    slot.meta[:w] = meta
                    slot.views[values.dtype][:v] = values
                except BaseException:
                    lock.release()
                    raise
            decode = v <= _PRELOADED  # a decode step: many short writes, values preloaded
            if rounds > 1:
                grid0 = grid1 = 1
            elif decode:
                grid0, grid1 = (w + self._dbw1) // self._dbw, 1
            else:
                grid0 = (w + self._bw1) // self._bw
                grid1 = (v + self._bl1) // self._bl  # column chunks of the longest write, at most
                if grid1 > 1:
                    grid1 = max(1, min(grid1, self._max_splits, self._max_programs // grid0))
            token = ring.next_token(i)
            slot.desc = desc  # alive until this launch is seen finished (the slot's next take)
            args = (
                desc.addr, slot.meta_addr, slot.values_addr, slot.bounds_addr, ring.counter_addr[i],
                ring.done_addr[i], token, desc.num_tables, w, v, rounds,
            )  # fmt: skip
            variant = (values.dtype, decode)
            fire = self._fire.get(variant)
            try:
                if fire is None:
                    self._launch_jit(tables[0].dtype, variant, grid0, grid1, args)
                else:
                    fire_on(fire, self._index, grid0, grid1, args)
                ring.launched(i)
            except BaseException:
                ring.done_mv[i] = token  # nothing was launched: the slot is free
                raise
            finally:
                if lock is not None:
                    lock.release()

    def _launch_jit(self, dtype: torch.dtype, variant: tuple, grid0: int, grid1: int, args: tuple) -> None:
        """Launch through Triton's JIT (`kernel[grid](...)`); on a GPU, then try to bind a fast launcher.

        `variant` is (values numpy dtype, decode tile?): one compiled kernel and launcher each.
        """
        p = self.params
        bw, bl = (p.decode_block_w, p.decode_block_l) if variant[1] else (p.block_w, p.block_l)
        consts = {"VALUE_DTYPE": TL_DTYPES[dtype], "BLOCK_W": bw, "BLOCK_L": bl}
        if not self.is_gpu:
            with _INTERPRETER_LOCK:  # the interpreter keeps the program ids in global state
                _write_kernel[(grid0, grid1)](*args, **consts, num_warps=p.num_warps, num_stages=1)
            return
        with self._lock:  # one thread compiles, binds and validates (the validation word is shared)
            fire = self._fire.get(variant)
            with torch.cuda.device(self._index):
                if fire is not None:  # bound by another thread meanwhile
                    fire(grid0, grid1, _get_stream(self._index), args)
                    return
                kernel = _write_kernel[(grid0, grid1)](*args, **consts, num_warps=p.num_warps, num_stages=1)
            if variant not in self._fire and self.launcher != "jit":
                self._fire[variant] = self._bind_fast(kernel, (consts["VALUE_DTYPE"], bw, bl))

    def _bind_fast(self, kernel, consts: tuple):
        """A launch function `fire(grid0, grid1, stream, args)` that bypasses the JIT, or None; see
        `bind_fast_launcher`. Validated by a no-op launch that must store its token into the validation word."""
        fire, self.launch_path = bind_fast_launcher(kernel, consts, self.device, self.launcher, self._validate)
        return fire

    def _validate(self, fire) -> None:
        """One no-op launch through `fire`: it must complete and store its token (once per variant).

        It runs on a stream of its own, so the caller's stream (maybe busy) is never waited for.
        """
        ring, i = self._ring, self.depth
        token = int(ring.done[i]) % 0x7FFFFFFF + 1
        args = (0, 0, 0, 0, ring.counter_addr[i], ring.done_addr[i], token, 0, 0, 0, 1)
        with torch.cuda.device(self._index):
            stream = torch.cuda.Stream(self.device)
            fire(1, 1, stream.cuda_stream, args)
            stream.synchronize()
        if int(ring.done[i]) != token:
            raise RuntimeError(f"validation launch did not complete (done word {int(ring.done[i])} != {token})")
