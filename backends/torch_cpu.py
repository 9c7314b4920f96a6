"""`torch-cpu`: the vectorized fallback for tables in CPU memory.

Each batch becomes, per table, one scatter whose cell coordinates are computed with array operations
(repeat and cumulative sums over the write metadata); no Python loop runs over writes or values. The
scatter writes through a numpy view that shares the torch tensor's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, hookimpl
from multiwrite.staging import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET


def cell_coordinates(batch: WriteBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every cell the batch writes, in staging order: (table, row, column, value), each `[num_cells]`.

    Values are already expanded to kernel block ids where a table's `kernel_blocks_per_block > 1`.
    """
    meta = batch.meta
    lengths = meta[:, META_LENGTH].astype(np.int64)
    ks = np.asarray(batch.kernel_blocks_per_block, dtype=np.int64)
    expand = bool(ks.max() > 1)
    k_w = ks[meta[:, META_TABLE]] if expand else None
    cells = lengths * k_w if expand else lengths
    total = int(cells.sum())
    first = np.cumsum(cells) - cells
    writer = np.repeat(np.arange(meta.shape[0]), cells)
    pos = np.arange(total, dtype=np.int64) - first[writer]
    col = meta[writer, META_START] + pos
    if expand:
        k_c = k_w[writer]
        value_index = meta[writer, META_VALUE_OFFSET] + pos // k_c
        value = batch.values[value_index].astype(np.int64) * k_c + pos % k_c
    else:
        value = batch.values[meta[writer, META_VALUE_OFFSET] + pos]
    return meta[writer, META_TABLE], meta[writer, META_ROW], col, value


def _keep_last(table: np.ndarray, row: np.ndarray, col: np.ndarray) -> np.ndarray:
    """Indices of the last write to each distinct cell (staging order: later wins)."""
    key = (table.astype(np.int64) << 42) | (row.astype(np.int64) << 21) | col
    _, first_in_reversed = np.unique(key[::-1], return_index=True)
    return key.shape[0] - 1 - first_in_reversed


class TorchCpuBackend(Backend):
    """Applies batches to CPU tensors with one vectorized scatter per table. Any number of tables."""

    NAME = "torch-cpu"
    PRIORITY = 0
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Scatter every batch into its tables; see `Backend.apply`."""
        for batch in batches:
            if batch.values.shape[0] == 0:
                continue  # only empty writes
            table, row, col, value = cell_coordinates(batch)
            if batch.may_overlap:
                keep = _keep_last(table, row, col)
                table, row, col, value = table[keep], row[keep], col[keep], value[keep]
            if len(batch.tables) == 1:
                _scatter(batch.tables[0], row, col, value)
                continue
            for t, dst in enumerate(batch.tables):
                mine = table == t
                _scatter(dst, row[mine], col[mine], value[mine])


def _scatter(dst: torch.Tensor, row: np.ndarray, col: np.ndarray, value: np.ndarray) -> None:
    if row.shape[0]:
        dst.numpy()[row, col] = value


_BACKEND = TorchCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `torch-cpu` backend."""
    return [_BACKEND]
