"""Paged attention that reads K/V through multiwrite's gathered block tables, with a kernel this project does not
write (torch's FlexAttention), and the dense attention it is checked against.

The K (or V) cache of one layer is `[kv_heads, num_slots + block_size, head_dim]`, head-major as FlexAttention
reads it (a contiguous `[1, kv_heads, slots, head_dim]` view, nothing copied): slot `s` of block `b` is
`b * block_size + s` (the slot mappings' formula), plus one dump block whose last slot PAD tokens (slot -1) are
written to, so that the write needs no host synchronization and stays capturable in a CUDA graph (`write_kv`).

Two implementations of the attention, both reading through the gathered tables (a wrong block id reads the wrong
page, a wrong slot leaves the token's K/V where attention does not look):
- `flex-paged`: `flex_attention` over the whole paged cache with a `BlockMask` whose KV block indices ARE the
  gathered rows (block size = the tables' kernel block size); its `mask_mod` keeps the keys whose page belongs to
  the query's batch entry (a page -> (entry, logical block) map scattered from the same gathered rows) and whose
  position is at most the query's. Compiled (`torch.compile(flex_attention)`) on a GPU: the fused kernel visits
  only the listed pages. Eager (a CPU) it is torch's unfused reference, which scores every slot of the cache:
  fine at small sizes.
- `sdpa-gathered` (the labelled fallback): each entry's pages gathered through its gathered row into a contiguous
  K/V, then `scaled_dot_product_attention` with a position mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

#: The implementations, in the order `auto` tries them.
IMPLEMENTATIONS = ("flex-paged", "sdpa-gathered")
#: What each implementation is, for reports.
DESCRIPTIONS = {
    "flex-paged": "FlexAttention over the paged cache, BlockMask KV indices = the gathered block tables",
    "sdpa-gathered": "fallback: pages gathered through the gathered tables, then torch SDPA",
}


def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write `new` (`[T, kv_heads, head_dim]`) into `cache` (`[kv_heads, num_slots + block_size, head_dim]`) at
    `slots` (int64 `[T]`, the slot mappings; -1 = PAD goes to the dump block's last slot). No host
    synchronization."""
    dump = cache.shape[1] - 1
    cache.index_copy_(1, torch.where(slots >= 0, slots, dump), new.transpose(0, 1))


class PagedBatch:
    """One step's attention metadata in persistent buffers (fixed addresses: a CUDA graph captures reads of them),
    rebuilt on the device by `update` from the gathered tables, with no host synchronization.

    Args:
        max_batch: batch entries B (a graph's bucket: padding entries have no queries).
        width: columns of the gathered table.
        q_len: queries per entry Q (decode: 1).
        block_size: tokens per (kernel) block, the tables' kernel block size.
        num_slots: slots of the cache before its dump block (a multiple of `block_size`).

    Attributes:
        gathered: int32 `[B, width]`, the step's gathered block table (a copy taken by `update`).
        q_pos: int64 `[B, Q]`, each query's position, -1 for a padding query.
        kv_len: int64 `[B]`, last query position + 1 (0 for a padding entry).
        owner, logical: int64 `[num_pages]`: the entry whose gathered row lists page `p` and `p`'s column in it, -1
            where no row lists it (`num_pages = num_slots // block_size + 1`, the dump block included).
        block_mask: FlexAttention's `BlockMask` over these buffers (built once).
    """

    def __init__(self, max_batch: int, width: int, q_len: int, block_size: int, num_slots: int, device):
        if num_slots % block_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of block_size {block_size}")
        B, W, P = max_batch, width, num_slots // block_size + 1
        self.block_size, self.num_slots, self.num_pages = block_size, num_slots, P
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.gathered = torch.zeros(B, W, **i32)
        self.q_pos = torch.full((B, q_len), -1, **i64)
        self.kv_len = torch.zeros(B, **i64)
        self.owner = torch.full((P,), -1, **i64)
        self.logical = torch.full((P,), -1, **i64)
        # FlexAttention's KV block lists: [B, heads=1, q blocks=1, max(P, W)] (at least as wide as the cache has
        # pages, which the compiled kernels require); per entry its pages split into "full" and "partial" (`update`).
        self.num_partial = torch.zeros(B, 1, 1, **i32)
        self.partial = torch.zeros(B, 1, 1, max(P, W), **i32)
        self.num_full = torch.zeros(B, 1, 1, **i32)
        self.full = torch.zeros(B, 1, 1, max(P, W), **i32)
        self._entry = torch.arange(B, **i64)[:, None].expand(B, W)
        self._column = torch.arange(W, **i64)[None, :].expand(B, W)
        self._block_mask = None
        self._q_len = q_len

    def num_blocks(self) -> torch.Tensor:
        """int64 `[B]`: the blocks of each entry's gathered row that attention reads."""
        return torch.div(self.kv_len + self.block_size - 1, self.block_size, rounding_mode="floor")

    def update(self, gathered: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Rebuild every buffer for a step: `gathered` int32 `[B, width]` (the step's gathered table, padding rows
        anything), `q_pos` int64 `[B, Q]` (-1: no query)."""
        self.gathered.copy_(gathered)
        self.q_pos.copy_(q_pos)
        torch.add(self.q_pos.amax(1), 1, out=self.kv_len)
        n = self.num_blocks()
        used = self._column < n[:, None]
        spare = self.num_pages - 1  # (unused cells land on the dump page's entry, reset below)
        ids = torch.where(used, self.gathered.long(), spare)
        self.owner.fill_(-1).scatter_(0, ids.reshape(-1), torch.where(used, self._entry, -1).reshape(-1))
        self.logical.fill_(-1).scatter_(0, ids.reshape(-1), torch.where(used, self._column, -1).reshape(-1))
        self.owner[spare:].fill_(-1)  # (a slice: `t[i] = -1` copies a host scalar, which a CUDA graph cannot capture)
        self.logical[spare:].fill_(-1)
        W = self.gathered.shape[1]
        # Full blocks: the pages whose every position is at most the entry's first query position (no query masks
        # any of their keys); the rest of the entry's pages are partial (its mask_mod runs there). With several
        # queries (a prefill chunk) that is every page from the first query's on, not only the last one.
        first = torch.where(self.q_pos >= 0, self.q_pos, self.kv_len[:, None]).amin(1)
        nf = torch.minimum(torch.div(first + 1, self.block_size, rounding_mode="floor"), n)
        rest = self._column + nf[:, None]
        tail = torch.gather(self.gathered, 1, rest.clamp(max=W - 1))
        self.partial[:, 0, 0, :W].copy_(torch.where(self._column < (n - nf)[:, None], tail, 0))
        self.num_partial.copy_((n - nf).to(torch.int32).view(-1, 1, 1))
        self.full[:, 0, 0, :W].copy_(torch.where(self._column < nf[:, None], self.gathered, 0))
        self.num_full.copy_(nf.to(torch.int32).view(-1, 1, 1))

    @property
    def block_mask(self):
        """The `BlockMask` of `flex-paged`: its `mask_mod` keeps a key iff its page is listed in the query's entry's
        gathered row and its position (column * block size + offset) is at most the query's."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            bs, owner, logical, q_pos = self.block_size, self.owner, self.logical, self.q_pos

            def mask_mod(b, h, q_idx, kv_idx):
                page = kv_idx // bs
                pos = logical[page] * bs + kv_idx % bs
                return (owner[page] == b) & (logical[page] >= 0) & (pos <= q_pos[b, q_idx])

            self._block_mask = BlockMask.from_kv_blocks(
                self.num_partial, self.partial, self.num_full, self.full,
                BLOCK_SIZE=(max(128, -(-self._q_len // 128) * 128), bs), mask_mod=mask_mod,
                seq_lengths=(self._q_len, self.num_slots + bs), compute_q_blocks=False,
            )  # fmt: skip
        return self._block_mask


class PagedAttention:
    """`out = attention(q, k_cache, v_cache, batch)`: q `[B, q_heads, Q, head_dim]`, caches `[kv_heads,
    num_slots + block_size, head_dim]` (`write_kv`'s layout), batch a `PagedBatch`; out `[B, q_heads, Q, head_dim]`
    (rows of padding queries are unspecified).

    Args:
        impl: `flex-paged`, `sdpa-gathered` or `auto` (`flex-paged`, compiled when `compile`).
        compile: compile `flex_attention` with `torch.compile` (a GPU, or a CPU with a C++ compiler; the first
            call compiles: warm it up untimed). Unfused (eager) FlexAttention scores every slot of the cache.
    """

    def __init__(self, impl: str = "auto", compile: bool = False):
        if impl not in ("auto", *IMPLEMENTATIONS):
            raise ValueError(f"attention {impl!r} (known: auto, {', '.join(IMPLEMENTATIONS)})")
        self.impl = "flex-paged" if impl == "auto" else impl
        self.compiled = compile and self.impl == "flex-paged"
        self._flex: Callable | None = None
        if self.impl == "flex-paged":
            from torch.nn.attention.flex_attention import flex_attention

            # dynamic=False: each shape compiles a static kernel (a dynamic batch would leave the decoding kernel)
            self._flex = (
                torch.compile(flex_attention, fullgraph=True, dynamic=False) if self.compiled else flex_attention
            )

    @property
    def name(self) -> str:
        """The implementation that runs, `(compiled)` or `(eager)` for FlexAttention."""
        if self.impl == "flex-paged":
            return f"flex-paged ({'compiled' if self.compiled else 'eager'})"
        return self.impl

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch):
        if self.impl == "flex-paged":
            k = k_cache.unsqueeze(0)  # [1, kv_heads, slots, head_dim], broadcast over the batch
            v = v_cache.unsqueeze(0)
            # The GPU kernels tile KV by BLOCK_N, which must divide the KV block, a page, for the main kernel
            # (queries >= 128). The decoding kernel (shorter queries) matched SDPA to 3e-7 on the H200 with and
            # without it; it is set for both, as the bench's H200 figures were measured.
            options = {"BLOCK_N": batch.block_size} if self.compiled and q.is_cuda else None
            gqa = q.shape[1] != k.shape[1]
            return self._flex(q, k, v, block_mask=batch.block_mask, enable_gqa=gqa, kernel_options=options)
        return sdpa_gathered(q, k_cache, v_cache, batch)


def sdpa_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """The fallback: pages gathered through `batch.gathered` into `[B, kv_heads, width * block_size, head_dim]`, then
    SDPA keeping the keys at positions `<=` each query's. Off a GPU (where no graph captures the step, so the host
    may read the device) `width` is cut to the columns some entry reads, the others being masked for every query."""
    B, W = batch.gathered.shape
    if not q.is_cuda:
        W = max(1, min(W, int(batch.num_blocks().max())))
    bs = batch.block_size
    offsets = torch.arange(bs, device=q.device)
    slots = (batch.gathered[:, :W].long()[:, :, None] * bs + offsets).reshape(B, W * bs)
    k = k_cache[:, slots].transpose(0, 1)  # [B, kv_heads, width * block_size, head_dim]
    v = v_cache[:, slots].transpose(0, 1)
    positions = torch.arange(W * bs, device=q.device)
    keep = positions[None, None, :] <= batch.q_pos[:, :, None]  # [B, Q, L]
    keep = keep & (positions[None, None, :] < batch.kv_len[:, None, None])
    keep[..., 0] |= ~keep.any(-1)  # a padding query keeps one key: its row stays finite
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], enable_gqa=q.shape[1] != k.shape[1])


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Plain attention of one request over its own history, the check's reference, in float64: q `[q_heads, Q,
    head_dim]` at positions `q_pos` (int64 `[Q]`), k and v `[L, kv_heads, head_dim]` (positions 0..L-1). Returns
    `[q_heads, Q, head_dim]` float64."""
    q, k, v = q.double(), k.double().transpose(0, 1), v.double().transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    keep = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~keep[None], float("-inf"))
    return torch.softmax(scores, -1) @ v
