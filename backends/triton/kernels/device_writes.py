"""The device-writes kernel: every set of device-sourced writes (`multiwrite.device_writes.DeviceWrites`) into one
table in one launch, its inputs read where they lie (device tensors; set descriptors and per-row address tables in
pinned host memory over UVA, or in a buffer of a captured graph). Design and contract: docs/device-writes.md.

Work items. Set `s` has `ceil(n_s / BLOCK_W)` tiles of `BLOCK_W` writes; tiles are numbered across the sets in order
(set `s` starts at tile `tile0_s`) and each tile is cut into `splits` column splits: item `tile * splits + k`. A
program takes items by an atomic ticket (`state[0]`), so items are taken in order and every item a program waits
for is held by a program that is already running (forward progress whatever the grid and the scheduler).

The scan. A write of a flat-values set reads from `o_i = sum(max(lengths[j], 0), j < i)` of its set. Offsets come
from a decoupled look-back over tiles, linear work: split 0 of a tile publishes its tile's sum (`A`, aggregate) in
its flag word as soon as it has loaded its lengths, then walks back over the flags of earlier tiles of its set,
`LOOKBACK` at a time, adding aggregates until it meets an inclusive prefix (`P`), and publishes its own prefix; the
first tile of a set publishes `P` at once. A flag word is `(epoch * 2 + is_prefix) << 40 | value`, so a flag left by
an earlier launch never reads as this launch's and nothing is reset between launches (CUDA graph replays
included): the launch's last program to finish (`state[1]` counts them) resets the ticket and advances the epoch
(`state[2]`, 1 .. EPOCH_MAX); when it wraps, that program clears the flags first. Values saturate at 2^40 - 1 (past
any set's values: such writes are bad and skipped).

Ordered launches (`ORDERED`: the writes may overlap) run as one program taking the items in order, a barrier after
each tile, and within a tile a cell a later write of the tile also writes is left to it: sets in order, writes in
index order, the later wins.

Bad writes (row outside the table, start < 0, length < 0, past the row, past the set's values) are skipped whole,
never clipped (a per-row tensor shorter than its length too; raw addresses have no known extent); each is counted
into the fault record and one of them described. Addresses
are int64 throughout: `row * row_stride` for rows of any width.
"""

from __future__ import annotations

import triton
import triton.language as tl

from multiwrite.backends.triton.kernels.common import release_staging

#: Kernel parameters that vary per launch; none may become a specialization key.
DO_NOT_SPECIALIZE = ("sets_addr", "state_addr", "faults_addr", "counter_addr", "done_addr", "token", "table_addr",
                     "row_stride", "col_stride", "rows", "cols", "num_sets", "num_items", "splits",
                     "capacity")  # fmt: skip
#: int64 words of one set descriptor: rows, starts, lengths, source (values, or the address table), n, first tile,
#: flags (bit 0/1/2: rows/starts/lengths are int64; bit 3: per-row addresses; bits 4-5: source dtype: 0 int32,
#: 1 int64, 2 float32), number of flat values (per-row sources: the address of their sizes, or 0 where unknown).
SET_WORDS: tl.constexpr = tl.constexpr(8)
#: int64 words of the scan state before the flags: ticket, finished programs, epoch.
STATE_WORDS: tl.constexpr = tl.constexpr(3)
#: The largest epoch; the next launch after it clears the flags and starts again at 1.
EPOCH_MAX: tl.constexpr = tl.constexpr((1 << 22) - 1)
VALUE_BITS: tl.constexpr = tl.constexpr(40)
VALUE_MAX: tl.constexpr = tl.constexpr((1 << 40) - 1)
LOOKBACK: tl.constexpr = tl.constexpr(16)


@triton.jit
def load_int(addr, w, live, wide):
    """Element `w` of the int32 (`wide == 0`) or int64 (`wide == 1`) array at `addr`, as int64 (two int32 loads)."""
    p = addr.to(tl.pointer_type(tl.int32)) + w.to(tl.int64) * (1 + wide)
    lo = tl.load(p, mask=live, other=0)
    wide_lanes = (w * 0 + wide) != 0
    hi = tl.load(p + 1, mask=live & wide_lanes, other=0)
    hi = tl.where(wide_lanes, hi, lo >> 31)
    return (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def load_values(base, pos, keep, code, VALUE_DTYPE: tl.constexpr):
    """Elements `pos` of the sources at byte addresses `base` (one per write), of dtype `code` (0 int32, 1 int64,
    2 float32), cast to `VALUE_DTYPE` as `Tensor.to` casts."""
    wide = (code == 1).to(tl.int64)
    p = base[:, None].to(tl.pointer_type(tl.int32)) + pos[None, :] * (1 + wide)
    lo = tl.load(p, mask=keep, other=0)
    wide_lanes = (pos[None, :] * 0 + code) == 1
    hi = tl.load(p + 1, mask=keep & wide_lanes, other=0)
    hi = tl.where(wide_lanes, hi, lo >> 31)
    as_int = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    as_float = tl.where(wide_lanes | (code != 2), 0, lo).to(tl.float32, bitcast=True)  # (no cast of other bits)
    return tl.where(code == 2, as_float.to(VALUE_DTYPE), as_int.to(VALUE_DTYPE))


@triton.jit
def look_back(flags, tile, tile0, epoch, agg, publish):
    """The exclusive prefix of tile `tile` of a set starting at tile `tile0`, whose own sum is `agg`; `publish`
    (split 0): publish the aggregate first and the inclusive prefix last (module docstring)."""
    vmax = VALUE_MAX
    tag_a = (epoch * 2).to(tl.int64)
    tag_p = tag_a + 1
    first = tile == tile0
    own = tl.minimum(agg, vmax)
    tl.atomic_xchg(flags + tile, (tl.where(first, tag_p, tag_a) << VALUE_BITS) | own, mask=publish, sem="release",
                   scope="gpu")  # fmt: skip
    excl = tl.zeros((), dtype=tl.int64)
    hi = tile
    go = tile > tile0
    lanes = tl.arange(0, LOOKBACK)
    while go:
        lo = tl.maximum(hi - LOOKBACK, tile0)
        idx = lo + lanes
        m = idx < hi
        words = tl.atomic_add(flags + idx, tl.zeros_like(idx), mask=m, sem="acquire", scope="gpu")
        words = tl.where(m, words, 0)
        tag = words >> VALUE_BITS
        val = words & vmax
        ready = ~m | (tag == tag_a) | (tag == tag_p)
        if tl.min(ready.to(tl.int32), axis=0) == 1:
            is_p = m & (tag == tag_p)
            last_p = tl.max(tl.where(is_p, idx, -1), axis=0)
            excl += tl.sum(tl.where(m & (idx >= last_p), val, 0), axis=0)
            excl = tl.minimum(excl, vmax)
            hi = lo
            go = (last_p < 0) & (lo > tile0)
    tl.atomic_xchg(flags + tile, (tag_p << VALUE_BITS) | tl.minimum(excl + agg, vmax), mask=publish & (tile > tile0),
                   sem="release", scope="gpu")  # fmt: skip
    return excl


@triton.jit
def record_faults(faults, bad, w, s, row, start, length, rows, cols):
    """Count the bad writes of a tile into the fault record `faults` and, when it held none, describe the first."""
    nbad = tl.sum(bad.to(tl.int64), axis=0)
    claim = nbad > 0
    old = tl.atomic_add(faults, nbad, mask=claim, sem="relaxed", scope="gpu")
    first = claim & (old == 0)
    i = tl.min(tl.where(bad, w, 1 << 62), axis=0)
    pick = w == i
    tl.store(faults + 1, s.to(tl.int64), mask=first)
    tl.store(faults + 2, i, mask=first)
    tl.store(faults + 3, tl.sum(tl.where(pick, row, 0), axis=0), mask=first)
    tl.store(faults + 4, tl.sum(tl.where(pick, start, 0), axis=0), mask=first)
    tl.store(faults + 5, tl.sum(tl.where(pick, length, 0), axis=0), mask=first)
    tl.store(faults + 6, rows, mask=first)
    tl.store(faults + 7, cols, mask=first)


def device_writes_kernel_fn(
    sets_addr: tl.int64,  # int64 [num_sets, SET_WORDS] set descriptors (pinned host memory, or a graph's buffer)
    state_addr: tl.int64,  # int64 device scan state: ticket, finished, epoch, then `capacity` flag words
    faults_addr: tl.int64,  # int64 [8] fault record on the device (the caller's, or one nobody reads)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished (`release_staging`)
    done_addr: tl.int64,  # int32 completion word of the staging memory: receives `token`
    token: tl.int32,
    table_addr: tl.int64,
    row_stride: tl.int64,
    col_stride: tl.int64,
    rows: tl.int64,
    cols: tl.int64,
    num_sets: tl.int32,
    num_items: tl.int32,
    splits: tl.int32,
    capacity: tl.int32,
    VALUE_DTYPE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Land every set's writes (module docstring)."""
    sets = sets_addr.to(tl.pointer_type(tl.int64))
    state = state_addr.to(tl.pointer_type(tl.int64))
    faults = faults_addr.to(tl.pointer_type(tl.int64))
    flags = state + STATE_WORDS
    dst_base = table_addr.to(tl.pointer_type(VALUE_DTYPE))
    epoch = tl.atomic_add(state + 2, 0, sem="acquire", scope="gpu")
    lanes_w = tl.arange(0, BLOCK_W).to(tl.int64)
    lanes_l = tl.arange(0, BLOCK_L).to(tl.int64)
    item = tl.atomic_add(state, 1, sem="relaxed", scope="gpu")
    while item < num_items:
        tile = item // splits
        k = item % splits
        s = tl.zeros((), dtype=tl.int32)
        for j in range(1, num_sets):
            s = tl.where(tl.load(sets + j * SET_WORDS + 5) <= tile, j, s)
        d = sets + s * SET_WORDS
        n = tl.load(d + 4)
        tile0 = tl.load(d + 5)
        fl = tl.load(d + 6)
        w = (tile - tile0) * BLOCK_W + lanes_w
        live = w < n
        row = load_int(tl.load(d + 0), w, live, fl & 1)
        start = load_int(tl.load(d + 1), w, live, (fl >> 1) & 1)
        length = load_int(tl.load(d + 2), w, live, (fl >> 2) & 1)
        code = (fl >> 4) & 3
        esize = tl.where(code == 1, 8, 4)
        ok = (row >= 0) & (row < rows) & (start >= 0) & (length >= 0) & (start + length <= cols)
        if ((fl >> 3) & 1) == 0:  # one flat source: the scan
            counted = tl.where(live, tl.minimum(tl.maximum(length, 0), (1 << 31) - 1), 0)
            incl = tl.cumsum(counted, axis=0)
            excl = look_back(flags, tile, tile0, epoch, tl.sum(counted, axis=0), k == 0)
            offset = excl + incl - counted
            ok &= offset + length <= tl.load(d + 7)
            base = tl.load(d + 3) + offset * esize
        else:  # per-row addresses, and their tensors' sizes where known (word 7: their address, else 0)
            base = tl.load(tl.load(d + 3).to(tl.pointer_type(tl.int64)) + w, mask=live, other=0)
            sizes = tl.load(d + 7)
            known = (w * 0 + sizes) != 0
            size = tl.load(sizes.to(tl.pointer_type(tl.int64)) + w, mask=live & known, other=0)
            ok &= ~known | (length <= size)
        ok &= live
        record_faults(faults, live & ~ok, w, s, row, start, length, rows, cols)
        cells = tl.where(ok, length, 0)
        row = tl.where(ok, row, 0)
        start = tl.where(ok, start, 0)
        dst = dst_base + row * row_stride
        max_cells = tl.max(cells, axis=0).to(tl.int32)
        for c0 in range(k.to(tl.int32) * BLOCK_L, max_cells, splits * BLOCK_L):
            pos = c0 + lanes_l
            keep = pos[None, :] < cells[:, None]
            col = start[:, None] + pos[None, :]
            if ORDERED:  # a cell a later write of the tile also writes is left to it
                later = lanes_w[None, None, :] > lanes_w[:, None, None]
                hit = (row[None, None, :] == row[:, None, None]) & (col[:, :, None] >= start[None, None, :])
                hit &= col[:, :, None] < (start + cells)[None, None, :]
                keep &= tl.max((hit & later).to(tl.int32), axis=2) == 0
            v = load_values(base, pos, keep, code, VALUE_DTYPE)
            tl.store(dst[:, None] + col * col_stride, v, mask=keep)
        if ORDERED:
            tl.debug_barrier()
        item = tl.atomic_add(state, 1, sem="relaxed", scope="gpu")
    finish(state, flags, epoch, capacity)
    release_staging(done_addr, token, counter_addr, tl.num_programs(0) * tl.num_programs(1))


@triton.jit
def finish(state, flags, epoch, capacity):
    """The last program of the launch to finish resets the ticket and the count and advances the epoch; past
    `EPOCH_MAX` it clears the flags and starts again at 1."""
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    done = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    last = done == programs - 1
    wrap = last & (epoch >= EPOCH_MAX)
    lanes = tl.arange(0, 1024)
    for c in range(0, tl.where(wrap, capacity, 0), 1024):
        tl.store(flags + c + lanes, tl.zeros_like(lanes).to(tl.int64), mask=c + lanes < capacity)
    tl.atomic_xchg(state, 0, mask=last, sem="relaxed", scope="gpu")
    tl.atomic_xchg(state + 1, 0, mask=last, sem="relaxed", scope="gpu")
    tl.atomic_xchg(state + 2, tl.where(wrap, 1, epoch + 1), mask=last, sem="release", scope="gpu")


device_writes_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(device_writes_kernel_fn)


def noop_args(done_addr: int, counter_addr: int, token: int, *, state_addr: int) -> tuple:
    """Arguments of a launch that writes nothing and stores `token` into `done_addr` (validation of a launcher)."""
    return (0, state_addr, state_addr, counter_addr, done_addr, token, 0, 0, 0, 0, 0, 0, 0, 1, 0)
