"""Gather and slot mappings of every KV-cache group in ONE Triton launch, shared by `triton-cuda` and
`triton-rocm` (import only where `import triton` works; `TRITON_INTERPRET` is read at import).

The design of vllm-project/vllm PR #34660 (gather fused with slot mapping, grid `[groups, requests + 1]`),
for all groups at once and with this project's semantics (`multiwrite/stage.py`): program `(g, b)` for a
batch entry `b < num_reqs` copies the request's first `num_blocks` cells into `input_block_tables[g]` and
writes the slots of the entry's tokens; `num_reqs <= b < num_reqs_padded` zeroes its row; the last program
of each group pads the slots from `query_start_loc[num_reqs]` to `max_num_batched_tokens` with -1.

It runs after the apply launch on the same stream, so a step's stage is two launches on a GPU (the standalone
`gather_block_tables` and `compute_slot_mappings` are one launch each, of the same kernel). Folding the
apply into the same launch (each gathering program overlaying its row's staged writes on what it reads, so
no grid-wide barrier is needed) is the next step; it needs the apply kernel's pinned ring and slot guard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
        if DO_GATHER:
            count = tl.load(num_blocks_ptr + g * nb_stride + req)
            for c in range(0, count, BLOCK):
                cols = c + lanes
                keep = cols < count
                tl.store(dst_row + cols, tl.load(src_row + cols, mask=keep), mask=keep)
        if DO_SLOTS:
            block = tl.load(desc + 5)
            kbs = tl.load(desc + 6)
            k = tl.load(desc + 7)
            start = tl.load(qsl_ptr + b).to(tl.int64)
            end = tl.load(qsl_ptr + b + 1).to(tl.int64)
            for t in range(start, end, BLOCK):
                tokens = t + lanes
                inside = (tokens < end) & (tokens >= 0) & (tokens < max_tokens)
                pos = tl.load(pos_ptr + tokens, mask=inside & (tokens < num_positions), other=0).to(tl.int64)
                live = inside
                if HAS_PADDING:
                    live = live & (tl.load(pad_ptr + tokens, mask=inside, other=1) == 0)
                pos = tl.where(live, pos, 0)  # junk positions under padding never reach an address
                if CP_SIZE == 1:
                    column = pos // kbs
                    offset = pos % kbs
                    owned = live
                else:
                    # ownership and the rank-local offset in manager-block coordinates (vLLM PR #51031)
                    virtual = block * CP_SIZE
                    vblock = pos // virtual
                    within = pos % virtual
                    owned = live & ((within // CP_INTERLEAVE) % CP_SIZE == cp_rank)
                    local = (within // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + within % CP_INTERLEAVE
                    column = vblock * k + local // kbs
                    offset = local % kbs
                column = tl.minimum(tl.maximum(column, 0), width - 1)
                ids = tl.load(src_row + column, mask=owned, other=0).to(tl.int64)
                tl.store(slots + tokens, tl.where(owned, ids * kbs + offset, PAD), mask=inside)
    elif b < num_reqs_padded:
        if DO_GATHER:
            dst_row = dst + b.to(tl.int64) * dst_stride
            for c in range(0, width, BLOCK):
                cols = c + lanes
                tl.store(dst_row + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=cols < width)
    else:
        if DO_SLOTS:
            first = tl.maximum(tl.load(qsl_ptr + num_reqs).to(tl.int64), 0)
            for t in range(first, max_tokens, BLOCK):
                tokens = t + lanes
                tl.store(slots + tokens, tl.full([BLOCK], PAD, tl.int64), mask=tokens < max_tokens)


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


def launch_stage(stage: StageInputs) -> None:
    """The jobs `stage` asks for (gather, slot mappings, or both) in one launch on the current stream.

    Leaves `input_block_tables` and `slot_mappings` exactly as `multiwrite.stage.run_stage_torch` does for
    inputs that pass `BlockTables`' checks; no host synchronization.
    """
    if not (stage.do_gather or stage.do_slots):
        return
    slots = stage.slot_mappings
    if slots is None:  # a gather of tables built without max_num_batched_tokens: any int64 buffer will do
        slots = stage.num_blocks.new_empty((1, 1), dtype=torch.int64)
    padding = stage.is_padding
    grid = (len(stage.tables), stage.num_reqs_padded + 1)
    _stage_kernel[grid](
        _descriptor_table(stage), stage.num_blocks, stage.num_blocks.stride(0), stage.idx_mapping,
        slots if stage.query_start_loc is None else stage.query_start_loc,
        slots if stage.positions is None else stage.positions,
        slots if padding is None else padding.view(torch.uint8), slots, slots.stride(0),
        stage.num_reqs, stage.num_reqs_padded, slots.shape[1],
        0 if stage.positions is None else stage.positions.shape[0], stage.num_blocks.shape[1], stage.cp_rank,
        CP_SIZE=stage.cp_size, CP_INTERLEAVE=stage.cp_interleave, HAS_PADDING=padding is not None,
        DO_GATHER=stage.do_gather, DO_SLOTS=stage.do_slots, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
