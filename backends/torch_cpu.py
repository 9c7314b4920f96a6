"""`torch-cpu`: the vectorized fallback for tables in CPU memory.

Each batch becomes one scatter per storage (one in all for `BlockTables`, whose tables share one
allocation), with cell coordinates computed by array operations (repeat and cumulative sums over the
write metadata): no Python loop runs over writes or values. The scatter writes through a numpy view of
the tensors' storage, which shares their memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, hookimpl
from multiwrite.staging import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET


class _Plan:
    """How to address a list of tables: per table its storage group, element offset and strides."""

    __slots__ = ("groups", "base", "row_stride", "col_stride", "unit_col_stride")

    def __init__(self, tables: Sequence[torch.Tensor]):
        storages: dict[int, tuple[np.ndarray, list[int]]] = {}
        for i, t in enumerate(tables):
            storage = t.untyped_storage()
            entry = storages.get(storage.data_ptr())
            if entry is None:
                whole = (storage.nbytes() // t.element_size(),)
                flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, whole, (1,))
                storages[storage.data_ptr()] = (flat.numpy(), [i])
            else:
                entry[1].append(i)
        self.groups = [(view, np.asarray(idx, dtype=np.int32)) for view, idx in storages.values()]
        self.base = np.asarray([t.storage_offset() for t in tables], dtype=np.int64)
        self.row_stride = np.asarray([t.stride(0) for t in tables], dtype=np.int64)
        self.col_stride = np.asarray([t.stride(1) for t in tables], dtype=np.int64)
        self.unit_col_stride = bool((self.col_stride == 1).all())


def scatter_indices(
    meta: np.ndarray, values: np.ndarray, plan: _Plan, values_in_order: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Storage element index and value of every cell the writes in `meta` set, in staging order.

    Cell `c` of write `w` goes to `base + row * row_stride + (start + c) * col_stride` of its table's
    storage and takes `values[offset_w + c]`. With values in order (offsets are the running sum of
    lengths) the values are `values` as they are: no cumulative sum and no gather.
    """
    table = meta[:, META_TABLE]
    cells = meta[:, META_LENGTH]
    offsets = meta[:, META_VALUE_OFFSET]
    if values_in_order:
        first, total = offsets, values.shape[0]
    else:
        ends = np.cumsum(cells, dtype=np.int64)
        total = int(ends[-1])
        first = ends - cells
    ar = np.arange(total, dtype=np.int64)
    dst_w = plan.base[table] + meta[:, META_ROW] * plan.row_stride[table]
    if plan.unit_col_stride:
        dst = np.repeat(dst_w + meta[:, META_START] - first, cells) + ar
    else:
        s1 = plan.col_stride[table]
        dst = np.repeat(dst_w + (meta[:, META_START] - first) * s1, cells) + ar * np.repeat(s1, cells)
    if values_in_order:
        return dst, values
    return dst, values[np.repeat(offsets - first, cells) + ar]


class TorchCpuBackend(Backend):
    """Applies batches to CPU tensors with one vectorized scatter per storage. Any number of tables."""

    NAME = "torch-cpu"
    PRIORITY = 0
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        self._plans: dict[tuple, _Plan] = {}

    def _plan(self, batch: WriteBatch) -> _Plan:
        # The key is also the staleness check: new storage, shape or strides give a new plan.
        key = tuple([(t.data_ptr(), t.shape, t.stride()) for t in batch.tables])
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = _Plan(batch.tables)
            for t in batch.tables:  # a plan holds views of the storages: drop it when a table dies
                weakref.finalize(t, self._plans.pop, key, None)
        return plan

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Scatter every batch into its tables; see `Backend.apply`."""
        for batch in batches:
            meta = batch.meta
            if batch.values.shape[0] == 0:
                continue  # only empty writes
            plan = self._plan(batch)
            single = len(plan.groups) == 1
            for view, members in plan.groups:
                part = meta if single else meta[np.isin(meta[:, META_TABLE], members)]
                if not single and not part[:, META_LENGTH].any():
                    continue
                dst, value = scatter_indices(part, batch.values, plan, batch.values_in_order and single)
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
