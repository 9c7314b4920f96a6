"""The consume kernel of graph mode: applies published headers of a `HeaderRing` (multiwrite/staging/headers.py
defines the format and the protocol).

One program. It reads the ring's device state (headers applied, captured runs), then, in one round trip over PCIe,
the ticket of this run and the entry of the next header with its inline batch, both addresses known from the
state. A captured run (`limit < 0`) applies every header not yet applied up to its ticket's header, if the ticket
is published; an eager run applies every header below `limit`. An inline batch (a decode step) is checked against
its checksum (a run reading an entry while the host writes it, a replay issued before its commit, sees a mix of
two batches; it then reads the entry again, ordered after its sequence word) and written from registers. A batch
left in its staging memory is written tile by tile, round by round, then its memory is handed back (its token into
its completion word). Last, the state and its pinned mirror are updated, with the two mis-pairings the host reports
at its next call: a captured run whose ticket is not published (a replay without, or before, its commit), and an
eager run that finds fewer runs than the tickets the host had published when it issued it (a commit whose replay
was not issued before that eager call; the run count is then set to the host's: the next commit pairs with the next
replay).

Measured on an H200 (BENCHMARKS.md): a dependent load from pinned host memory costs about 1.5 us, so the number of
dependent host round trips is the kernel's cost: state (device) -> ticket and entry (host) -> stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from multiwrite.backends.triton.kernels.common import (
    apply_rounds,
    load_descriptors,
    pick_tables,
    write_cells,
)
from multiwrite.staging import headers as _headers

HEADER_WORDS: tl.constexpr = tl.constexpr(_headers.HEADER_WORDS)
ENTRY_WORDS: tl.constexpr = tl.constexpr(_headers.ENTRY_WORDS)
INLINE_WRITES: tl.constexpr = tl.constexpr(_headers.INLINE_WRITES)
INLINE_VALUES: tl.constexpr = tl.constexpr(_headers.INLINE_VALUES)
INLINE_META: tl.constexpr = tl.constexpr(_headers.INLINE_META)
(H_SEQ, H_META, H_VALUES, H_BOUNDS, H_DONE, H_TOKEN, H_COUNTS, H_NUM_VALUES) = (
    tl.constexpr(i) for i in range(8)
)  # (headers.H_SEQ ... as constants of the kernel)
#: Cells per write per step of an inline batch (decode writes are 1-3 cells).
FEW_CELLS: tl.constexpr = tl.constexpr(4)
#: Tile of a batch left in its staging memory.
BLOCK_W: tl.constexpr = tl.constexpr(16)
BLOCK_L: tl.constexpr = tl.constexpr(64)
NUM_WARPS = 4
DO_NOT_SPECIALIZE = ("desc_addr", "headers_addr", "tickets_addr", "state_addr", "mirror_addr", "limit", "tickets_host",
                     "num_tables")  # fmt: skip


@triton.jit
def inline_batch(batch, lanes_f, lanes_v):
    """An entry's inline batch (`batch`: int32 pointer to its area): its five metadata columns and its values, each
    one contiguous load."""
    t = tl.load(batch + lanes_f, cache_modifier=".cv")
    row = tl.load(batch + INLINE_WRITES + lanes_f, cache_modifier=".cv")
    start = tl.load(batch + 2 * INLINE_WRITES + lanes_f, cache_modifier=".cv")
    length = tl.load(batch + 3 * INLINE_WRITES + lanes_f, cache_modifier=".cv")
    voff = tl.load(batch + 4 * INLINE_WRITES + lanes_f, cache_modifier=".cv")
    values = tl.load(batch + INLINE_META + lanes_v, cache_modifier=".cv")
    return t, row, start, length, voff, values


@triton.jit
def inline_checksum(t, row, start, length, voff, values, lanes_f, lanes_v, num_writes, num_values):
    """The checksum of an inline batch as loaded (int64): each live int32 of the entry's batch area times its position
    there plus one (the host's `publish` stores the same sum in the token word)."""
    live = lanes_f < num_writes
    w = lanes_f.to(tl.int64) + 1
    cols = (t.to(tl.int64) * w + row.to(tl.int64) * (w + INLINE_WRITES) + start.to(tl.int64) * (w + 2 * INLINE_WRITES)
            + length.to(tl.int64) * (w + 3 * INLINE_WRITES) + voff.to(tl.int64) * (w + 4 * INLINE_WRITES))  # fmt: skip
    vals = values.to(tl.int64) * (lanes_v.to(tl.int64) + INLINE_META + 1)
    return tl.sum(tl.where(live, cols, 0), axis=0) + tl.sum(tl.where(lanes_v < num_values, vals, 0), axis=0)


@triton.jit
def header_word(head, lanes_h, word):
    """Word `word` of a header loaded as one vector (a reduction that stays within a warp)."""
    return tl.sum(tl.where(lanes_h == word, head, 0), axis=0)


def consume_kernel_fn(
    desc_addr: tl.int64,  # device int64 [num_tables, 5]: the tables' descriptors, fixed for good
    headers_addr: tl.int64,  # pinned int64 [DEPTH, ENTRY_WORDS]
    tickets_addr: tl.int64,  # pinned int64 [DEPTH]
    state_addr: tl.int64,  # device int64 [8]: headers applied, captured runs, idle runs, re-reads, missed, last
    #                        missed run, extra tickets, first extra ticket (staging/headers.py)
    mirror_addr: tl.int64,  # pinned int64 [8]: the same, for the host
    limit: tl.int64,  # an eager run: apply the headers below this count; -1: a captured run (its ticket's)
    tickets_host: tl.int64,  # an eager run: the tickets the host had published when it issued it (a captured run: 0)
    num_tables: tl.int32,
    DEPTH: tl.constexpr,  # header and ticket ring entries, a power of two
    NT: tl.constexpr,  # a power of two >= num_tables: every descriptor is loaded up front
    LAUNCH_DEPENDENTS: tl.constexpr,  # let a programmatic dependent launch (the captured stage kernel) start now
):
    """Apply published headers (module docstring)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    headers = headers_addr.to(tl.pointer_type(tl.int64))
    tickets = tickets_addr.to(tl.pointer_type(tl.int64))
    state = state_addr.to(tl.pointer_type(tl.int64))
    mirror = mirror_addr.to(tl.pointer_type(tl.int64))
    base_all, row_stride_all, col_stride_all, rows_all, cols_all = load_descriptors(desc_addr, num_tables, NT)
    few = num_tables <= NT  # every descriptor preloaded (NT is a power of two >= num_tables)
    lanes_h = tl.arange(0, HEADER_WORDS)
    lanes_v = tl.arange(0, INLINE_VALUES)
    lanes_f = tl.arange(0, INLINE_WRITES)
    applied = tl.load(state)
    runs = tl.load(state + 1)
    idle = tl.load(state + 2)
    rereads = tl.load(state + 3)
    missed = tl.load(state + 4)
    last_missed = tl.load(state + 5)
    extra = tl.load(state + 6)
    first_extra = tl.load(state + 7)
    captured = limit < 0
    # One round trip: this run's ticket and the next header's entry (with its inline batch), issued together.
    ticket = tl.load(tickets + runs % DEPTH, mask=captured, other=0, cache_modifier=".cv")
    entry0 = headers + (applied % DEPTH) * ENTRY_WORDS
    head0 = tl.load(entry0 + lanes_h, cache_modifier=".cv")
    f_t0, f_row0, f_start0, f_length0, f_voff0, f_values0 = inline_batch(
        (entry0 + HEADER_WORDS).to(tl.pointer_type(tl.int32)), lanes_f, lanes_v
    )
    # The ticket of run r is (r + 1) << 32 | h, both wrapping (31 and 32 bits): h, the header it applies up to.
    published = (ticket >> 32) == ((runs + 1) & 0x7FFFFFFF)
    ahead = ((ticket & 0xFFFFFFFF) - (applied & 0xFFFFFFFF)) & 0xFFFFFFFF
    ahead = tl.where(ahead >= 0x80000000, ahead - 0x100000000, ahead)  # as a signed 32-bit distance
    end = tl.where(captured, tl.where(published & (ahead >= 0), applied + ahead + 1, applied), limit)
    ok = applied < end
    n = applied * 0
    for h in range(applied, end):
        first = h == applied
        later = (h != applied).to(tl.int32)  # (a factor of the bound, not a mask: the interpreter's masks are bool)
        entry = headers + (h % DEPTH) * ENTRY_WORDS
        head = tl.where(first, head0, tl.load(entry + lanes_h, mask=lanes_h < HEADER_WORDS * later, other=0,
                                              cache_modifier=".cv"))  # fmt: skip
        batch = (entry + HEADER_WORDS).to(tl.pointer_type(tl.int32))
        f_later = lanes_f < INLINE_WRITES * later
        f_t = tl.where(first, f_t0, tl.load(batch + lanes_f, mask=f_later, other=0, cache_modifier=".cv"))
        f_row = tl.where(first, f_row0, tl.load(batch + INLINE_WRITES + lanes_f, mask=f_later, other=0,
                                                cache_modifier=".cv"))  # fmt: skip
        f_start = tl.where(first, f_start0, tl.load(batch + 2 * INLINE_WRITES + lanes_f, mask=f_later, other=0,
                                                    cache_modifier=".cv"))  # fmt: skip
        f_length = tl.where(first, f_length0, tl.load(batch + 3 * INLINE_WRITES + lanes_f, mask=f_later, other=0,
                                                      cache_modifier=".cv"))  # fmt: skip
        f_voff = tl.where(first, f_voff0, tl.load(batch + 4 * INLINE_WRITES + lanes_f, mask=f_later, other=0,
                                                  cache_modifier=".cv"))  # fmt: skip
        f_values = tl.where(first, f_values0, tl.load(batch + INLINE_META + lanes_v,
                                                      mask=lanes_v < INLINE_VALUES * later, other=0,
                                                      cache_modifier=".cv"))  # fmt: skip
        seq = header_word(head, lanes_h, H_SEQ)
        if first & captured & published & (seq != h + 1):
            # The ticket says the header is published, yet the entry was read before it was: read it again, ordered
            # after the ticket (only a replay issued while its commit was being written can see this).
            entry = entry + (ticket - ticket)
            head = tl.load(entry + lanes_h, cache_modifier=".cv")
            batch = (entry + HEADER_WORDS).to(tl.pointer_type(tl.int32))
            f_t, f_row, f_start, f_length, f_voff, f_values = inline_batch(batch, lanes_f, lanes_v)
            seq = header_word(head, lanes_h, H_SEQ)
        counts = header_word(head, lanes_h, H_COUNTS)
        num_values = header_word(head, lanes_h, H_NUM_VALUES).to(tl.int32)
        token_word = header_word(head, lanes_h, H_TOKEN)
        ok = ok & (seq == h + 1)
        if ok:
            num_writes = (counts & 0xFFFFFFFF).to(tl.int32)
            num_rounds = ((counts >> 32) & 0x7FFFFFFF).to(tl.int32)
            if counts < 0:  # the INLINE flag (the sign bit): the batch came with the header
                if inline_checksum(f_t, f_row, f_start, f_length, f_voff, f_values, lanes_f, lanes_v, num_writes,
                                   num_values) != token_word:  # fmt: skip
                    # The host was writing the entry while this run read it: read the batch again, ordered after the
                    # sequence word (an address that exists only once `seq` has arrived). The host writes the batch
                    # before it publishes the header, so this read needs no second check.
                    rereads += 1
                    again = batch + (seq - seq).to(tl.int32)
                    f_t, f_row, f_start, f_length, f_voff, f_values = inline_batch(again, lanes_f, lanes_v)
                f_live = lanes_f < num_writes
                base, row_stride, col_stride, rows, cols = pick_tables(f_t, f_live, desc_addr, few, base_all,
                                                                       row_stride_all, col_stride_all, rows_all,
                                                                       cols_all, NT)  # fmt: skip
                write_cells(f_t, f_row, f_start, f_length, f_voff, f_live, num_tables, base, row_stride, col_stride,
                            rows, cols, batch, f_values, True, num_values, 0, FEW_CELLS, tl.int32, INLINE_WRITES,
                            FEW_CELLS)  # fmt: skip
                tl.debug_barrier()  # this header's writes land before the next header's
            else:
                meta = header_word(head, lanes_h, H_META).to(tl.pointer_type(tl.int32))
                values = header_word(head, lanes_h, H_VALUES).to(tl.pointer_type(tl.int32))
                bounds = header_word(head, lanes_h, H_BOUNDS).to(tl.pointer_type(tl.int32))
                done_word = header_word(head, lanes_h, H_DONE)
                preloaded = num_values <= INLINE_VALUES
                values_all = tl.load(values + lanes_v, mask=lanes_v < num_values * preloaded.to(tl.int32), other=0,
                                     cache_modifier=".cv")  # fmt: skip
                apply_rounds(meta, bounds, num_rounds, num_writes, 0, BLOCK_W, desc_addr, few, base_all, row_stride_all,
                             col_stride_all, rows_all, cols_all, num_tables, values, values_all, preloaded, num_values,
                             0, BLOCK_L, tl.int32, BLOCK_W, BLOCK_L, NT)  # fmt: skip
                # Every load of the batch's staging memory is done: hand it back to the host.
                tl.store(done_word.to(tl.pointer_type(tl.int32)), token_word.to(tl.int32), mask=done_word != 0,
                         cache_modifier=".wt")  # fmt: skip
        n += ok.to(tl.int64)
    tl.debug_barrier()
    applied = applied + n
    idle = idle + (captured & (n == 0)).to(tl.int64)
    # A replay whose ticket is not published: without (or before) its commit. The next commit takes the ticket of
    # the next run (the host's `publish`), so this costs the one replay.
    unpaired = captured & (published.to(tl.int32) == 0)
    missed = missed + unpaired.to(tl.int64)
    last_missed = tl.where(unpaired, runs, last_missed)
    # An eager run after every replay issued before it (one stream): tickets beyond the runs are commits whose replay
    # was not issued before this call. It applied their headers; the next replay pairs with the next commit.
    behind = (limit >= 0) & (runs < tickets_host)
    extra = extra + tl.where(behind, tickets_host - runs, 0)
    first_extra = tl.where(behind, runs, first_extra)
    runs = tl.where(behind, tickets_host, runs + captured.to(tl.int64))
    tl.store(state, applied)
    tl.store(state + 1, runs)
    tl.store(state + 2, idle)
    tl.store(state + 3, rereads)
    tl.store(state + 4, missed)
    tl.store(state + 5, last_missed)
    tl.store(state + 6, extra)
    tl.store(state + 7, first_extra)
    tl.store(mirror, applied, cache_modifier=".wt")
    tl.store(mirror + 1, runs, cache_modifier=".wt")
    tl.store(mirror + 2, idle, cache_modifier=".wt")
    tl.store(mirror + 3, rereads, cache_modifier=".wt")
    tl.store(mirror + 5, last_missed, cache_modifier=".wt")  # (the indices before the counts the host reads first)
    tl.store(mirror + 7, first_extra, cache_modifier=".wt")
    tl.store(mirror + 4, missed, cache_modifier=".wt")
    tl.store(mirror + 6, extra, cache_modifier=".wt")


consume_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(consume_kernel_fn)
