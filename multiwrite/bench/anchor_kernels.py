"""The anchor designs of the block-table stage, for `multiwrite bench --stage` (imports Triton).

Written here in the style of vLLM's v2 model runner (`vllm/v1/worker/gpu/block_table.py` in vllm-project/vllm,
read to learn the design; no code copied): the groups' tables are found through device tensors of their
addresses and row strides, and each job is one Triton launch through the JIT:

- gather: grid `[groups, requests]`; program `(g, b)` copies the first `num_blocks[g, idx_mapping[b]]` cells of
  the request's row into row `b` of group `g`'s input table;
- slot mapping: grid `[groups, requests + 1]`; program `(g, b)` maps the tokens of batch entry `b` with the
  group's kernel block size, the last program pads the rest of the row with -1;
- fused gather + slot mapping (vllm-project/vllm PR #34660): both jobs in one launch, grid `[groups, requests + 1]`.

Without context parallelism and without padding rows or an `is_padding` mask: the bench's decode steps need
none. Outputs go to buffers of their own, checked against `multiwrite.reference` by the bench.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multiwrite.reference import PAD_SLOT_ID
from multiwrite.tables.block_tables import BlockTables

PAD: tl.constexpr = tl.constexpr(PAD_SLOT_ID)
#: Cells or tokens per loop iteration of a program (vLLM's kernels use 1024 too).
BLOCK = 1024


@triton.jit
def _gather_one(tables, strides, outs, out_strides, num_blocks, nb_stride, g, b, req, BLOCK: tl.constexpr):
    count = tl.load(num_blocks + g * nb_stride + req)
    src = tl.load(tables + g).to(tl.pointer_type(tl.int32)) + req * tl.load(strides + g)
    dst = tl.load(outs + g).to(tl.pointer_type(tl.int32)) + b * tl.load(out_strides + g)
    for c in range(0, count, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        keep = cols < count
        tl.store(dst + cols, tl.load(src + cols, mask=keep), mask=keep)


@triton.jit
def _slots_one(tables, strides, kernel_block_sizes, qsl, positions, slots, slot_stride, max_tokens, g, b, num_reqs,
               req, BLOCK: tl.constexpr):  # fmt: skip
    out = slots + g * slot_stride
    if b == num_reqs:
        for t in range(tl.load(qsl + num_reqs), max_tokens, BLOCK):
            tokens = t + tl.arange(0, BLOCK)
            tl.store(out + tokens, tl.full([BLOCK], PAD, tl.int64), mask=tokens < max_tokens)
    else:
        kbs = tl.load(kernel_block_sizes + g)
        row = tl.load(tables + g).to(tl.pointer_type(tl.int32)) + req * tl.load(strides + g)
        start = tl.load(qsl + b)
        end = tl.load(qsl + b + 1)
        for t in range(start, end, BLOCK):
            tokens = t + tl.arange(0, BLOCK)
            live = tokens < end
            pos = tl.load(positions + tokens, mask=live, other=0)
            ids = tl.load(row + pos // kbs, mask=live, other=0).to(tl.int64)
            tl.store(out + tokens, ids * kbs + pos % kbs, mask=live)


@triton.jit
def gather_kernel(tables, strides, outs, out_strides, num_blocks, nb_stride, idx, BLOCK: tl.constexpr):
    """Grid `[groups, requests]`: the gather alone."""
    g = tl.program_id(0)
    b = tl.program_id(1)
    req = tl.load(idx + b).to(tl.int64)
    _gather_one(tables, strides, outs, out_strides, num_blocks, nb_stride, g, b, req, BLOCK)


@triton.jit
def slots_kernel(tables, strides, kernel_block_sizes, idx, qsl, positions, slots, slot_stride, max_tokens,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Grid `[groups, requests + 1]`: the slot mapping alone."""
    g = tl.program_id(0)
    b = tl.program_id(1)
    num_reqs = tl.num_programs(1) - 1
    req = tl.load(idx + b, mask=b < num_reqs, other=0).to(tl.int64)
    _slots_one(tables, strides, kernel_block_sizes, qsl, positions, slots, slot_stride, max_tokens, g, b, num_reqs,
               req, BLOCK)  # fmt: skip


@triton.jit
def gather_slots_kernel(tables, strides, outs, out_strides, num_blocks, nb_stride, kernel_block_sizes, idx, qsl,
                        positions, slots, slot_stride, max_tokens, BLOCK: tl.constexpr):  # fmt: skip
    """Grid `[groups, requests + 1]`: gather and slot mapping in one launch (vllm-project/vllm PR #34660)."""
    g = tl.program_id(0)
    b = tl.program_id(1)
    num_reqs = tl.num_programs(1) - 1
    req = tl.load(idx + b, mask=b < num_reqs, other=0).to(tl.int64)
    if b < num_reqs:
        _gather_one(tables, strides, outs, out_strides, num_blocks, nb_stride, g, b, req, BLOCK)
    _slots_one(tables, strides, kernel_block_sizes, qsl, positions, slots, slot_stride, max_tokens, g, b, num_reqs,
               req, BLOCK)  # fmt: skip


class AnchorStage:
    """Gather and slot mappings of a `BlockTables`' tables with the anchor kernels: two launches (`fused=False`)
    or one (`fused=True`), each through Triton's JIT, on the current stream.

    Attributes:
        input_block_tables: per group int32 `[max_num_reqs, width_g]` (the gather's output).
        slot_mappings: int64 `[num_groups, max_num_batched_tokens]`.
    """

    def __init__(self, bt: BlockTables, max_num_batched_tokens: int, fused: bool):
        device = bt.num_blocks_device.device
        tables = [t.tensor for t in bt.block_tables]
        self.input_block_tables = [torch.zeros_like(t) for t in tables]
        self.slot_mappings = torch.full((len(tables), max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.int64,
                                        device=device)  # fmt: skip

        def i64(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._tables = i64([t.data_ptr() for t in tables])
        self._strides = i64([t.stride(0) for t in tables])
        self._outs = i64([t.data_ptr() for t in self.input_block_tables])
        self._out_strides = i64([t.stride(0) for t in self.input_block_tables])
        self._kbs = i64(bt.kernel_block_sizes)
        self._nb = bt.num_blocks_device
        self._groups = len(tables)
        self.fused = fused

    def run(self, idx: torch.Tensor, qsl: torch.Tensor, positions: torch.Tensor) -> None:
        """Gather the rows of `idx` and map the tokens of `qsl`/`positions` (device tensors, no padding)."""
        n, G = idx.shape[0], self._groups
        slots, T = self.slot_mappings, self.slot_mappings.shape[1]
        if self.fused:
            gather_slots_kernel[(G, n + 1)](
                self._tables, self._strides, self._outs, self._out_strides, self._nb, self._nb.stride(0), self._kbs,
                idx, qsl, positions, slots, slots.stride(0), T, BLOCK=BLOCK,
            )  # fmt: skip
            return
        if n:
            gather_kernel[(G, n)](
                self._tables, self._strides, self._outs, self._out_strides, self._nb, self._nb.stride(0), idx,
                BLOCK=BLOCK,
            )  # fmt: skip
        slots_kernel[(G, n + 1)](
            self._tables, self._strides, self._kbs, idx, qsl, positions, slots, slots.stride(0), T, BLOCK=BLOCK
        )
