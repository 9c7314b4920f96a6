"""The generic gather and slot mappings: vectorized torch ops on any device (no Python loop over requests or
tokens, only over the few KV-cache groups), no host synchronization. What every backend's plan runs unless it
does better; `multiwrite.reference` holds the plain sequential semantics it is tested against.

Semantics (vLLM's v2 model runner, `vllm/v1/worker/gpu/block_table.py`):
- gather: batch entry `b < num_reqs` gets the first `num_blocks[g, idx_mapping[b]]` cells of row `idx_mapping[b]`
  of each group's table in `input_block_tables[g][b]`; its other cells keep what they held (attention reads a row
  only up to the request's length). Rows `num_reqs .. num_reqs_padded - 1` become zero.
- slot mappings: token `i` of entry `b` (`query_start_loc[b] <= i < query_start_loc[b + 1]`) at position
  `p = positions[i]` maps, with the group's kernel block size `kbs`, to `table[idx_mapping[b], p // kbs] * kbs +
  p % kbs`. With context parallelism (`cp_size > 1`) the sequence is dealt to the ranks in chunks of
  `cp_interleave` tokens; ownership and the rank-local offset are computed in manager-block coordinates (a virtual
  block of `block_size * cp_size` tokens) and only the kernel block is picked with `kbs`. Tokens past
  `query_start_loc[num_reqs]`, padding tokens, other ranks' tokens and `slot_mappings[:, num_tokens_padded:]` get
  `PAD_SLOT_ID` (-1).
"""

from __future__ import annotations

import torch

from multiwrite.stage.layout import PAD_SLOT_ID, TablesLayout
from multiwrite.stage.step import StepInputs


def gather_block_tables_torch(layout: TablesLayout, step: StepInputs) -> None:
    """Gather `step`'s rows into `layout.input_block_tables`: one `index_select` and one masked copy per group."""
    n, padded = step.num_reqs, step.num_reqs_padded
    idx = step.idx_mapping.long().clamp(0, layout.max_num_reqs - 1)  # unchecked device values: clamped
    on_host = layout.device.type == "cpu"
    for g, (src, out) in enumerate(zip(layout.tables, layout.input_block_tables)):
        if n:
            counts = layout.num_blocks[g].index_select(0, idx)
            # On the host, copy only up to the longest row of the batch (reading it costs nothing there); on a
            # device that would synchronize, so the whole width is masked instead.
            width = min(int(counts.max()), out.shape[1]) if on_host else out.shape[1]
            keep = layout.columns[:width].unsqueeze(0) < counts.unsqueeze(1)
            out[:n, :width] = torch.where(keep, src[:, :width].index_select(0, idx), out[:n, :width])
        out[n:padded].zero_()


def compute_slot_mappings_torch(layout: TablesLayout, step: StepInputs) -> None:
    """Compute `slot_mappings[:, :num_tokens_padded]` and pad the rest. Each token finds its batch entry by a binary
    search over `query_start_loc`; request rows and table columns are clamped into the tables."""
    out, qsl, positions, tokens = layout.slot_mappings, step.query_start_loc, step.positions, layout.tokens
    assert out is not None and qsl is not None and positions is not None and tokens is not None
    n, T = step.num_reqs, step.num_tokens_padded
    out[:, T:].fill_(PAD_SLOT_ID)
    if T == 0:
        return
    if n == 0 or positions.shape[0] == 0:
        out[:, :T].fill_(PAD_SLOT_ID)
        return
    i = tokens[:T]
    qsl = qsl[: n + 1].long()
    batch = torch.searchsorted(qsl[1:], i, right=True).clamp_(max=n - 1)
    live = (i >= qsl[0]) & (i < qsl[n])
    if step.is_padding is not None:
        live &= ~step.is_padding[:T]
    req = step.idx_mapping.long().index_select(0, batch).clamp_(0, layout.max_num_reqs - 1)
    pos = positions.index_select(0, i.clamp(max=positions.shape[0] - 1)).long()
    C, ilv, rank = layout.cp_size, layout.cp_interleave, layout.cp_rank
    for g, (src, bs, kbs, k) in enumerate(
        zip(layout.tables, layout.block_sizes, layout.kernel_block_sizes, layout.kernel_blocks_per_block)
    ):
        if C == 1:
            column = torch.div(pos, kbs, rounding_mode="floor")
            offset = pos - column * kbs
            owned = live
        else:
            virtual = bs * C
            block = torch.div(pos, virtual, rounding_mode="floor")
            within = pos - block * virtual
            owned = live & (torch.div(within, ilv, rounding_mode="floor") % C == rank)
            local = torch.div(within, ilv * C, rounding_mode="floor") * ilv + within % ilv  # in [0, bs)
            column = block * k + torch.div(local, kbs, rounding_mode="floor")
            offset = local % kbs
        column = column.clamp_(0, src.shape[1] - 1)
        slot = src[req, column].long() * kbs + offset
        out[g, :T] = torch.where(owned, slot, torch.full_like(slot, PAD_SLOT_ID))


def run_stage_torch(layout: TablesLayout, step: StepInputs) -> None:
    """The jobs `step` asks for (gather, slot mappings), with the torch ops above."""
    if step.do_gather:
        gather_block_tables_torch(layout, step)
    if step.do_slots:
        compute_slot_mappings_torch(layout, step)
