"""`torch-cpu`: the vectorized fallback for tables in CPU memory.

Each batch becomes one scatter per storage (one in all for `BlockTables`, whose tables share one
allocation), with cell coordinates computed by array operations (repeat and cumulative sums over the
write metadata): no Python loop runs over writes or values. The scatter writes through a numpy view of
the tensors' storage, which shares their memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, hookimpl
from multiwrite.staging import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET


class _Plan:
    """How to address a list of tables: per table its storage group, element offset and strides."""

    __slots__ = ("groups", "base", "row_stride", "col_stride", "k", "expand", "unit_col_stride")

    def __init__(self, tables: Sequence[torch.Tensor], ks: Sequence[int]):
        storages: dict[int, tuple[np.ndarray, list[int]]] = {}
        for i, t in enumerate(tables):
            storage = t.untyped_storage()
            entry = storages.get(storage.data_ptr())
            if entry is None:
                flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
                storages[storage.data_ptr()] = (flat.numpy(), [i])
            else:
                entry[1].append(i)
        self.groups = [(view, np.asarray(idx, dtype=np.int32)) for view, idx in storages.values()]
        self.base = np.asarray([t.storage_offset() for t in tables], dtype=np.int64)
        self.row_stride = np.asarray([t.stride(0) for t in tables], dtype=np.int64)
        self.col_stride = np.asarray([t.stride(1) for t in tables], dtype=np.int64)
        self.k = np.asarray(ks, dtype=np.int64)
        self.expand = bool(self.k.max() > 1)
        self.unit_col_stride = bool((self.col_stride == 1).all())


def scatter_indices(meta: np.ndarray, values: np.ndarray, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """Storage element index and value of every cell the writes in `meta` set, in staging order."""
    table = meta[:, META_TABLE]
    lengths = meta[:, META_LENGTH].astype(np.int64)
    kw = plan.k[table] if plan.expand else None
    cells = lengths * kw if kw is not None else lengths
    first = np.cumsum(cells) - cells
    total = int(first[-1] + cells[-1])
    ar = np.arange(total, dtype=np.int64)
    dst_w = plan.base[table] + meta[:, META_ROW] * plan.row_stride[table]
    if plan.unit_col_stride:
        dst = np.repeat(dst_w + meta[:, META_START] - first, cells) + ar
    else:
        s1 = plan.col_stride[table]
        dst = np.repeat(dst_w + (meta[:, META_START] - first) * s1, cells) + ar * np.repeat(s1, cells)
    if kw is None:
        value = values[np.repeat(meta[:, META_VALUE_OFFSET] - first, cells) + ar]
    else:
        pos = ar - np.repeat(first, cells)
        k_c = np.repeat(kw, cells)
        value = values[np.repeat(meta[:, META_VALUE_OFFSET], cells) + pos // k_c].astype(np.int64) * k_c + pos % k_c
    return dst, value


class TorchCpuBackend(Backend):
    """Applies batches to CPU tensors with one vectorized scatter per storage. Any number of tables."""

    NAME = "torch-cpu"
    PRIORITY = 0
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        self._plans: dict[tuple, _Plan] = {}

    def _plan(self, batch: WriteBatch) -> _Plan:
        # The key is also the staleness check: new storage, shape or strides give a new plan.
        key = tuple((t.data_ptr(), t.shape, t.stride()) for t in batch.tables), tuple(batch.kernel_blocks_per_block)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = _Plan(batch.tables, batch.kernel_blocks_per_block)
        return plan

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Scatter every batch into its tables; see `Backend.apply`."""
        for batch in batches:
            meta = batch.meta
            if batch.values.shape[0] == 0:
                continue  # only empty writes
            plan = self._plan(batch)
            for view, members in plan.groups:
                part = meta if len(plan.groups) == 1 else meta[np.isin(meta[:, META_TABLE], members)]
                if part.shape[0] == 0 or not part[:, META_LENGTH].any():
                    continue
                dst, value = scatter_indices(part, batch.values, plan)
                if batch.may_overlap:  # keep the last write of each cell: staging order wins
                    _, first_in_reversed = np.unique(dst[::-1], return_index=True)
                    keep = dst.shape[0] - 1 - first_in_reversed
                    dst, value = dst[keep], value[keep]
                view[dst] = value


_BACKEND = TorchCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `torch-cpu` backend."""
    return [_BACKEND]
