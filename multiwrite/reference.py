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
