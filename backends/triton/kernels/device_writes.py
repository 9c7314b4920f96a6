"""The device-writes kernel: every set of device-sourced writes (`multiwrite.device_writes.DeviceWrites`) into one
table in one launch, its inputs read where they lie: device tensors; the descriptors of up to `ARG_SETS_MAX` sets as
the launch's own arguments; the descriptors of more sets and the address tables of per-row tensors in memory at
`sets_addr`: an eager call's device copy of its staging slot (`SlotMirror`), or a captured call's pinned buffer read
over UVA. Design and contract: docs/device-writes.md.

Work items. Set `s` has `ceil(n_s / BLOCK_W)` tiles of `BLOCK_W` writes; tiles are numbered across the sets in order
(set `s` starts at tile `tile0_s`). Program `(p, k)` of the `grid0 x splits` grid takes tiles `p, p + grid0, ...`
and, of each, the column chunks `k, k + splits, ...` of `BLOCK_L` cells. No program ever waits for another.

The scan. A write of a flat-values set reads from `o_i = sum(max(lengths[j], 0), j < i)` of its set. The writes are
cut into scan blocks of `SCAN_W` (a multiple of `BLOCK_W`); a tile sums the lengths of its block before it itself
(at most `SCAN_W`, linear work). Blocks before its own are looked back over: each block has a flag word, `(epoch * 2
+ is_prefix) << 40 | value` (value: the block's sum, or the inclusive prefix at its end), published with an atomic
max, so that a prefix is never replaced by a sum and a word of an earlier launch never reads as this launch's (its
epoch is lower): nothing is reset between launches, CUDA graph replays included. A block whose flag is not there yet
is summed by the tile that needs it (and published), so a look-back never waits: the scan needs no ordering of the
programs. The last tile of each block publishes its inclusive prefix. A set of one block touches no flag. When a
launch used flags (`scanned`), its last program to finish advances the epoch (`state[2]`, 1 .. EPOCH_MAX; at the
wrap it clears the flags first). Values saturate at 2^40 - 1 (past any set's values: such writes are bad and
skipped).

Ordered launches (`ORDERED`: the writes may overlap) run as one program taking the tiles in order, a barrier after
each, and within a tile a cell a later write of the tile also writes is left to it: sets in order, writes in index
order, the later wins.

Bad writes (row outside the table, start < 0, length < 0, past the row, past the set's values) are skipped whole,
never clipped (a per-row tensor shorter than its length too; raw addresses have no known extent); each is counted
into the fault record and one of them described. Addresses are int64 throughout: `row * row_stride` for rows of any
width.
"""

from __future__ import annotations

import triton
import triton.language as tl

from multiwrite.backends.triton.kernels.common import hand_back, last_to_finish

#: Kernel parameters that vary per launch; none may become a specialization key.
DO_NOT_SPECIALIZE = ("sets_addr", "a_rows", "a_starts", "a_lengths", "a_source", "a_n", "a_tile0", "a_flags",
                     "a_count", "b_rows", "b_starts", "b_lengths", "b_source", "b_n", "b_tile0", "b_flags", "b_count",
                     "state_addr", "faults_addr", "counter_addr", "done_addr", "token", "table_addr", "row_stride",
                     "col_stride", "rows", "cols", "num_sets", "num_tiles", "capacity", "scanned")  # fmt: skip
#: int64 words of one set descriptor: rows, starts, lengths, source (values, or the address table), n, first tile,
#: flags (bit 0/1/2: rows/starts/lengths are int64; bit 3: per-row addresses; bits 4-5: source dtype: 0 int32,
#: 1 int64, 2 float32; bit 6: per-row addresses of one write, its address in word 3 itself), number of flat values
#: (per-row sources: the address of their sizes, or 0 where unknown).
SET_WORDS: tl.constexpr = tl.constexpr(8)
#: Sets whose descriptors travel as the launch's arguments (`a_*`, `b_*`); a launch of more reads them from memory.
ARG_SETS_MAX = 2
#: int64 words of the scan state before the flags: two unused words, then the epoch.
STATE_WORDS: tl.constexpr = tl.constexpr(3)
#: The largest epoch; the next launch after it clears the flags and starts again at 1.
EPOCH_MAX: tl.constexpr = tl.constexpr((1 << 22) - 1)
VALUE_BITS: tl.constexpr = tl.constexpr(40)
VALUE_MAX: tl.constexpr = tl.constexpr((1 << 40) - 1)


@triton.jit
def load_int(addr, w, live, wide):
    """Element `w` of the int32 (`wide == 0`) or int64 (`wide == 1`) array at `addr`, as int64."""
    is64 = (w * 0 + wide) != 0  # (a block: the interpreter refuses a scalar in a mask)
    v64 = tl.load(addr.to(tl.pointer_type(tl.int64)) + w, mask=live & is64, other=0)
    v32 = tl.load(addr.to(tl.pointer_type(tl.int32)) + w, mask=live & ~is64, other=0)
    return tl.where(is64, v64, v32.to(tl.int64))


@triton.jit
def load_values(base, pos, keep, code, VALUE_DTYPE: tl.constexpr, SOURCE: tl.constexpr):
    """Elements `pos` of the sources at byte addresses `base` (one per write), of dtype `code` (0 int32, 1 int64,
    2 float32; `SOURCE`: the one code of every set of the launch, -1 where they differ), cast to `VALUE_DTYPE` as
    `Tensor.to` casts."""
    if SOURCE == 1:
        return tl.load(base[:, None].to(tl.pointer_type(tl.int64)) + pos[None, :], mask=keep, other=0).to(VALUE_DTYPE)
    elif SOURCE == 0:
        return tl.load(base[:, None].to(tl.pointer_type(tl.int32)) + pos[None, :], mask=keep, other=0).to(VALUE_DTYPE)
    elif SOURCE == 2:
        return tl.load(base[:, None].to(tl.pointer_type(tl.float32)) + pos[None, :], mask=keep,
                       other=0).to(VALUE_DTYPE)  # fmt: skip
    else:
        is64 = (pos[None, :] * 0 + code) == 1
        v64 = tl.load(base[:, None].to(tl.pointer_type(tl.int64)) + pos[None, :], mask=keep & is64, other=0)
        v32 = tl.load(base[:, None].to(tl.pointer_type(tl.int32)) + pos[None, :], mask=keep & ~is64, other=0)
        as_float = v32.to(tl.float32, bitcast=True)
        return tl.where(code == 2, as_float.to(VALUE_DTYPE), tl.where(is64, v64, v32.to(tl.int64)).to(VALUE_DTYPE))


@triton.jit
def word(sets, s, j: tl.constexpr, a, b, ARG_SETS: tl.constexpr):
    """Word `j` of the descriptor of set `s`: from the arguments (`a` of set 0, `b` of set 1) or from memory."""
    if ARG_SETS == 0:
        return tl.load(sets + s * SET_WORDS + j)
    elif ARG_SETS == 1:
        return a.to(tl.int64)  # (an argument of 0 is an int32 under the interpreter)
    else:
        return tl.where(s == 0, a.to(tl.int64), b.to(tl.int64))


@triton.jit
def counted_sum(lengths, wide, lo, hi, SCAN_W: tl.constexpr):
    """`sum(min(max(lengths[i], 0), 2^31 - 1), lo <= i < hi)` for `hi - lo <= SCAN_W`."""
    lanes = tl.arange(0, SCAN_W).to(tl.int64)
    idx = lo + lanes
    got = load_int(lengths, idx, idx < hi, wide)
    return tl.sum(tl.minimum(tl.maximum(got, 0), (1 << 31) - 1), axis=0)


@triton.jit
def block_prefix(flags, state, lengths, wide, n, block, SCAN_W: tl.constexpr):
    """The sum of the counted lengths of scan blocks `0 .. block - 1` (module docstring): flags looked back over,
    a missing one summed here and published."""
    excl = tl.zeros((), dtype=tl.int64)
    if block > 0:
        epoch = tl.load(state + 2)
        tag_a = (epoch * 2).to(tl.int64)
        j = block - 1
        while j >= 0:
            got = tl.atomic_add(flags + j, 0, sem="relaxed", scope="gpu")
            tag = got >> VALUE_BITS
            if tag == tag_a + 1:  # the inclusive prefix at the end of block j: done
                excl += got & VALUE_MAX
                j = j * 0 - 1
            else:
                agg = got & VALUE_MAX
                if tag != tag_a:  # not published yet: sum it here and publish it
                    agg = tl.minimum(counted_sum(lengths, wide, j * SCAN_W, tl.minimum(j * SCAN_W + SCAN_W, n),
                                                 SCAN_W), VALUE_MAX)  # fmt: skip
                    tl.atomic_max(flags + j, (tag_a << VALUE_BITS) | agg, sem="relaxed", scope="gpu")
                excl += agg
                j -= 1
        excl = tl.minimum(excl, VALUE_MAX)
    return excl


@triton.jit
def record_faults(faults, bad, w, s, row, start, length, rows, cols):
    """Count the bad writes of a tile into the fault record `faults` and, when it held none, describe the first
    (nothing but one reduction for a tile without bad writes)."""
    nbad = tl.sum(bad.to(tl.int32), axis=0)
    if nbad > 0:
        old = tl.atomic_add(faults, nbad.to(tl.int64), sem="relaxed", scope="gpu")
        first = old == 0
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
    sets_addr: tl.int64,  # int64 [num_sets, SET_WORDS] set descriptors when ARG_SETS == 0, and the address tables
    a_rows: tl.int64, a_starts: tl.int64, a_lengths: tl.int64, a_source: tl.int64, a_n: tl.int64, a_tile0: tl.int64,
    a_flags: tl.int64, a_count: tl.int64,  # the descriptor of set 0 (ARG_SETS >= 1)
    b_rows: tl.int64, b_starts: tl.int64, b_lengths: tl.int64, b_source: tl.int64, b_n: tl.int64, b_tile0: tl.int64,
    b_flags: tl.int64, b_count: tl.int64,  # the descriptor of set 1 (ARG_SETS == 2)
    state_addr: tl.int64,  # int64 device scan state: STATE_WORDS words, then `capacity` flag words
    faults_addr: tl.int64,  # int64 [8] fault record on the device (the caller's, or one nobody reads)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished
    done_addr: tl.int64,  # int32 completion word of the staging memory: receives `token` (0: no staging memory)
    token: tl.int32,
    table_addr: tl.int64,
    row_stride: tl.int64,
    col_stride: tl.int64,
    rows: tl.int64,
    cols: tl.int64,
    num_sets: tl.int32,
    num_tiles: tl.int32,
    capacity: tl.int32,
    scanned: tl.int32,  # 1: some flat set has more than one scan block (flags used: the epoch advances)
    VALUE_DTYPE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    SCAN_W: tl.constexpr,
    ORDERED: tl.constexpr,
    ARG_SETS: tl.constexpr,
    SOURCE: tl.constexpr,
):  # fmt: skip
    """Land every set's writes (module docstring)."""
    sets = sets_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    state = state_addr.to(tl.pointer_type(tl.int64))
    faults = faults_addr.to(tl.pointer_type(tl.int64))
    dst_base = table_addr.to(tl.pointer_type(VALUE_DTYPE))
    lanes_w = tl.arange(0, BLOCK_W).to(tl.int64)
    lanes_l = tl.arange(0, BLOCK_L)
    k = tl.program_id(1)
    splits = tl.num_programs(1)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        if ARG_SETS == 0:
            s = tl.zeros((), dtype=tl.int32)
            for j in range(1, num_sets):
                s = tl.where(tl.load(sets + j * SET_WORDS + 5) <= tile, j, s)
        elif ARG_SETS == 1:
            s = tl.zeros((), dtype=tl.int32)
        else:
            s = (tile >= b_tile0).to(tl.int32)
        n = word(sets, s, 4, a_n, b_n, ARG_SETS)
        tile0 = word(sets, s, 5, a_tile0, b_tile0, ARG_SETS)
        fl = word(sets, s, 6, a_flags, b_flags, ARG_SETS)
        lengths = word(sets, s, 2, a_lengths, b_lengths, ARG_SETS)
        w0 = (tile - tile0) * BLOCK_W
        w = w0 + lanes_w
        live = w < n
        row = load_int(word(sets, s, 0, a_rows, b_rows, ARG_SETS), w, live, fl & 1)
        start = load_int(word(sets, s, 1, a_starts, b_starts, ARG_SETS), w, live, (fl >> 1) & 1)
        length = load_int(lengths, w, live, (fl >> 2) & 1)
        source = word(sets, s, 3, a_source, b_source, ARG_SETS)
        count = word(sets, s, 7, a_count, b_count, ARG_SETS)
        code = (fl >> 4) & 3
        ok = (row >= 0) & (row < rows) & (start >= 0) & (length >= 0) & (start + length <= cols)
        if ((fl >> 3) & 1) == 0:  # one flat source: the scan
            counted = tl.where(live, tl.minimum(tl.maximum(length, 0), (1 << 31) - 1), 0)
            block = w0 // SCAN_W
            lo = block * SCAN_W
            excl = block_prefix(state + STATE_WORDS + tile0, state, lengths, (fl >> 2) & 1, n, block, SCAN_W)
            if w0 > lo:  # the writes of its block before this tile
                excl = tl.minimum(excl + counted_sum(lengths, (fl >> 2) & 1, lo, w0, SCAN_W), VALUE_MAX)
            offset = excl + tl.cumsum(counted, axis=0) - counted
            end = tl.minimum(lo + SCAN_W, n)
            if (w0 + BLOCK_W >= end) & (n > SCAN_W) & (k == 0):  # the last tile of a block of a scanned set
                epoch = tl.load(state + 2)
                prefix = tl.minimum(excl + tl.sum(counted, axis=0), VALUE_MAX)
                tl.atomic_max(state + STATE_WORDS + tile0 + block, ((epoch * 2 + 1) << VALUE_BITS) | prefix,
                              sem="relaxed", scope="gpu")  # fmt: skip
            # (`fits` leaves the branch as an int32: a boolean yielded from it would need a move to another layout,
            # which Triton 3.6 cannot lower for AMD targets)
            fits = (offset + length <= count).to(tl.int32)
            base = source + offset * tl.where(code == 1, 8, 4)
        else:  # per-row addresses, and their tensors' sizes where known (word 7: their address, else 0)
            if ((fl >> 6) & 1) != 0:  # one write: its address inline (no read of host memory)
                base = tl.where(live, source, 0)
            else:
                base = tl.load(source.to(tl.pointer_type(tl.int64)) + w, mask=live, other=0)
            known = (w * 0 + count) != 0
            size = tl.load(count.to(tl.pointer_type(tl.int64)) + w, mask=live & known, other=0)
            fits = (~known | (length <= size)).to(tl.int32)
        ok &= live & (fits != 0)
        record_faults(faults, live & ~ok, w, s, row, start, length, rows, cols)
        cells = tl.where(ok, length, 0).to(tl.int32)  # (a good write ends within its row: below 2^31)
        row = tl.where(ok, row, 0)
        start = tl.where(ok, start, 0).to(tl.int32)
        dst = dst_base + row * row_stride
        max_cells = tl.max(cells, axis=0)
        for c0 in range(k * BLOCK_L, max_cells, splits * BLOCK_L):
            pos = c0 + lanes_l
            keep = pos[None, :] < cells[:, None]
            col = start[:, None] + pos[None, :]
            if ORDERED:  # a cell a later write of the tile also writes is left to it
                later = lanes_w[None, None, :] > lanes_w[:, None, None]
                hit = (row[None, None, :] == row[:, None, None]) & (col[:, :, None] >= start[None, None, :])
                hit &= col[:, :, None] < (start + cells)[None, None, :]
                keep &= tl.max((hit & later).to(tl.int32), axis=2) == 0
            v = load_values(base, pos, keep, code, VALUE_DTYPE, SOURCE)
            tl.store(dst[:, None] + col * col_stride, v, mask=keep)
        if ORDERED:
            tl.debug_barrier()
    if (done_addr != 0) | (scanned != 0):
        last = last_to_finish(counter_addr, tl.num_programs(0) * tl.num_programs(1))
        if scanned != 0:
            advance_epoch(state, last, capacity)
        if done_addr != 0:  # (a launch of `SlotMirror` has none: its copy hands the slot back)
            hand_back(done_addr, token, last)


@triton.jit
def advance_epoch(state, last, capacity):
    """The launch's last program (`last`) advances the epoch; past `EPOCH_MAX` it clears the flags first and starts
    again at 1."""
    epoch = tl.load(state + 2)
    wrap = last & (epoch >= EPOCH_MAX)
    flags = state + STATE_WORDS
    lanes = tl.arange(0, 1024)
    for c in range(0, tl.where(wrap, capacity, 0), 1024):
        tl.store(flags + c + lanes, tl.zeros_like(lanes).to(tl.int64), mask=c + lanes < capacity)
    tl.atomic_xchg(state + 2, tl.where(wrap, 1, epoch + 1), mask=last, sem="release", scope="gpu")


device_writes_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(device_writes_kernel_fn)


def noop_args(done_addr: int, counter_addr: int, token: int, *, state_addr: int) -> tuple:
    """Arguments of a launch that writes nothing and stores `token` into `done_addr` (validation of a launcher)."""
    return (0, *(0,) * 16, state_addr, state_addr, counter_addr, done_addr, token, 0, 0, 0, 0, 0, 0, 0, 0, 0)
