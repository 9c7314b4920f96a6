"""A sequential model of the `BlockTables` semantics of vLLM 0.33's v2 model runner, written from its behaviour
(one Python loop per cell, numpy on the host), for the lockstep comparisons of `tests/vllm/lockstep.py`.

It has the attributes a comparison reads (`block_tables[g].gpu`, `num_blocks.np`/`.gpu`, `input_block_tables`,
`slot_mappings`) as tensors on the requested device, and the methods the runner calls. It checks nothing: feed it
only what the engine would (no -1 in a gather, no write past a row).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

PAD = -1


class ModelBlockTables:
    """The model: construct it with the arguments of vLLM's `BlockTables`."""

    redirect_writes_to_null_block = False

    def __init__(
        self,
        block_sizes,
        max_num_reqs,
        max_num_batched_tokens,
        max_num_blocks_per_group,
        device,
        cp_size=1,
        cp_rank=0,
        cp_interleave=1,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        sliding_window_reach=None,
    ):
        g = len(block_sizes)
        self.device = torch.device(device)
        self.block_sizes = list(block_sizes)
        self.num_kv_cache_groups = g
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        self.enabled = [True] * g if slot_mapping_enabled is None else list(slot_mapping_enabled)
        self.sharded = [True] * g if dcp_sharded is None else list(dcp_sharded)
        reach = [0] * g if sliding_window_reach is None or cp_size > 1 else list(sliding_window_reach)
        self.reach = reach
        self.tables = [np.zeros((max_num_reqs, w), np.int64) for w in max_num_blocks_per_group]
        self.counts = np.zeros((g, max_num_reqs), np.int64)
        self.applied_counts = self.counts.copy()
        self.staged: list[tuple[int, int, int, list[int]]] = []
        self.inputs = [np.zeros((max_num_reqs, w), np.int64) for w in max_num_blocks_per_group]
        self.dirty = 0
        self.slots = np.zeros((g, max_num_batched_tokens), np.int64)
        self._views()

    # -- the attributes, as tensors --------------------------------------------------------------------------------
    def _views(self) -> None:
        """Build the tensors once; `_sync` refreshes them in place (their addresses stay, as vLLM's do)."""
        dev = self.device
        self.block_tables = [
            SimpleNamespace(gpu=torch.zeros(t.shape, dtype=torch.int32, device=dev)) for t in self.tables
        ]
        self.num_blocks = SimpleNamespace(
            np=self.counts, gpu=torch.zeros(self.counts.shape, dtype=torch.int32, device=dev)
        )
        self.input_block_tables = [torch.zeros(t.shape, dtype=torch.int32, device=dev) for t in self.inputs]
        self.slot_mappings = torch.zeros(self.slots.shape, dtype=torch.int64, device=dev)
        self._sync()

    def _sync(self) -> None:
        for t, src in zip(self.block_tables, self.tables):
            t.gpu.copy_(torch.from_numpy(src))
        self.num_blocks.gpu.copy_(torch.from_numpy(self.applied_counts))
        for t, src in zip(self.input_block_tables, self.inputs):
            t.copy_(torch.from_numpy(src))
        self.slot_mappings.copy_(torch.from_numpy(self.slots))

    # -- the runner's calls ----------------------------------------------------------------------------------------
    def append_block_ids(self, req_index, new_block_ids, overwrite):
        for g in range(self.num_kv_cache_groups):
            ids = list(new_block_ids[g])
            if self.redirect_writes_to_null_block:
                ids = [0] * len(ids)
            start = 0 if overwrite else int(self.counts[g, req_index])
            assert start + len(ids) <= self.tables[g].shape[1], "the model is fed only writes that fit"
            self.staged.append((g, req_index, start, ids))
            self.counts[g, req_index] = start + len(ids)
        self._sync()

    def apply_staged_writes(self):
        for g, row, start, ids in self.staged:
            for k, v in enumerate(ids):
                self.tables[g][row, start + k] = v
        self.staged.clear()
        if self.num_kv_cache_groups:
            self.applied_counts = self.counts.copy()
        self._sync()

    def gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None):
        if self.num_kv_cache_groups == 0:
            return ()
        idx = [int(i) for i in idx_mapping.tolist()]
        nct = None if num_computed_tokens is None else num_computed_tokens.tolist()
        dst = self.inputs if out is None else [o.cpu().numpy().astype(np.int64) for o in out]
        last = num_reqs_padded
        if out is None:
            last = max(last, self.dirty)
            self.dirty = len(idx)
        for g, table in enumerate(self.tables):
            for b in range(last):
                if b >= len(idx):
                    dst[g][b, :] = 0
                    continue
                r = idx[b]
                n = int(self.applied_counts[g, r])
                cut = 0
                if nct is not None and self.reach[g] > 0:
                    cut = max(int(nct[r]) - self.reach[g], 0) // self.block_sizes[g]
                for j in range(n):
                    dst[g][b, j] = table[r, j] if j >= cut else 0
        if out is not None:
            for o, d in zip(out, dst):
                o.copy_(torch.from_numpy(d).to(o.dtype))
            return tuple(o[:num_reqs_padded] for o in out)
        self._sync()
        return tuple(t[:num_reqs_padded] for t in self.input_block_tables)

    def get_dummy_block_tables(self, num_reqs):
        for t in self.inputs:
            t[: max(num_reqs, self.dirty)] = 0
        self.dirty = num_reqs
        self._sync()
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    def slot(self, g: int, row: int, position: int) -> int:
        """The slot of `position` of the request in `row` for group `g` on this rank, or PAD."""
        if row < 0 or not self.enabled[g]:
            return PAD
        bs, cp, inter = self.block_sizes[g], self.cp_size, self.cp_interleave
        local = position
        if cp > 1 and self.sharded[g]:
            virtual, offset = divmod(position, bs * cp)
            if (offset // inter) % cp != self.cp_rank:
                return PAD
            local = virtual * bs + (offset // (inter * cp)) * inter + offset % inter
        return int(self.tables[g][row, local // bs]) * bs + local % bs

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        dst = self.slots if out is None else out.cpu().numpy().astype(np.int64)
        idx = [int(i) for i in idx_mapping.tolist()]
        qsl = [int(q) for q in query_start_loc.tolist()]
        pos = [int(p) for p in positions.tolist()]
        if self.num_kv_cache_groups:
            for g in range(self.num_kv_cache_groups):
                for b, r in enumerate(idx):
                    for t in range(qsl[b], qsl[b + 1]):
                        dst[g, t] = self.slot(g, r, pos[t])
                dst[g, qsl[len(idx)] :] = PAD
        if out is not None:
            out.copy_(torch.from_numpy(dst))
            return out[:, :num_tokens_padded]
        self._sync()
        return self.slot_mappings[:, :num_tokens_padded]

    def get_dummy_slot_mappings(self, num_tokens):
        self.slots[:] = PAD
        self._sync()
        return self.slot_mappings[:, :num_tokens]
