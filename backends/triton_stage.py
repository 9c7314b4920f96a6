"""Gather and slot mappings of every KV-cache group in ONE Triton launch, shared by `triton-cuda` and
`triton-rocm` (import only where `import triton` works; `TRITON_INTERPRET` is read at import).

The design of vllm-project/vllm PR #34660 (gather fused with slot mapping, grid `[groups, requests + 1]`),
for all groups at once and with this project's semantics (`multiwrite/stage.py`): program `(g, b)` for a
batch entry `b < num_reqs` copies the request's first `num_blocks` cells into `input_block_tables[g]` and
writes the slots of the entry's tokens; `num_reqs <= b < num_reqs_padded` zeroes its row; the last program
of each group pads the slots from `query_start_loc[num_reqs]` to `max_num_batched_tokens` with -1.

The standalone `gather_block_tables` and `compute_slot_mappings` are one launch each of this kernel.
`BlockTables.prepare_inputs` is ONE launch of `_fused_kernel` (`launch_fused`): the apply's programs and this
grid's programs together, with no grid-wide barrier: each stage program overlays its row's staged writes on
what it reads from the tables, so it sees the row as the apply leaves it whenever the apply's programs run. The
batch is read in place from the arena's lent pinned ring slot, guarded by the apply's completion token.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from multiwrite.backends.triton_kernel import (
    _INTERPRETER_LOCK,
    _PTR,
    _SIZE,
    _STRIDE,
    TritonWriter,
    _LentRing,
    bind_fast_launcher,
    fire_on,
    overlap_rounds,
)

from multiwrite.backend import WriteBatch
from multiwrite.reference import PAD_SLOT_ID
from multiwrite.stage import StageInputs

#: int64 columns of one group's descriptor row.
(D_SRC, D_SRC_STRIDE, D_DST, D_DST_STRIDE, D_WIDTH, D_BLOCK, D_KERNEL_BLOCK, D_K) = range(8)
DESC_COLUMNS = 8
#: Kernel parameters that vary per step; none may become a specialization key (no recompiles).
#: The slot of a token nobody stores, as a compile-time constant of the kernel.
PAD: tl.constexpr = tl.constexpr(PAD_SLOT_ID)
DO_NOT_SPECIALIZE = (
    "desc_ptr", "num_reqs", "num_reqs_padded", "max_tokens", "num_positions", "max_num_reqs", "cp_rank", "nb_stride",
    "slot_stride",
)  # fmt: skip


@triton.jit
def _token_tile(t, end, lanes, pos_ptr, pad_ptr, max_tokens, num_positions, HAS_PADDING: tl.constexpr):
    """Tokens `t + lanes` of a batch entry ending at `end`: `(tokens, inside, pos, alive)`: `inside` the entry's
    tokens below `max_tokens`, `alive` those of them not marked as padding, `pos` their positions as int64 (0 where
    not alive, so junk positions under padding never reach an address)."""
    tokens = t + lanes
    inside = (tokens < end) & (tokens >= 0) & (tokens < max_tokens)
    pos = tl.load(pos_ptr + tokens, mask=inside & (tokens < num_positions), other=0).to(tl.int64)
    alive = inside
    if HAS_PADDING:
        alive = alive & (tl.load(pad_ptr + tokens, mask=inside, other=1) == 0)
    return tokens, inside, tl.where(alive, pos, 0), alive


@triton.jit
def _slot_columns(pos, alive, width, block, kbs, k, cp_rank, CP_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr):
    """`(column, offset, owned)` of positions `pos`: the table column of each token's kernel block (clamped into
    the row of `width` cells), the token's offset in it, and whether this rank owns the token (`alive` ones)."""
    if CP_SIZE == 1:
        column = pos // kbs
        offset = pos % kbs
        owned = alive
    else:
        # ownership and the rank-local offset in manager-block coordinates (vLLM PR #51031)
        virtual = block * CP_SIZE
        vblock = pos // virtual
        within = pos % virtual
        owned = alive & ((within // CP_INTERLEAVE) % CP_SIZE == cp_rank)
        local = (within // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + within % CP_INTERLEAVE
        column = vblock * k + local // kbs
        offset = local % kbs
    return tl.minimum(tl.maximum(column, 0), width - 1), offset, owned


@triton.jit
def _padding_program(b, num_reqs, num_reqs_padded, dst, dst_stride, width, slots, qsl, max_tokens, lanes,
                     DO_GATHER: tl.constexpr, DO_SLOTS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Stage program `b >= num_reqs` of one group: a padding entry (`b < num_reqs_padded`) zeroes its gathered row
    of `width` cells at `dst + b * dst_stride`; the group's last program writes PAD into the slots from
    `qsl[num_reqs]` (the end of the scheduled tokens) up to `max_tokens`."""
    if b < num_reqs_padded:
        if DO_GATHER:
            dst_row = dst + b.to(tl.int64) * dst_stride
            for c in range(0, width, BLOCK):
                cols = c + lanes
                tl.store(dst_row + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=cols < width)
    else:
        if DO_SLOTS:
            first = tl.maximum(tl.load(qsl + num_reqs).to(tl.int64), 0)
            for t in range(first, max_tokens, BLOCK):
                tokens = t + lanes
                tl.store(slots + tokens, tl.full([BLOCK], PAD, tl.int64), mask=tokens < max_tokens)


def _stage_kernel_fn(
    desc_ptr,  # int64 [num_groups, DESC_COLUMNS]: per group the tables' addresses, strides and block sizes
    num_blocks_ptr,  # int32 [num_groups, max_num_reqs] (device)
    nb_stride,
    idx_ptr,  # int32/int64 [num_reqs]
    qsl_ptr,  # int32/int64 [>= num_reqs + 1]
    pos_ptr,  # int32/int64 [num_tokens]
    pad_ptr,  # uint8 [>= num_tokens_padded] (read only if HAS_PADDING)
    slot_ptr,  # int64 [num_groups, max_tokens]
    slot_stride,
    num_reqs,
    num_reqs_padded,
    max_tokens,
    num_positions,  # entries of pos_ptr
    max_num_reqs,  # rows of the tables
    cp_rank,
    CP_SIZE: tl.constexpr,
    CP_INTERLEAVE: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DO_GATHER: tl.constexpr,
    DO_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the consume kernel (graph mode, sm_90+)
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    desc = desc_ptr + g * 8
    src = tl.load(desc + 0).to(tl.pointer_type(tl.int32))
    src_stride = tl.load(desc + 1)
    dst = tl.load(desc + 2).to(tl.pointer_type(tl.int32))
    dst_stride = tl.load(desc + 3)
    width = tl.load(desc + 4)
    slots = slot_ptr + g * slot_stride
    if b < num_reqs:
        # Device inputs are not checked on the host: clamp what becomes an address, so that a bad value
        # gives wrong slots (as the torch path does) but never touches memory outside the buffers.
        req = tl.minimum(tl.maximum(tl.load(idx_ptr + b).to(tl.int64), 0), max_num_reqs - 1)
        src_row = src + req * src_stride
        dst_row = dst + b.to(tl.int64) * dst_stride
        if DO_SLOTS:
            # The entry's first token tile, from the step's inputs only: with PDL this runs while the consume
            # kernel still applies the step's writes (the inputs were written before the consume kernel began).
            block = tl.load(desc + 5)
            kbs = tl.load(desc + 6)
            k = tl.load(desc + 7)
            start = tl.load(qsl_ptr + b).to(tl.int64)
            end = tl.load(qsl_ptr + b + 1).to(tl.int64)
            tokens, inside, pos, alive = _token_tile(start, end, lanes, pos_ptr, pad_ptr, max_tokens, num_positions,
                                                     HAS_PADDING)  # fmt: skip
            column, offset, owned = _slot_columns(pos, alive, width, block, kbs, k, cp_rank, CP_SIZE, CP_INTERLEAVE)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the consume kernel's table and num_blocks stores are visible from here on
        if DO_GATHER:
            # The first BLOCK cells are read together with the count, not after it (one dependent load less).
            count = tl.load(num_blocks_ptr + g * nb_stride + req)
            head = tl.load(src_row + lanes, mask=lanes < width)
            tl.store(dst_row + lanes, head, mask=lanes < count)
            for c in range(BLOCK, count, BLOCK):
                cols = c + lanes
                keep = cols < count
                tl.store(dst_row + cols, tl.load(src_row + cols, mask=keep), mask=keep)
        if DO_SLOTS:
            ids = tl.load(src_row + column, mask=owned, other=0).to(tl.int64)
            tl.store(slots + tokens, tl.where(owned, ids * kbs + offset, PAD), mask=inside)
            for t in range(start + BLOCK, end, BLOCK):
                tokens, inside, pos, alive = _token_tile(t, end, lanes, pos_ptr, pad_ptr, max_tokens, num_positions,
                                                         HAS_PADDING)  # fmt: skip
                column, offset, owned = _slot_columns(pos, alive, width, block, kbs, k, cp_rank, CP_SIZE,
                                                      CP_INTERLEAVE)  # fmt: skip
                ids = tl.load(src_row + column, mask=owned, other=0).to(tl.int64)
                tl.store(slots + tokens, tl.where(owned, ids * kbs + offset, PAD), mask=inside)
    else:
        _padding_program(b, num_reqs, num_reqs_padded, dst, dst_stride, width, slots, qsl_ptr, max_tokens, lanes,
                         DO_GATHER, DO_SLOTS, BLOCK)  # fmt: skip


_stage_kernel = triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)(_stage_kernel_fn)
INTERPRETED = not isinstance(_stage_kernel, triton.runtime.JITFunction)
#: Lanes per program: a decode step's row or token run fits one iteration; 4 warps of 32 / 4 wavefronts of 64.
BLOCK = 256
NUM_WARPS = 4


def compilable_kernel() -> triton.runtime.JITFunction:
    """The kernel as a `JITFunction`, even under the interpreter (for `triton.compile` in tests)."""
    if not INTERPRETED:
        return _stage_kernel
    return triton.runtime.JITFunction(_stage_kernel_fn, do_not_specialize=DO_NOT_SPECIALIZE)


#: (device, storage addresses, shapes, strides, sizes) -> device int64 descriptors; holds no table.
_descriptors: dict[tuple, torch.Tensor] = {}


def _descriptor_table(stage: StageInputs) -> torch.Tensor:
    key = (
        stage.num_blocks.device,
        *(t.data_ptr() for t in stage.tables),
        *(t.stride(0) for t in stage.tables),
        *(t.shape[1] for t in stage.tables),
        *(t.data_ptr() for t in stage.input_block_tables),
        *(t.stride(0) for t in stage.input_block_tables),
        *stage.block_sizes,
        *stage.kernel_block_sizes,
    )
    desc = _descriptors.get(key)
    if desc is None:
        if len(_descriptors) >= 64:
            _descriptors.clear()
        rows = [
            (src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), src.shape[1], bs, kbs, k)
            for src, dst, bs, kbs, k in zip(
                stage.tables, stage.input_block_tables, stage.block_sizes, stage.kernel_block_sizes,
                stage.kernel_blocks_per_block,
            )
        ]  # fmt: skip
        assert all(t.stride(1) == 1 for t in (*stage.tables, *stage.input_block_tables))
        desc = _descriptors[key] = torch.tensor(rows, dtype=torch.int64, device=stage.num_blocks.device)
    return desc


#: The launch option of a programmatic dependent launch (Triton >= 3.4, CUDA backend).
_PDL_LAUNCH = {"launch_pdl": True}


def launch_stage(
    stage: StageInputs, *, desc: torch.Tensor | None = None, scratch: torch.Tensor | None = None, pdl: bool = False
) -> None:
    """The jobs `stage` asks for (gather, slot mappings, or both) in one launch on the current stream.

    Leaves `input_block_tables` and `slot_mappings` exactly as `multiwrite.stage.run_stage_torch` does for
    inputs that pass `BlockTables`' checks; no host synchronization.

    Args:
        desc: the stage descriptors to launch with (a capture passes ones it keeps alive: the kernel reads
            them by address at every replay); default: `_descriptor_table(stage)` from the module cache.
        scratch: an int64 `[1, 1]` buffer standing in for `slot_mappings` when the tables have none (a
            capture passes one it keeps alive); default: a fresh one.
        pdl: launch as a programmatic dependent launch (CUDA, sm_90 or newer, not the interpreter: the caller
            checks): the grid may start while the kernel before it on the stream still runs, and reads the tables
            and `num_blocks` only after `griddepcontrol.wait` (every store of that kernel is then visible). Only
            for a kernel before it that writes nothing else this launch reads: graph mode's consume kernel.
    """
    if not (stage.do_gather or stage.do_slots):
        return
    slots = stage.slot_mappings
    if slots is None:  # a gather of tables built without max_num_batched_tokens: any int64 buffer will do
        slots = stage.num_blocks.new_empty((1, 1), dtype=torch.int64) if scratch is None else scratch
    padding = stage.is_padding
    grid = (len(stage.tables), stage.num_reqs_padded + 1)
    if desc is None:
        desc = _descriptor_table(stage)
    _stage_kernel[grid](
        desc, stage.num_blocks, stage.num_blocks.stride(0), stage.idx_mapping,
        slots if stage.query_start_loc is None else stage.query_start_loc,
        slots if stage.positions is None else stage.positions,
        slots if padding is None else padding.view(torch.uint8), slots, slots.stride(0),
        stage.num_reqs, stage.num_reqs_padded, slots.shape[1],
        0 if stage.positions is None else stage.positions.shape[0], stage.num_blocks.shape[1], stage.cp_rank,
        CP_SIZE=stage.cp_size, CP_INTERLEAVE=stage.cp_interleave, HAS_PADDING=padding is not None,
        DO_GATHER=stage.do_gather, DO_SLOTS=stage.do_slots, BLOCK=BLOCK, PDL=pdl, num_warps=NUM_WARPS,
        **_PDL_LAUNCH if pdl else {},
    )  # fmt: skip


# -------------------------------------------------------------------------------------------------
# The whole stage in ONE launch: apply + gather + slot mappings (`BlockTables.prepare_inputs`)
# -------------------------------------------------------------------------------------------------
#: Most rounds (writes to one (table, row) in one batch) the fused kernel overlays; more: two launches.
MAX_ROUNDS = 8
#: Writes per apply tile, cells per apply column chunk, writes per overlay scan tile.
APPLY_W, APPLY_L, SCAN_W = 32, 64, 128
#: Kernel parameters of the fused kernel that vary per step; none may become a specialization key.
FUSED_DO_NOT_SPECIALIZE = (
    "wdesc_addr", "sdesc_addr", "meta_addr", "values_addr", "bounds_addr", "counter_addr", "done_addr", "token",
    "num_writes", "num_values", "num_rounds", "apply_tiles", "apply_programs", "num_groups", "nb_addr", "nb_stride",
    "idx_addr", "qsl_addr", "pos_addr", "pad_addr", "slot_addr", "slot_stride", "num_reqs", "num_reqs_padded",
    "max_tokens", "num_positions", "max_num_reqs", "cp_rank",
)  # fmt: skip
#: Index dtypes the fused kernel reads its step inputs as (one compiled variant each).
TL_INDEX = {torch.int32: tl.int32, torch.int64: tl.int64}


@triton.jit
def _overlay(v, cols, keep, seg_start, seg_len, seg_voff, values, num_values, MAX_R: tl.constexpr):
    """`v` (cells `cols` of one table row, as read) with the row's staged writes laid over it: round `r`'s
    write covers `[seg_start[r], seg_start[r] + seg_len[r])`, and the latest round that covers a cell wins."""
    lanes_r = tl.arange(0, MAX_R).to(tl.int64)
    start = seg_start.to(tl.int64)[:, None]
    c = cols.to(tl.int64)[None, :]
    cover = (c >= start) & (c < start + seg_len.to(tl.int64)[:, None]) & keep[None, :]
    winner = tl.max(tl.where(cover, lanes_r[:, None], -1), axis=0)
    pick = cover & (lanes_r[:, None] == winner[None, :])
    vidx = tl.sum(tl.where(pick, seg_voff.to(tl.int64)[:, None] + c - start, 0), axis=0)
    hit = winner >= 0
    new = tl.load(values + vidx, mask=hit & (vidx < num_values), other=0, cache_modifier=".cv")
    return tl.where(hit, new, v)


def _fused_kernel_fn(
    wdesc_addr: tl.int64,  # device int64 [num_groups + 1, 5]: the writer's descriptors of the batch's tables
    sdesc_addr: tl.int64,  # device int64 [num_groups, DESC_COLUMNS]: the stage descriptors
    meta_addr: tl.int64,  # int32 [num_writes, 5] staged writes (a pinned ring slot on a GPU)
    values_addr: tl.int64,  # int32 [num_values] (the same slot)
    bounds_addr: tl.int64,  # int32 [num_rounds + 1] first write of each round (read only if num_rounds > 1)
    counter_addr: tl.int64,  # device int32: programs of this launch that finished
    done_addr: tl.int64,  # int32 host word: receives `token` once every program has finished
    token: tl.int32,
    num_writes: tl.int32,
    num_values: tl.int32,
    num_rounds: tl.int32,
    apply_tiles: tl.int32,  # apply programs along the writes (tiles of APPLY_W)
    apply_programs: tl.int32,  # apply_tiles x column splits: the LAST programs of the grid; the others stage
    num_groups: tl.int32,  # tables 0..num_groups-1 are the groups, table num_groups is num_blocks.T
    nb_addr: tl.int64,  # device int32 [num_groups, max_num_reqs]: num_blocks
    nb_stride: tl.int64,
    idx_addr: tl.int64,  # [num_reqs] of IDX_DTYPE
    qsl_addr: tl.int64,  # [>= num_reqs + 1] of QSL_DTYPE
    pos_addr: tl.int64,  # [num_positions] of POS_DTYPE
    pad_addr: tl.int64,  # uint8 [>= num_tokens_padded] (read only if HAS_PADDING)
    slot_addr: tl.int64,  # int64 [num_groups, max_tokens]
    slot_stride: tl.int64,
    num_reqs: tl.int32,
    num_reqs_padded: tl.int32,
    max_tokens: tl.int32,
    num_positions: tl.int32,
    max_num_reqs: tl.int32,
    cp_rank: tl.int32,
    IDX_DTYPE: tl.constexpr,
    QSL_DTYPE: tl.constexpr,
    POS_DTYPE: tl.constexpr,
    CP_SIZE: tl.constexpr,
    CP_INTERLEAVE: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DO_GATHER: tl.constexpr,
    DO_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    SCAN: tl.constexpr,
    MAX_R: tl.constexpr,
):
    """Apply the staged writes AND gather AND compute slot mappings, in one launch, with no grid barrier.

    The last `apply_programs` programs apply the writes as the apply kernel does (tiles of writes x column
    chunks; with several rounds, one program applies them in order). Program `s` before them is stage program
    `(g, b) = divmod(s, num_reqs_padded + 1)` of `launch_stage`'s grid; it reads row `idx_mapping[b]` of group
    `g` (and its `num_blocks`) as the apply LEAVES it, whenever the apply programs run: it overlays that row's
    staged writes (at most one per round, later rounds win) on what it reads from the table, and cells no write
    covers are final in the table already. The last program to finish stores `token` into the slot's done word
    (the slot guard).
    """
    pid = tl.program_id(0)
    stage_programs = tl.num_programs(0) - apply_programs
    meta = meta_addr.to(tl.pointer_type(tl.int32))
    values = values_addr.to(tl.pointer_type(tl.int32))
    bounds = bounds_addr.to(tl.pointer_type(tl.int32))
    multi = num_rounds > 1
    if pid >= stage_programs:
        # ---- the apply: one tile of writes, one column split. Last in the grid, so that the interpreter (which
        # runs programs in order) runs every stage program before it: the overlay's hardest case ----
        a = pid - stage_programs
        pid_w = a % apply_tiles
        pid_s = a // apply_tiles
        n_s = apply_programs // apply_tiles
        wdesc = wdesc_addr.to(tl.pointer_type(tl.int64))
        lanes_w = tl.arange(0, BLOCK_W)
        lanes_l = tl.arange(0, BLOCK_L)
        for r in range(0, num_rounds):
            w_begin = tl.load(bounds + r, mask=multi, other=0, cache_modifier=".cv")
            w_end = tl.load(bounds + r + 1, mask=multi, other=num_writes, cache_modifier=".cv")
            for w0 in range(w_begin + pid_w * BLOCK_W, w_end, apply_tiles * BLOCK_W):
                w = w0 + lanes_w
                live = w < w_end
                m = meta + w * 5
                t = tl.load(m + 0, mask=live, other=-1, cache_modifier=".cv")
                row = tl.load(m + 1, mask=live, other=-1, cache_modifier=".cv")
                start = tl.load(m + 2, mask=live, other=-1, cache_modifier=".cv")
                length = tl.load(m + 3, mask=live, other=0, cache_modifier=".cv")
                voff = tl.load(m + 4, mask=live, other=0, cache_modifier=".cv")
                live = live & (t >= 0) & (t <= num_groups) & (row >= 0) & (start >= 0) & (length > 0)
                d = wdesc + t.to(tl.int64) * 5
                base = tl.load(d + 0, mask=live, other=0)
                row_stride = tl.load(d + 1, mask=live, other=0)
                col_stride = tl.load(d + 2, mask=live, other=0)
                rows = tl.load(d + 3, mask=live, other=0)
                ncols = tl.load(d + 4, mask=live, other=0)
                live = live & (row.to(tl.int64) < rows)
                cells = tl.where(live, length, 0)
                dst = base.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * row_stride
                max_cells = tl.max(cells, axis=0)
                for c0 in range(pid_s * BLOCK_L, max_cells, n_s * BLOCK_L):
                    pos = c0 + lanes_l
                    col = start[:, None].to(tl.int64) + pos[None, :]
                    vidx = voff[:, None] + pos[None, :]
                    keep = (pos[None, :] < cells[:, None]) & (col < ncols[:, None]) & (vidx < num_values)
                    v = tl.load(values + vidx, mask=keep, other=0, cache_modifier=".cv")
                    tl.store(dst[:, None] + col * col_stride[:, None], v, mask=keep)
            tl.debug_barrier()
    else:
        # ---- the stage: program (g, b) of the grid [num_groups, num_reqs_padded + 1] ----
        g = pid // (num_reqs_padded + 1)
        b = pid % (num_reqs_padded + 1)
        lanes = tl.arange(0, BLOCK)
        desc = sdesc_addr.to(tl.pointer_type(tl.int64)) + g * 8
        src = tl.load(desc + 0).to(tl.pointer_type(tl.int32))
        src_stride = tl.load(desc + 1)
        dst = tl.load(desc + 2).to(tl.pointer_type(tl.int32))
        dst_stride = tl.load(desc + 3)
        width = tl.load(desc + 4)
        slots = slot_addr.to(tl.pointer_type(tl.int64)) + g * slot_stride
        qsl = qsl_addr.to(tl.pointer_type(QSL_DTYPE))
        if b < num_reqs:
            idx = idx_addr.to(tl.pointer_type(IDX_DTYPE))
            req = tl.minimum(tl.maximum(tl.load(idx + b).to(tl.int64), 0), max_num_reqs - 1)
            src_row = src + req * src_stride
            dst_row = dst + b.to(tl.int64) * dst_stride
            # The row's staged writes, one per round at most (rounds are occurrences per (table, row)), and its
            # new num_blocks[g] from the writes into num_blocks.T's row `req` (later rounds win).
            count = tl.load(nb_addr.to(tl.pointer_type(tl.int32)) + g * nb_stride + req)
            lanes_r = tl.arange(0, MAX_R)
            seg_start = tl.zeros([MAX_R], dtype=tl.int32)
            seg_len = tl.zeros([MAX_R], dtype=tl.int32)
            seg_voff = tl.zeros([MAX_R], dtype=tl.int32)
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
                    if DO_GATHER:
                        wc = tl.max(tl.where(mine & (t == num_groups), w, -1), axis=0)
                        mc = meta + tl.maximum(wc, 0) * 5
                        cst = tl.load(mc + 2, mask=wc >= 0, other=0, cache_modifier=".cv")
                        cln = tl.load(mc + 3, mask=wc >= 0, other=0, cache_modifier=".cv")
                        cvo = tl.load(mc + 4, mask=wc >= 0, other=0, cache_modifier=".cv")
                        covers = (wc >= 0) & (g >= cst) & (g < cst + cln)
                        new = tl.load(values + (cvo + g - cst), mask=covers, other=0, cache_modifier=".cv")
                        count = tl.where(covers, new, count)
            written = tl.max(seg_len, axis=0) > 0
            if DO_GATHER:
                for c in range(0, count, BLOCK):
                    cols = c + lanes
                    keep = cols < count
                    v = tl.load(src_row + cols, mask=keep)
                    if written:
                        v = _overlay(v, cols, keep, seg_start, seg_len, seg_voff, values, num_values, MAX_R)
                    tl.store(dst_row + cols, v, mask=keep)
            if DO_SLOTS:
                block = tl.load(desc + 5)
                kbs = tl.load(desc + 6)
                k = tl.load(desc + 7)
                pos_ptr = pos_addr.to(tl.pointer_type(POS_DTYPE))
                start = tl.load(qsl + b).to(tl.int64)
                end = tl.load(qsl + b + 1).to(tl.int64)
                pad_ptr = pad_addr.to(tl.pointer_type(tl.uint8))  # (read only with HAS_PADDING)
                for t0 in range(start, end, BLOCK):
                    tokens, inside, pos, alive = _token_tile(t0, end, lanes, pos_ptr, pad_ptr, max_tokens,
                                                             num_positions, HAS_PADDING)  # fmt: skip
                    column, offset, owned = _slot_columns(pos, alive, width, block, kbs, k, cp_rank, CP_SIZE,
                                                          CP_INTERLEAVE)  # fmt: skip
                    ids = tl.load(src_row + column, mask=owned, other=0)
                    if written:
                        ids = _overlay(ids, column, owned, seg_start, seg_len, seg_voff, values, num_values, MAX_R)
                    tl.store(slots + tokens, tl.where(owned, ids.to(tl.int64) * kbs + offset, PAD), mask=inside)
        else:
            _padding_program(b, num_reqs, num_reqs_padded, dst, dst_stride, width, slots, qsl, max_tokens, lanes,
                             DO_GATHER, DO_SLOTS, BLOCK)  # fmt: skip
    # Completion: the last program to finish (every other program's reads of the slot are done) resets the
    # counter and hands the slot back to the host (the apply kernel's guard, over the whole grid).
    tl.debug_barrier()
    counter = counter_addr.to(tl.pointer_type(tl.int32))
    finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = finished == tl.num_programs(0) - 1
    tl.atomic_xchg(counter, 0, mask=last, sem="acq_rel", scope="gpu")
    tl.store(done_addr.to(tl.pointer_type(tl.int32)), token, mask=last, cache_modifier=".wt")


_fused_kernel = triton.jit(do_not_specialize=FUSED_DO_NOT_SPECIALIZE)(_fused_kernel_fn)


def compilable_fused_kernel() -> triton.runtime.JITFunction:
    """The fused kernel as a `JITFunction`, even under the interpreter (for `triton.compile` in tests)."""
    if not INTERPRETED:
        return _fused_kernel
    return triton.runtime.JITFunction(_fused_kernel_fn, do_not_specialize=FUSED_DO_NOT_SPECIALIZE)


def _batch_is_the_stage(batch: WriteBatch, stage: StageInputs) -> bool:
    """Whether `batch` writes exactly the stage's tables: groups 0..G-1, then `num_blocks.T` (a `BlockTables`)."""
    tables, G = batch.tables, len(stage.tables)
    if len(tables) != G + 1 or tables[0].dtype != torch.int32:
        return False
    counts = tables[G]
    nb = stage.num_blocks
    return (
        all(a.data_ptr() == b.data_ptr() and a.stride() == b.stride() for a, b in zip(tables, stage.tables))
        and counts.data_ptr() == nb.data_ptr()
        and tuple(counts.shape) == (nb.shape[1], nb.shape[0])
        and counts.stride() == (nb.stride(1), nb.stride(0))
    )


class _FusedLauncher:
    """Launches the fused kernel for one `TritonWriter`: Triton's JIT for the first launch of each compiled
    variant, then (GPU) a fast launcher bound and validated as the writer binds its own (`TritonWriter._bind_fast`):
    Triton's compiled C launcher called directly (NVIDIA), else `CompiledKernel.run`."""

    def __init__(self, writer: TritonWriter):
        self.writer = writer
        self.fire: dict[tuple, Callable | None] = {}
        self.launch_path = "interpreter" if INTERPRETED else "jit"
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None
        self._done: torch.Tensor | None = None

    def launch(self, grid0: int, args: tuple, consts: dict, key: tuple) -> None:
        """Launch `grid0` programs with `args` and the variant `consts` (`key`: a hashable name of them)."""
        fire = self.fire.get(key)
        writer = self.writer
        if fire is not None:
            fire_on(fire, writer._index, grid0, 1, args)
            return
        if not writer.is_gpu:
            with _INTERPRETER_LOCK:  # the interpreter keeps the program ids in global state
                _fused_kernel[(grid0,)](*args, **consts, num_warps=NUM_WARPS, num_stages=1)
            return
        with self._lock, torch.cuda.device(writer._index):
            kernel = _fused_kernel[(grid0,)](*args, **consts, num_warps=NUM_WARPS, num_stages=1)
            if key not in self.fire and writer.launcher != "jit":
                self.fire[key] = self._bind_fast(kernel, tuple(consts.values()))

    def _bind_fast(self, kernel, consts: tuple) -> Callable | None:
        """`fire(grid0, 1, stream, args)` bypassing the JIT, or None (then the JIT launches every time); bound
        exactly as the writer binds its own (`triton_kernel.bind_fast_launcher`)."""
        writer = self.writer
        fire, self.launch_path = bind_fast_launcher(kernel, consts, writer.device, writer.launcher, self._validate)
        return fire

    def _validate(self, fire) -> None:
        """One no-op launch (one stage program with nothing to do) on a stream of its own: it must store its
        token into a pinned word of this launcher."""
        writer = self.writer
        if self._scratch is None:
            self._scratch = torch.zeros(16, dtype=torch.int64, device=writer.device)
            self._done = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            torch.cuda.synchronize(writer.device)
        assert self._done is not None
        token = int(self._done[0]) % 0x7FFFFFFF + 1
        z = self._scratch.data_ptr()
        counter = z + 8 * 15  # an int32 word of the zeroed scratch, reset by the launch itself
        args = (z, z, z, z, z, counter, self._done.data_ptr(), token, 0, 0, 1, 1, 0, 1, z, 0, z, z, z, z, z, 0,
                0, 0, 0, 0, 1, 0)  # fmt: skip
        with torch.cuda.device(writer._index):
            stream = torch.cuda.Stream(writer.device)
            fire(1, 1, stream.cuda_stream, args)
            stream.synchronize()
        if int(self._done[0]) != token:
            raise RuntimeError(f"validation launch did not complete (done word {int(self._done[0])} != {token})")


_launchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_launchers_lock = threading.Lock()


def _launcher(writer: TritonWriter) -> _FusedLauncher:
    launcher = _launchers.get(writer)
    if launcher is None:
        with _launchers_lock:
            launcher = _launchers.get(writer)
            if launcher is None:
                launcher = _launchers[writer] = _FusedLauncher(writer)
    return launcher


def fused_launch_path(writer: TritonWriter) -> str:
    """How the fused kernel is launched for `writer` (`TritonWriter.launch_path`'s vocabulary); "" before use."""
    launcher = _launchers.get(writer)
    return "" if launcher is None else launcher.launch_path


class _FusedPlan:
    """What the fused launch of one `BlockTables` reuses on every call (its tables never move): the writer's
    descriptors of the batch's tables, the stage descriptors, the fixed kernel arguments, the compiled
    variants' constants. Kept in `StageInputs.plans` under the writer; holds no reference to the `BlockTables`."""

    __slots__ = ("batch_tables", "desc", "sdesc", "sdesc_addr", "slots", "fixed", "slot_args", "rows_args",
                 "consts", "launcher")  # fmt: skip

    def __init__(self, writer: TritonWriter, batch_tables: list[torch.Tensor], desc, stage: StageInputs):
        self.batch_tables = batch_tables  # the writer hands this same list over while the layout holds
        self.desc = desc
        self.sdesc = _descriptor_table(stage)  # kept alive here: the module cache may evict it
        self.sdesc_addr = self.sdesc.data_ptr()
        slots = stage.slot_mappings
        if slots is None:  # a gather of tables built without max_num_batched_tokens: any int64 buffer will do
            slots = stage.num_blocks.new_empty((1, 1), dtype=torch.int64)
        self.slots = slots
        nb = stage.num_blocks
        # Fixed kernel arguments, in the kernel's order: (num_groups, nb_addr, nb_stride), then after the step's
        # inputs (slot_addr, slot_stride), and after num_reqs and num_reqs_padded, max_tokens.
        self.fixed = (len(stage.tables), nb.data_ptr(), nb.stride(0))
        self.slot_args = (slots.data_ptr(), slots.stride(0))
        self.rows_args = (nb.shape[1], stage.cp_rank)  # (max_num_reqs, cp_rank): after num_positions
        self.consts: dict[tuple, tuple[dict, tuple]] = {}
        self.launcher = _launcher(writer)


def _plan(writer: TritonWriter, batch: WriteBatch, stage: StageInputs) -> _FusedPlan | None:
    """The fused plan of `stage`'s tables for `batch`, from the cache when the batch is the one the writer hands
    over for these tables; None when the batch cannot go through the fused kernel (see `launch_fused`)."""
    plan = stage.plans.get(writer)
    config = stage._config
    pristine = (
        stage.tables is config.tables
        and stage.input_block_tables is config.input_block_tables
        and stage.slot_mappings is config.slot_mappings
        and stage.num_blocks is config.num_blocks
    )
    if plan is not None and pristine and batch.tables is plan.batch_tables:
        return plan
    if not _batch_is_the_stage(batch, stage):
        return None
    tables = batch.tables
    key = (*map(_PTR, tables), *map(_SIZE, tables), *map(_STRIDE, tables))
    found = writer._descs.get(key)
    desc = writer._new_descriptors(key, tables) if found is None else found
    if desc.aliased:
        return None
    plan = _FusedPlan(writer, tables, desc, stage)
    if pristine:
        stage.plans[writer] = plan
    return plan


def _constants(plan: _FusedPlan, stage: StageInputs) -> tuple[dict, tuple]:
    """The compile-time constants of this call's kernel variant, and the variant's key."""
    idx, qsl, pos = stage.idx_mapping, stage.query_start_loc, stage.positions
    qsl_dtype = torch.int64 if qsl is None else qsl.dtype
    pos_dtype = torch.int64 if pos is None else pos.dtype
    key = (idx.dtype, qsl_dtype, pos_dtype, stage.is_padding is not None, stage.do_gather, stage.do_slots,
           stage.cp_size, stage.cp_interleave)  # fmt: skip
    found = plan.consts.get(key)
    return variant_constants(plan, key) if found is None else found


def variant_constants(plan: _FusedPlan, key: tuple) -> tuple[dict, tuple]:
    """`(constants, key)` of the fused kernel's variant `key` = (idx_mapping dtype, query_start_loc dtype,
    positions dtype, has is_padding, do_gather, do_slots, cp_size, cp_interleave), cached in `plan.consts`."""
    found = plan.consts.get(key)
    if found is None:
        idx_dtype, qsl_dtype, pos_dtype, has_padding, do_gather, do_slots, cp_size, cp_interleave = key
        consts = {
            "IDX_DTYPE": TL_INDEX[idx_dtype], "QSL_DTYPE": TL_INDEX[qsl_dtype], "POS_DTYPE": TL_INDEX[pos_dtype],
            "CP_SIZE": cp_size, "CP_INTERLEAVE": cp_interleave, "HAS_PADDING": has_padding,
            "DO_GATHER": do_gather, "DO_SLOTS": do_slots, "BLOCK": BLOCK, "BLOCK_W": APPLY_W,
            "BLOCK_L": APPLY_L, "SCAN": SCAN_W, "MAX_R": MAX_ROUNDS,
        }  # fmt: skip
        found = plan.consts[key] = (consts, tuple(consts.values()))
    return found


def launch_fused(writer: TritonWriter, batch: WriteBatch, stage: StageInputs) -> bool:
    """Apply `batch` and run the jobs `stage` asks for in ONE launch on the current stream; no host sync.

    The batch is read in place where it was staged (the arena's lent pinned ring slot), else copied into a
    slot of the writer's shared ring (overlapping writes: reordered into rounds first, as the apply does);
    either way the slot is guarded as the apply guards it (a completion token stored by the kernel, or an
    event). Leaves the tables, `num_blocks`, `input_block_tables` and `slot_mappings` exactly as
    `writer.apply([batch])` followed by `launch_stage(stage)`.

    What is fixed for a `BlockTables` (descriptors, fixed arguments, constants) is computed on its first
    call and kept in `stage.plans` (`_FusedPlan`): a decode step's launch then reads only the step's inputs.

    Returns:
        False, having done nothing, when this batch cannot go through the fused kernel (it does not write
        exactly the stage's tables, its tables alias, or a row is written in more than `MAX_ROUNDS` rounds):
        the caller then applies and launches the stage separately.
    """
    if not (stage.do_gather or stage.do_slots):
        return False
    plan = _plan(writer, batch, stage)
    if plan is None:
        return False
    meta, values = batch.meta, batch.values
    w, v = meta.shape[0], values.shape[0]
    lent = batch.buffers
    bounds = None
    rounds = 1
    in_place = lent.__class__ is _LentRing and lent.owner is writer and not batch.may_overlap  # type: ignore[union-attr]
    if not in_place and batch.may_overlap:
        meta, bounds = overlap_rounds(meta)
        rounds = bounds.shape[0] - 1
        if rounds > MAX_ROUNDS:
            return False
    if rounds > 1:
        tiles = splits = 1
    else:
        tiles = (w + APPLY_W - 1) // APPLY_W or 1
        splits = 1 if v <= 256 else max(1, min((v + APPLY_L - 1) // APPLY_L, 64, writer._max_programs // tiles))
    num_reqs_padded = stage.num_reqs_padded
    grid0 = tiles * splits + plan.fixed[0] * (num_reqs_padded + 1)
    consts, variant = _constants(plan, stage)
    # An empty tensor's address is 0, which the interpreter would take for an int32: point at the slots instead
    # (the kernel never reads an empty input).
    fallback = plan.slot_args[0]
    qsl, pos, pad = stage.query_start_loc, stage.positions, stage.is_padding
    step = (
        *plan.fixed, stage.idx_mapping.data_ptr() or fallback,
        fallback if qsl is None else qsl.data_ptr() or fallback,
        fallback if pos is None else pos.data_ptr() or fallback,
        fallback if pad is None else pad.data_ptr() or fallback, *plan.slot_args,
        stage.num_reqs, num_reqs_padded, plan.slots.shape[1], 0 if pos is None else pos.shape[0], *plan.rows_args,
    )  # fmt: skip
    launcher = plan.launcher
    lock = None
    if in_place:
        ring, i = lent.ring, lent.current  # type: ignore[union-attr]  # staged in place: no copy
        slot = ring.slots[i]
    else:
        lock = writer._lock  # the shared ring: held from taking the slot until the launch is recorded
        lock.acquire()
        try:
            ring = writer._ring
            i = ring.take(w, v)
            slot = ring.slots[i]
            if bounds is not None:
                slot.bounds[: rounds + 1] = bounds
            slot.meta[:w] = meta
            slot.views[values.dtype][:v] = values
        except BaseException:
            lock.release()
            raise
    token = ring.next_token(i)
    desc = plan.desc
    slot.desc = desc  # alive until this launch is seen finished (the slot's next take)
    args = (
        desc.addr, plan.sdesc_addr, slot.meta_addr, slot.values_addr, slot.bounds_addr, ring.counter_addr[i],
        ring.done_addr[i], token, w, v, rounds, tiles, tiles * splits, *step,
    )  # fmt: skip
    try:
        launcher.launch(grid0, args, consts, variant)
        ring.launched(i)
    except BaseException:
        ring.done_mv[i] = token  # nothing was launched: the slot is free
        raise
    finally:
        if lock is not None:
            lock.release()
    return True
