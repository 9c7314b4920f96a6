"""The `@triton.jit` helpers every kernel of the Triton backends shares: read a tile of staged writes, pick each
write's table, write its cells, hand its staging memory back.

Every address is an int64 scalar: staging memory is pinned host memory a GPU kernel reads in place over unified
virtual addressing (plain host memory under Triton's interpreter). A table descriptor is five int64 words: base
address, row stride, column stride (elements), rows, columns. Cells outside a descriptor's rows and columns and
values past `num_values` are masked off: a batch a host check missed is clipped, never written out of bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: int64 words of one table descriptor.
DESC_WORDS = 5


@triton.jit
def load_descriptor_words(d, mask):
    """The five words of the descriptors at pointers `d` (one per lane; masked-off lanes read 0): base, row stride,
    column stride, rows, columns."""
    base = tl.load(d + 0, mask=mask, other=0)
    row_stride = tl.load(d + 1, mask=mask, other=0)
    col_stride = tl.load(d + 2, mask=mask, other=0)
    rows = tl.load(d + 3, mask=mask, other=0)
    cols = tl.load(d + 4, mask=mask, other=0)
    return base, row_stride, col_stride, rows, cols


@triton.jit
def load_descriptors(desc_addr, num_tables, NT: tl.constexpr):
    """The descriptors of the first `NT` tables (`NT` a power of two), loaded once before any write is known."""
    desc = desc_addr.to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, NT)
    ok = lanes < num_tables
    return load_descriptor_words(desc + lanes.to(tl.int64) * 5, ok)


@triton.jit
def pick_tables(t, live, desc_addr, preloaded, base_all, row_stride_all, col_stride_all, rows_all, cols_all,
                NT: tl.constexpr):  # fmt: skip
    """Each write's table fields: a one-hot pick from the preloaded descriptors when `preloaded` (there are at most
    `NT` tables: no dependent load), else loaded."""
    if preloaded:
        lanes = tl.arange(0, NT)
        pick = t[:, None] == lanes[None, :]
        base = tl.sum(tl.where(pick, base_all[None, :], 0), axis=1)
        row_stride = tl.sum(tl.where(pick, row_stride_all[None, :], 0), axis=1)
        col_stride = tl.sum(tl.where(pick, col_stride_all[None, :], 0), axis=1)
        rows = tl.sum(tl.where(pick, rows_all[None, :], 0), axis=1)
        cols = tl.sum(tl.where(pick, cols_all[None, :], 0), axis=1)
    else:
        d = desc_addr.to(tl.pointer_type(tl.int64)) + t.to(tl.int64) * 5
        base, row_stride, col_stride, rows, cols = load_descriptor_words(d, live)
    return base, row_stride, col_stride, rows, cols


@triton.jit
def load_writes(meta, w, live):
    """Metadata of writes `w` (int32 rows of five: table, row, start, length, value offset); dead lanes read as empty
    writes of table -1."""
    m = meta + w * 5
    t = tl.load(m + 0, mask=live, other=-1, cache_modifier=".cv")
    row = tl.load(m + 1, mask=live, other=-1, cache_modifier=".cv")
    start = tl.load(m + 2, mask=live, other=-1, cache_modifier=".cv")
    length = tl.load(m + 3, mask=live, other=0, cache_modifier=".cv")
    voff = tl.load(m + 4, mask=live, other=0, cache_modifier=".cv")
    return t, row, start, length, voff


@triton.jit
def write_cells(t, row, start, length, voff, live, num_tables, base, row_stride, col_stride, rows, cols, values,
                values_all, preloaded, num_values, c_first, c_step, VALUE_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_L: tl.constexpr):  # fmt: skip
    """Write the cells of one tile of `BLOCK_W` writes, column chunks `c_first, c_first + c_step, ...` of `BLOCK_L`
    cells each: cell `c` of write `w` gets `values[voff + c]`, taken from `values_all` (every value of the batch, in
    registers) when `preloaded`, else loaded from `values`."""
    live = live & (t >= 0) & (t < num_tables) & (row >= 0) & (start >= 0) & (length > 0)
    live = live & (row.to(tl.int64) < rows)
    cells = tl.where(live, length, 0)
    dst = base.to(tl.pointer_type(VALUE_DTYPE)) + row.to(tl.int64) * row_stride
    max_cells = tl.max(cells, axis=0)
    lanes_l = tl.arange(0, BLOCK_L)
    for c0 in range(c_first, max_cells, c_step):
        pos = c0 + lanes_l
        col = start[:, None].to(tl.int64) + pos[None, :]
        vidx = voff[:, None] + pos[None, :]
        keep = (pos[None, :] < cells[:, None]) & (col < cols[:, None]) & (vidx < num_values)
        if preloaded:
            flat = tl.reshape(tl.where(keep, vidx, 0), [BLOCK_W * BLOCK_L])
            v = tl.reshape(tl.gather(values_all, flat, 0), [BLOCK_W, BLOCK_L])
        else:
            v = tl.load(values + vidx, mask=keep, other=0, cache_modifier=".cv")
        tl.store(dst[:, None] + col * col_stride[:, None], v, mask=keep)


@triton.jit
def apply_rounds(meta, bounds, num_rounds, num_writes, w_first, w_step, desc_addr, few, base_all, row_stride_all,
                 col_stride_all, rows_all, cols_all, num_tables, values, values_all, preloaded, num_values, c_first,
                 c_step, VALUE_DTYPE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr,
                 NT: tl.constexpr):  # fmt: skip
    """Land a batch's writes, round after round (`bounds[r]..bounds[r + 1]`; one round of `num_writes` when
    `num_rounds == 1`, `bounds` then unread): this program's tiles are the writes `w_first, w_first + w_step, ...`
    (`BLOCK_W` each) and its column chunks `c_first, c_first + c_step, ...` (`write_cells`). A barrier ends each
    round, so that a later round's writes land after an earlier round's."""
    multi = num_rounds > 1
    lanes_w = tl.arange(0, BLOCK_W)
    for r in range(0, num_rounds):
        w_begin = tl.load(bounds + r, mask=multi, other=0, cache_modifier=".cv")
        w_end = tl.load(bounds + r + 1, mask=multi, other=num_writes, cache_modifier=".cv")
        for w0 in range(w_begin + w_first, w_end, w_step):
            w = w0 + lanes_w
            live = w < w_end
            t, row, start, length, voff = load_writes(meta, w, live)
            base, row_stride, col_stride, rows, cols = pick_tables(t, live, desc_addr, few, base_all, row_stride_all,
                                                                   col_stride_all, rows_all, cols_all, NT)  # fmt: skip
            write_cells(t, row, start, length, voff, live, num_tables, base, row_stride, col_stride, rows, cols, values,
                        values_all, preloaded, num_values, c_first, c_step, VALUE_DTYPE, BLOCK_W, BLOCK_L)  # fmt: skip
        tl.debug_barrier()


@triton.jit
def last_to_finish(counter_addr, programs):
    """Whether this program is the last of this launch's `programs` to get here (so every program's reads of the
    staging memory are done): an atomic count in the device int32 at `counter_addr`, left at 0 for the next launch
    (one program: no count)."""
    tl.debug_barrier()
    counter = counter_addr.to(tl.pointer_type(tl.int32))
    multi = programs > 1
    finished = tl.atomic_add(counter, 1, mask=multi, sem="acq_rel", scope="gpu")
    last = (programs == 1) | (finished == programs - 1)
    tl.atomic_xchg(counter, 0, mask=multi & last, sem="acq_rel", scope="gpu")
    return last


@triton.jit
def hand_back(done_addr, token, last):
    """Where `last`: store `token` into the completion word at `done_addr` (pinned: no driver call)."""
    tl.store(done_addr.to(tl.pointer_type(tl.int32)), token, mask=last, cache_modifier=".wt")


@triton.jit
def release_staging(done_addr, token, counter_addr, programs):
    """Hand staging memory back to the host: the last of this launch's `programs` programs to finish stores `token`
    into its completion word."""
    hand_back(done_addr, token, last_to_finish(counter_addr, programs))


def compilable(fn, do_not_specialize: tuple[str, ...]) -> triton.runtime.JITFunction:
    """`fn` as a `JITFunction` even under the interpreter (for `triton.compile` to machine code in tests)."""
    return triton.runtime.JITFunction(fn, do_not_specialize=do_not_specialize)
