"""The stage kernel: gather and slot mappings of every KV-cache group in one launch, and, with `HAS_WRITES`, the
staged writes too (`BlockTables.prepare_inputs` in ONE launch).

Grid: one dimension. The first `num_groups * (num_reqs_padded + 1) * splits` programs are stage programs
`(g, b, s)`: for a batch entry `b < num_reqs`, program `(g, b, s)` copies the cells `[s * CHUNK, (s + 1) * CHUNK)`
of the request's first `num_blocks` cells into `input_block_tables[g]` (split `s == 0` also writes the slots of the
entry's tokens); for `num_reqs <= b < num_reqs_padded` it zeroes its part of the row; program `(g, num_reqs_padded,
0)` pads the slots from `query_start_loc[num_reqs]` to `max_tokens` with -1. Long rows thus cost what their bytes
cost (a row of 131072 cells is 32 programs), short ones one program.

With `HAS_WRITES`, `apply_programs` more programs land the staged writes (tiles x column splits, as the apply
kernel), and there is no grid-wide barrier: each stage program lays its row's staged writes over what it reads from
the table (at most one write per overlap round, the latest round winning), so it sees the row as the apply leaves
it whatever order the programs run in. Only chunks a staged write touches are laid over. The last program to finish
hands the staging memory back. With `PDL` (graph mode, NVIDIA sm_90+) the kernel is a programmatic dependent launch
of the consume kernel: it reads the step's inputs first and waits (`griddepcontrol.wait`) only before the tables.
"""

from __future__ import annotations

import triton
import triton.language as tl

from multiwrite.backends.triton.kernels.common import (
    apply_rounds,
    load_descriptors,
    release_staging,
)
from multiwrite.stage.layout import PAD_SLOT_ID

#: int64 columns of one group's stage descriptor: the table (address, row stride), its gather output (address, row
#: stride), the row width, block and kernel block sizes and k, the group's row of num_blocks, its row of
#: slot_mappings, max_num_batched_tokens, max_num_reqs, cp_rank, the apply descriptors' address, the group's flags
#: (`FLAG_SLOTS`: its tokens get slots; `FLAG_SHARDED`: context parallelism shards it) and its sliding-window reach.
(D_SRC, D_SRC_STRIDE, D_DST, D_DST_STRIDE, D_WIDTH, D_BLOCK, D_KERNEL_BLOCK, D_K, D_COUNTS, D_SLOTS, D_MAX_TOKENS,
 D_MAX_REQS, D_CP_RANK, D_WDESC, D_FLAGS, D_REACH) = (tl.constexpr(i) for i in range(16))  # fmt: skip
FLAG_SLOTS: tl.constexpr = tl.constexpr(1)
FLAG_SHARDED: tl.constexpr = tl.constexpr(2)
STAGE_DESC_WORDS: tl.constexpr = tl.constexpr(16)
PAD: tl.constexpr = tl.constexpr(PAD_SLOT_ID)
#: Lanes of a stage program, cells of one gather split, writes per overlay scan tile.
BLOCK: tl.constexpr = tl.constexpr(256)
CHUNK: tl.constexpr = tl.constexpr(4096)
SCAN: tl.constexpr = tl.constexpr(128)
#: Most overlap rounds (writes to one (table, row) in one batch) the overlay handles; more: apply, then stage.
MAX_ROUNDS: tl.constexpr = tl.constexpr(8)
#: Writes per apply tile and cells per apply column chunk of the apply programs.
APPLY_W: tl.constexpr = tl.constexpr(32)
APPLY_L: tl.constexpr = tl.constexpr(64)
#: A batch of at most this many values is loaded whole by every program.
PRELOADED_VALUES: tl.constexpr = tl.constexpr(256)
#: Tables whose descriptors the apply programs load up front.
NT: tl.constexpr = tl.constexpr(8)
NUM_WARPS = 4

DO_NOT_SPECIALIZE = (
    "sdesc_addr", "meta_addr", "values_addr", "bounds_addr", "counter_addr", "done_addr", "token", "num_writes",
    "num_values", "num_rounds", "apply_tiles", "apply_programs", "num_groups", "idx_addr", "qsl_addr", "pos_addr",
    "pad_addr", "nct_addr", "num_reqs", "num_reqs_padded", "num_positions", "splits",
)  # fmt: skip


@triton.jit
def token_tile(t, end, lanes, pos_ptr, pad_ptr, max_tokens, num_positions, HAS_PADDING: tl.constexpr):
    """Tokens `t + lanes` of a batch entry ending at `end`: `(tokens, inside, pos, alive)`: `inside` the entry's
    tokens below `max_tokens`, `alive` those not marked as padding, `pos` their positions as int64 (0 where not
    alive, so junk positions under padding never reach an address)."""
    tokens = t + lanes
    inside = (tokens < end) & (tokens >= 0) & (tokens < max_tokens)
    pos = tl.load(pos_ptr + tokens, mask=inside & (tokens < num_positions), other=0).to(tl.int64)
    alive = inside
    if HAS_PADDING:
        alive = alive & (tl.load(pad_ptr + tokens, mask=inside, other=1) == 0)
    return tokens, inside, tl.where(alive, pos, 0), alive


@triton.jit
def slot_columns(pos, alive, width, block, kbs, k, cp_rank, sharded, CP_SIZE: tl.constexpr,
                 CP_INTERLEAVE: tl.constexpr):  # fmt: skip
    """`(column, offset, owned)` of positions `pos`: the table column of each token's kernel block (clamped into the
    row), the token's offset in it, and whether this rank owns the token (context parallelism: manager-block
    coordinates decide ownership and the rank-local offset, vllm-project/vllm PR #51031; a group that is not
    `sharded` is stored whole on every rank)."""
    column = pos // kbs
    offset = pos % kbs
    owned = alive
    if CP_SIZE > 1:
        virtual = block * CP_SIZE
        vblock = pos // virtual
        within = pos % virtual
        owned = alive & ((within // CP_INTERLEAVE) % CP_SIZE == cp_rank)
        local = (within // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + within % CP_INTERLEAVE
        column = tl.where(sharded, vblock * k + local // kbs, pos // kbs)
        offset = tl.where(sharded, local % kbs, pos % kbs)
        owned = tl.where(sharded, owned, alive)
    return tl.minimum(tl.maximum(column, 0), width - 1), offset, owned


@triton.jit
def overlay(v, cols, keep, seg_start, seg_len, seg_voff, values, values_all, preloaded, num_values,
            MAX_R: tl.constexpr):  # fmt: skip
    """`v` (cells `cols` of one table row, as read) with the row's staged writes laid over it: round `r`'s write
    covers `[seg_start[r], seg_start[r] + seg_len[r])`, and the latest round that covers a cell wins."""
    lanes_r = tl.arange(0, MAX_R).to(tl.int64)
    start = seg_start.to(tl.int64)[:, None]
    c = cols.to(tl.int64)[None, :]
    cover = (c >= start) & (c < start + seg_len.to(tl.int64)[:, None]) & keep[None, :]
    winner = tl.max(tl.where(cover, lanes_r[:, None], -1), axis=0)
    pick = cover & (lanes_r[:, None] == winner[None, :])
    vidx = tl.sum(tl.where(pick, seg_voff.to(tl.int64)[:, None] + c - start, 0), axis=0)
    hit = winner >= 0
    if preloaded:
        new = tl.gather(values_all, tl.where(hit, vidx, 0).to(tl.int32), 0)
    else:
        new = tl.load(values + vidx, mask=hit & (vidx < num_values), other=0, cache_modifier=".cv")
    return tl.where(hit, new, v)


def stage_kernel_fn(
    sdesc_addr: tl.int64,  # device int64 [num_groups, STAGE_DESC_WORDS]: per group what is fixed (`D_*` columns)
    meta_addr: tl.int64,  # int32 [num_writes, 5] staged writes (HAS_WRITES)
    values_addr: tl.int64,  # int32 [num_values]
    bounds_addr: tl.int64,  # int32 [num_rounds + 1] (read only if num_rounds > 1)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished
    done_addr: tl.int64,  # int32 completion word of the staging memory read, or 0: none
    token: tl.int32,
    num_writes: tl.int32,
    num_values: tl.int32,
    num_rounds: tl.int32,
    apply_tiles: tl.int32,  # apply programs along the writes
    apply_programs: tl.int32,  # apply_tiles x column splits: the LAST programs of the grid
    num_groups: tl.int32,  # tables 0..num_groups-1 of the batch are the groups, table num_groups is num_blocks.T
    idx_addr: tl.int64,  # [num_reqs] of IDX_DTYPE
    qsl_addr: tl.int64,  # [>= num_reqs + 1] of QSL_DTYPE
    pos_addr: tl.int64,  # [num_positions] of POS_DTYPE
    pad_addr: tl.int64,  # uint8 [>= num_tokens_padded] (read only if HAS_PADDING)
    nct_addr: tl.int64,  # [>= max_num_reqs] of NCT_DTYPE, per request row (read only if HAS_WINDOW)
    num_reqs: tl.int32,
    num_reqs_padded: tl.int32,  # rows the gather writes (>= the padded batch: rows a previous gather left, zeroed)
    num_positions: tl.int32,  # entries of pos_addr
    splits: tl.int32,  # gather splits per row (programs of CHUNK cells)
    IDX_DTYPE: tl.constexpr,
    QSL_DTYPE: tl.constexpr,
    POS_DTYPE: tl.constexpr,
    CP_SIZE: tl.constexpr,
    CP_INTERLEAVE: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    NCT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DO_GATHER: tl.constexpr,
    DO_SLOTS: tl.constexpr,
    HAS_WRITES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Gather and slot mappings, and with `HAS_WRITES` the staged writes, in one launch (module docstring)."""
    pid = tl.program_id(0)
    stage_programs = tl.num_programs(0) - apply_programs
    meta = meta_addr.to(tl.pointer_type(tl.int32))
    values = values_addr.to(tl.pointer_type(tl.int32))
    bounds = bounds_addr.to(tl.pointer_type(tl.int32))
    multi = num_rounds > 1
    lanes_v = tl.arange(0, PRELOADED_VALUES)
    preloaded = num_values <= PRELOADED_VALUES
    values_all = tl.zeros([PRELOADED_VALUES], dtype=tl.int32)
    if HAS_WRITES:
        values_all = tl.load(values + lanes_v, mask=lanes_v < num_values * preloaded.to(tl.int32), other=0,
                             cache_modifier=".cv")  # fmt: skip
    apply_here = False  # (a compile-time False without HAS_WRITES: the variant without writes has no apply code)
    if HAS_WRITES:
        apply_here = pid >= stage_programs
    sdesc = sdesc_addr.to(tl.pointer_type(tl.int64))
    if apply_here:
        # ---- an apply program (HAS_WRITES only): one tile of writes, one column split. Last in the grid, so the
        # interpreter (which runs programs in order) runs every stage program first: the overlay's hardest case ----
        a = pid - stage_programs
        pid_w = a % apply_tiles
        n_s = apply_programs // apply_tiles
        wdesc_addr = tl.load(sdesc + D_WDESC)  # (every group row holds it: row 0's)
        base_all, row_stride_all, col_stride_all, rows_all, cols_all = load_descriptors(wdesc_addr, num_groups + 1,
                                                                                        NT)  # fmt: skip
        few = num_groups + 1 <= NT
        apply_rounds(meta, bounds, num_rounds, num_writes, pid_w * APPLY_W, apply_tiles * APPLY_W, wdesc_addr, few,
                     base_all, row_stride_all, col_stride_all, rows_all, cols_all, num_groups + 1, values, values_all,
                     preloaded, num_values, (a // apply_tiles) * APPLY_L, n_s * APPLY_L, tl.int32, APPLY_W, APPLY_L,
                     NT)  # fmt: skip
    else:
        per_group = (num_reqs_padded + 1) * splits
        g = pid // per_group
        b = (pid % per_group) // splits
        s = pid % splits
        lanes = tl.arange(0, BLOCK)
        desc = sdesc + g * STAGE_DESC_WORDS
        src = tl.load(desc + D_SRC).to(tl.pointer_type(tl.int32))
        src_stride = tl.load(desc + D_SRC_STRIDE)
        dst = tl.load(desc + D_DST).to(tl.pointer_type(tl.int32))
        dst_stride = tl.load(desc + D_DST_STRIDE)
        width = tl.load(desc + D_WIDTH)
        slots = tl.load(desc + D_SLOTS).to(tl.pointer_type(tl.int64))
        max_tokens = tl.load(desc + D_MAX_TOKENS)
        max_num_reqs = tl.load(desc + D_MAX_REQS)
        cp_rank = tl.load(desc + D_CP_RANK)
        qsl = qsl_addr.to(tl.pointer_type(QSL_DTYPE))
        c_lo = s.to(tl.int64) * CHUNK
        c_hi = tl.minimum(c_lo + CHUNK, width)
        if b < num_reqs:
            # Device inputs are not checked on the host: clamp what becomes an address, so that a bad value gives
            # wrong slots (as the torch stage does) but never touches memory outside the buffers.
            idx = idx_addr.to(tl.pointer_type(IDX_DTYPE))
            raw = tl.load(idx + b).to(tl.int64)
            real = raw >= 0  # -1: a dummy request (PAD for its tokens, a zero gathered row, its row never read)
            req = tl.minimum(tl.maximum(raw, 0), max_num_reqs - 1)
            src_row = src + req * src_stride
            dst_row = dst + b.to(tl.int64) * dst_stride
            if DO_SLOTS:
                # The entry's first token tile, from the step's inputs only: with PDL this runs while the consume
                # kernel still lands the step's writes (the inputs were written before it began). Only split 0
                # writes the slots.
                block = tl.load(desc + D_BLOCK)
                kbs = tl.load(desc + D_KERNEL_BLOCK)
                k = tl.load(desc + D_K)
                pos_ptr = pos_addr.to(tl.pointer_type(POS_DTYPE))
                pad_ptr = pad_addr.to(tl.pointer_type(tl.uint8))  # (read only with HAS_PADDING)
                t_start = tl.load(qsl + b).to(tl.int64)
                t_end = tl.where(s == 0, tl.load(qsl + b + 1).to(tl.int64), t_start)
                tokens, inside, pos, alive = token_tile(t_start, t_end, lanes, pos_ptr, pad_ptr, max_tokens,
                                                        num_positions, HAS_PADDING)  # fmt: skip
                flags = tl.load(desc + D_FLAGS)
                sharded = (flags & FLAG_SHARDED) != 0
                mapped = real & ((flags & FLAG_SLOTS) != 0)  # (a group without slot mappings: PAD everywhere)
                column, offset, owned = slot_columns(pos, alive, width, block, kbs, k, cp_rank, sharded, CP_SIZE,
                                                     CP_INTERLEAVE)  # fmt: skip
                # (`where`, not `&`: Triton 3.9's interpreter gives a scalar comparison its operand's dtype, and a
                # scalar broadcast with `&` would make the mask that dtype, which its loads refuse)
                owned = tl.where(mapped, owned, False)
            if PDL:
                tl.extra.cuda.gdc_wait()  # the consume kernel's stores to the tables are visible from here on
            count = tl.load(tl.load(desc + D_COUNTS).to(tl.pointer_type(tl.int32)) + req)
            head = tl.load(src_row + c_lo + lanes, mask=c_lo + lanes < c_hi)  # (read with the count: one load less)
            if HAS_WRITES:
                seg_start = tl.zeros([MAX_ROUNDS], dtype=tl.int32)
                seg_len = tl.zeros([MAX_ROUNDS], dtype=tl.int32)
                seg_voff = tl.zeros([MAX_ROUNDS], dtype=tl.int32)
                # The row's staged writes, one per round at most (rounds are occurrences per (table, row)), and its
                # new count from the writes into num_blocks.T's row `req` (later rounds win).
                lanes_r = tl.arange(0, MAX_ROUNDS)
                lanes_s = tl.arange(0, SCAN)
                for r in range(0, num_rounds):
                    w_begin = tl.load(bounds + r, mask=multi, other=0, cache_modifier=".cv")
                    w_end = tl.load(bounds + r + 1, mask=multi, other=num_writes, cache_modifier=".cv")
                    for w0 in range(w_begin, w_end, SCAN):
                        w = w0 + lanes_s
                        live = w < w_end
                        t = tl.load(meta + w * 5 + 0, mask=live, other=-1, cache_modifier=".cv")
                        row = tl.load(meta + w * 5 + 1, mask=live, other=-1, cache_modifier=".cv")
                        mine = live & (row.to(tl.int64) == req)
                        wi = tl.max(tl.where(mine & (t == g), w, -1), axis=0)
                        found = wi >= 0
                        mw = meta + tl.maximum(wi, 0) * 5
                        st = tl.load(mw + 2, mask=found, other=0, cache_modifier=".cv")
                        ln = tl.load(mw + 3, mask=found, other=0, cache_modifier=".cv")
                        vo = tl.load(mw + 4, mask=found, other=0, cache_modifier=".cv")
                        here = (lanes_r == r) & found
                        seg_start = tl.where(here, st, seg_start)
                        seg_len = tl.where(here, ln, seg_len)
                        seg_voff = tl.where(here, vo, seg_voff)
                        wc = tl.max(tl.where(mine & (t == num_groups), w, -1), axis=0)
                        mc = meta + tl.maximum(wc, 0) * 5
                        cst = tl.load(mc + 2, mask=wc >= 0, other=0, cache_modifier=".cv")
                        cln = tl.load(mc + 3, mask=wc >= 0, other=0, cache_modifier=".cv")
                        cvo = tl.load(mc + 4, mask=wc >= 0, other=0, cache_modifier=".cv")
                        covers = (wc >= 0) & (g >= cst) & (g < cst + cln)
                        new = tl.load(values + (cvo + g - cst), mask=covers, other=0, cache_modifier=".cv")
                        count = tl.where(covers, new, count)
                # The columns the row's writes touch: chunks outside them are final in the table already.
                seg_lo = tl.min(tl.where(seg_len > 0, seg_start, 2147483647), axis=0)
                seg_hi = tl.max(tl.where(seg_len > 0, seg_start + seg_len, 0), axis=0)
            if DO_GATHER:
                # A dummy entry gathers nothing: its part of the row becomes zero (below, as a padding row's).
                g_hi = tl.where(real, tl.minimum(count.to(tl.int64), c_hi), 0)
                below = 0  # cells before the sliding window of the request's first scheduled token: 0
                if HAS_WINDOW:
                    reach = tl.load(desc + D_REACH)
                    kbs_w = tl.load(desc + D_KERNEL_BLOCK)
                    nct = tl.load(nct_addr.to(tl.pointer_type(NCT_DTYPE)) + req).to(tl.int64)
                    below = tl.where(reach > 0, tl.maximum(nct - reach, 0) // kbs_w, 0)
                cols0 = c_lo + lanes
                keep0 = cols0 < g_hi
                v0 = head
                if HAS_WRITES:
                    if (c_lo < seg_hi) & (c_lo + BLOCK > seg_lo):
                        v0 = overlay(v0, cols0, keep0, seg_start, seg_len, seg_voff, values, values_all, preloaded,
                                     num_values, MAX_ROUNDS)  # fmt: skip
                if HAS_WINDOW:
                    v0 = tl.where(cols0 < below, 0, v0)
                tl.store(dst_row + cols0, v0, mask=keep0)
                for c in range(c_lo + BLOCK, g_hi, BLOCK):
                    cols = c + lanes
                    keep = cols < g_hi
                    v = tl.load(src_row + cols, mask=keep)
                    if HAS_WRITES:
                        if (c < seg_hi) & (c + BLOCK > seg_lo):
                            v = overlay(v, cols, keep, seg_start, seg_len, seg_voff, values, values_all, preloaded,
                                        num_values, MAX_ROUNDS)  # fmt: skip
                    if HAS_WINDOW:
                        v = tl.where(cols < below, 0, v)
                    tl.store(dst_row + cols, v, mask=keep)
                if not real:
                    for c in range(c_lo, c_hi, BLOCK):
                        cols = c + lanes
                        tl.store(dst_row + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=cols < c_hi)
            if DO_SLOTS:
                ids = tl.load(src_row + column, mask=owned, other=0)
                if HAS_WRITES:
                    if seg_hi > seg_lo:
                        ids = overlay(ids, column, owned, seg_start, seg_len, seg_voff, values, values_all, preloaded,
                                      num_values, MAX_ROUNDS)  # fmt: skip
                tl.store(slots + tokens, tl.where(owned, ids.to(tl.int64) * kbs + offset, PAD), mask=inside)
                for t0 in range(t_start + BLOCK, t_end, BLOCK):
                    tokens, inside, pos, alive = token_tile(t0, t_end, lanes, pos_ptr, pad_ptr, max_tokens,
                                                            num_positions, HAS_PADDING)  # fmt: skip
                    column, offset, owned = slot_columns(pos, alive, width, block, kbs, k, cp_rank, sharded, CP_SIZE,
                                                         CP_INTERLEAVE)  # fmt: skip
                    owned = tl.where(mapped, owned, False)
                    ids = tl.load(src_row + column, mask=owned, other=0)
                    if HAS_WRITES:
                        if seg_hi > seg_lo:
                            ids = overlay(ids, column, owned, seg_start, seg_len, seg_voff, values, values_all,
                                          preloaded, num_values, MAX_ROUNDS)  # fmt: skip
                    tl.store(slots + tokens, tl.where(owned, ids.to(tl.int64) * kbs + offset, PAD), mask=inside)
        elif b < num_reqs_padded:
            if DO_GATHER:  # a padding entry: its part of the row becomes zero
                dst_row = dst + b.to(tl.int64) * dst_stride
                for c in range(c_lo, c_hi, BLOCK):
                    cols = c + lanes
                    tl.store(dst_row + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=cols < c_hi)
        elif s == 0:
            if DO_SLOTS:  # the group's last program: PAD from the end of the scheduled tokens to max_tokens
                first = tl.maximum(tl.load(qsl + num_reqs).to(tl.int64), 0)
                for t in range(first, max_tokens, BLOCK):
                    tokens = t + lanes
                    tl.store(slots + tokens, tl.full([BLOCK], PAD, tl.int64), mask=tokens < max_tokens)
    if done_addr != 0:  # the staging memory this launch read goes back (with writes; and a launcher's validation)
        release_staging(done_addr, token, counter_addr, tl.num_programs(0))


stage_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(stage_kernel_fn)


def noop_args(done_addr: int, counter_addr: int, token: int, scratch: int) -> tuple:
    """Arguments of a launch of one program that writes nothing and stores `token` into `done_addr`: the group's last
    stage program, with no slots to pad. `scratch`: the address of at least 32 zeroed int64 words."""
    return (scratch, scratch, scratch, scratch, counter_addr, done_addr, token, 0, 0, 1, 1, 0, 1, scratch, scratch,
            scratch, scratch, scratch, 0, 0, 0, 1)  # fmt: skip
