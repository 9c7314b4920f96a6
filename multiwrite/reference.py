"""The plain sequential semantics every backend is checked against.

Nothing here is fast or clever on purpose: one Python loop, one cell at a time, in staging order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def apply_writes_reference(
    table: np.ndarray, writes: Iterable[tuple[int, int, Sequence]], kernel_blocks_per_block: int = 1
) -> np.ndarray:
    """Apply `(row, start, values)` writes to a 2-D numpy `table` in place, one cell at a time, in order.

    Each value `v` fills `kernel_blocks_per_block` cells with `v * k + j`. Returns `table`.
    """
    k = kernel_blocks_per_block
    for row, start, values in writes:
        col = start
        for v in values:
            for j in range(k):
                table[row, col] = v * k + j if k > 1 else v
                col += 1
    return table


class ReferenceBlockTables:
    """`BlockTables` semantics with plain numpy tables and Python loops (host only).

    Same constructor arguments as `BlockTables` minus the device and backend; `tables[g]` and
    `num_blocks` are what the real tables must equal after `apply_staged_writes()`.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_group: Sequence[int],
        kernel_block_sizes: Sequence[int] | None = None,
    ):
        kbs = list(block_sizes if kernel_block_sizes is None else kernel_block_sizes)
        self.k = [b // kb for b, kb in zip(block_sizes, kbs)]
        self.tables = [
            np.zeros((max_num_reqs, m * k), dtype=np.int64) for m, k in zip(max_num_blocks_per_group, self.k)
        ]
        self.num_blocks = np.zeros((len(block_sizes), max_num_reqs), dtype=np.int64)

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Write the expanded ids straight into the tables (no staging)."""
        for g, ids in enumerate(new_block_ids):
            if not len(ids) and not overwrite:
                continue
            start = 0 if overwrite else int(self.num_blocks[g, req_index])
            apply_writes_reference(self.tables[g], [(req_index, start, ids)], self.k[g])
            self.num_blocks[g, req_index] = start + len(ids) * self.k[g]


#: The slot of a token whose K/V are not stored (padding, or another context-parallel rank's token).
PAD_SLOT_ID = -1


def gather_block_tables_reference(
    tables: Sequence[np.ndarray],
    num_blocks: np.ndarray,
    idx_mapping: Sequence[int],
    num_reqs_padded: int,
    input_block_tables: Sequence[np.ndarray],
) -> list[np.ndarray]:
    """Gather the scheduled requests' rows into batch order, one cell at a time, into `input_block_tables`.

    Batch entry `b < len(idx_mapping)` gets the first `num_blocks[g, idx_mapping[b]]` cells of row
    `idx_mapping[b]` of `tables[g]`; its other cells keep what they held. Rows `len(idx_mapping) ..
    num_reqs_padded - 1` become zero. Returns `[input_block_tables[g][:num_reqs_padded] for g]`.
    """
    for g, (table, out) in enumerate(zip(tables, input_block_tables)):
        for b in range(num_reqs_padded):
            if b < len(idx_mapping):
                req = int(idx_mapping[b])
                for col in range(int(num_blocks[g, req])):
                    out[b, col] = table[req, col]
            else:
                for col in range(out.shape[1]):
                    out[b, col] = 0
    return [out[:num_reqs_padded] for out in input_block_tables]


def compute_slot_mappings_reference(
    tables: Sequence[np.ndarray],
    kernel_block_sizes: Sequence[int],
    idx_mapping: Sequence[int],
    query_start_loc: Sequence[int],
    positions: Sequence[int],
    num_tokens_padded: int,
    is_padding: Sequence[bool] | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> np.ndarray:
    """Slot of every token in the KV cache of every group: int64 `[num_groups, num_tokens_padded]`.

    Token `i` in `[query_start_loc[b], query_start_loc[b + 1])` belongs to batch entry `b` (request row
    `idx_mapping[b]`) and sits at sequence position `positions[i]`. Under context parallelism the sequence
    is dealt to the `cp_size` ranks in chunks of `cp_interleave` tokens (chunk `c = p // cp_interleave`
    goes to rank `c % cp_size`), and each rank stores the tokens it owns one after another: the owned
    token at position `p` is the rank's local token `j = (c // cp_size) * cp_interleave + p % cp_interleave`
    (with `cp_size == 1`, `j == p`). Its slot is `table[req, j // kbs] * kbs + j % kbs` with the group's
    KERNEL block size `kbs` (the table holds kernel block ids). Tokens another rank owns, tokens whose
    `is_padding` is true and tokens past `query_start_loc[len(idx_mapping)]` get `PAD_SLOT_ID`.

    This is the rank-local token stream written out one token at a time; it equals vLLM's virtual-block
    formula (ownership in manager-block coordinates, vllm-project/vllm PR #51031) whenever the interleave
    divides the manager block size, which `BlockTables` requires.
    """
    out = np.full((len(tables), num_tokens_padded), PAD_SLOT_ID, dtype=np.int64)
    for b in range(len(idx_mapping)):
        req = int(idx_mapping[b])
        for i in range(int(query_start_loc[b]), int(query_start_loc[b + 1])):
            if is_padding is not None and bool(is_padding[i]):
                continue
            p = int(positions[i])
            chunk = p // cp_interleave
            if chunk % cp_size != cp_rank:
                continue
            j = (chunk // cp_size) * cp_interleave + p % cp_interleave
            for g, (table, kbs) in enumerate(zip(tables, kernel_block_sizes)):
                out[g, i] = int(table[req, j // kbs]) * kbs + j % kbs
    return out
