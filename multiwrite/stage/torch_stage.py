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
- vLLM 0.33's additions: a batch entry of -1 is a dummy request (PAD for its tokens, a zero gathered row, its request
  row never read); rows a previous gather left past this one's padded rows are zeroed (`StepInputs.num_rows`); with
  `num_computed_tokens`, a group with a sliding window (`sliding_window_reach > 0`) gets 0 for every gathered kernel
  block wholly below the window of the request's first scheduled token; a group whose `slot_mapping_enabled` is
  False is all PAD; a group whose `dcp_sharded` is False maps every token on every rank from its unsharded position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multiwrite.stage.layout import PAD_SLOT_ID, TablesLayout
from multiwrite.stage.step import StepInputs


def gather_block_tables_torch(
    layout: TablesLayout, step: StepInputs, outs: Sequence[torch.Tensor] | None = None
) -> None:
    """Gather `step`'s rows into `outs` (default `layout.input_block_tables`): one `index_select` and one masked copy
    per group. A dummy entry (-1) gets a zero row; rows `num_reqs .. num_rows - 1` become zero; with
    `num_computed_tokens`, a group's cells wholly below its sliding window become 0."""
    n, rows = step.num_reqs, step.num_rows
    outs = layout.input_block_tables if outs is None else outs
    raw = step.idx_mapping.long()
    real = raw >= 0
    idx = raw.clamp(0, layout.max_num_reqs - 1)  # unchecked device values: clamped
    nct = step.num_computed_tokens
    on_host = layout.device.type == "cpu"
    for g, (src, out) in enumerate(zip(layout.tables, outs)):
        if n:
            counts = torch.where(real, layout.num_blocks[g].index_select(0, idx), 0)
            # On the host, copy only up to the longest row of the batch (reading it costs nothing there); on a
            # device that would synchronize, so the whole width is masked instead.
            width = min(int(counts.max()), out.shape[1]) if on_host else out.shape[1]
            cols = layout.columns[:width].unsqueeze(0)
            keep = cols < counts.unsqueeze(1)
            cells = src[:, :width].index_select(0, idx)
            reach = layout.sliding_window_reach[g]
            if nct is not None and reach > 0:
                below = torch.div((nct.long().index_select(0, idx) - reach).clamp_(min=0), layout.kernel_block_sizes[g],
                                  rounding_mode="floor")  # fmt: skip
                cells = torch.where(cols < below.unsqueeze(1), 0, cells)
            out[:n, :width] = torch.where(keep, cells, out[:n, :width])
            if not on_host or not bool(real.all()):
                out[:n] = torch.where(real.unsqueeze(1), out[:n], 0)
        out[n:rows].zero_()


def compute_slot_mappings_torch(layout: TablesLayout, step: StepInputs, out: torch.Tensor | None = None) -> None:
    """Compute the slots into `out` (default `layout.slot_mappings`; int64 `[num_groups, >= num_tokens_padded]`) and
    pad the rest of it. Each token finds its batch entry by a binary search over `query_start_loc`; request rows and
    table columns are clamped into the tables."""
    out = layout.slot_mappings if out is None else out
    qsl, positions = step.query_start_loc, step.positions
    assert out is not None and qsl is not None and positions is not None
    n, T = step.num_reqs, step.num_tokens_padded
    out[:, T:].fill_(PAD_SLOT_ID)
    if T == 0:
        return
    if n == 0 or positions.shape[0] == 0:
        out[:, :T].fill_(PAD_SLOT_ID)
        return
    i = torch.arange(T, device=layout.device) if layout.tokens is None else layout.tokens[:T]
    qsl = qsl[: n + 1].long()
    batch = torch.searchsorted(qsl[1:], i, right=True).clamp_(max=n - 1)
    live = (i >= qsl[0]) & (i < qsl[n])
    if step.is_padding is not None:
        live &= ~step.is_padding[:T]
    raw = step.idx_mapping.long().index_select(0, batch)
    live &= raw >= 0  # a dummy request's tokens: PAD, its row never read
    req = raw.clamp_(0, layout.max_num_reqs - 1)
    pos = positions.index_select(0, i.clamp(max=positions.shape[0] - 1)).long()
    C, ilv, rank = layout.cp_size, layout.cp_interleave, layout.cp_rank
    for g, (src, bs, kbs, k) in enumerate(
        zip(layout.tables, layout.block_sizes, layout.kernel_block_sizes, layout.kernel_blocks_per_block)
    ):
        if not layout.slot_mapping_enabled[g]:
            out[g, :T].fill_(PAD_SLOT_ID)
            continue
        if C == 1 or not layout.dcp_sharded[g]:  # (an unsharded group: every rank stores every token)
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


def run_stage_torch(
    layout: TablesLayout,
    step: StepInputs,
    gather_outs: Sequence[torch.Tensor] | None = None,
    slots_out: torch.Tensor | None = None,
) -> None:
    """The jobs `step` asks for (gather, slot mappings), with the torch ops above, into the layout's outputs or the
    caller's (`gather_outs`, `slots_out`)."""
    if step.do_gather:
        gather_block_tables_torch(layout, step, gather_outs)
    if step.do_slots:
        compute_slot_mappings_torch(layout, step, slots_out)
