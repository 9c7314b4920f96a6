"""`torch-cpu`: the vectorized fallback for tables in CPU memory.

Each batch becomes one scatter per storage (one in all for `BlockTables`, whose tables share one
allocation), with cell coordinates computed by array operations (repeat and cumulative sums over the
write metadata): no Python loop runs over writes or values. Every write is checked against its table's
current shape first unless multiwrite staged and checked it (vectorized); a write outside it raises before any
cell of the batch is written.

The scatter writes through a numpy array over the storage's address range that does not own or keep
alive the memory (see `_Plan`): the cache of plans therefore holds no tensor, storage or finalizer, and
stays correct because a plan is only ever looked up with the key of live tables.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.plugins.backend import Backend, WriteBatch, remember
from multiwrite.plugins.device_writes_torch import TorchDeviceWrites
from multiwrite.plugins.hookspecs import hookimpl
from multiwrite.staging.layout import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET

#: Most plans kept (each a few small arrays per table, no tensor memory); the oldest goes first.
PLAN_CACHE_SIZE = 64


def plan_key(tables: Sequence[torch.Tensor]) -> tuple:
    """Everything that decides where a table's cells are and which bit pattern a value gets there.

    Per table: dtype (element size and bit pattern), address of element [0, 0] (the storage's address
    plus the storage offset), shape and strides. Two lists of live tables with equal keys address
    exactly the same bytes in the same way, whatever storages they belong to.
    """
    return tuple([(t.dtype, t.data_ptr(), t.shape, t.stride()) for t in tables])


def _host_array(address: int, nbytes: int, dtype: torch.dtype) -> np.ndarray:
    """A numpy array over `nbytes` of host memory at `address`: no ownership, no reference kept."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    if nbytes == 0:
        return np.empty(0, dtype=np_dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np_dtype)


class _Plan:
    """How to address a list of tables: storage groups, per table element offset, strides and shape.

    `groups` holds per storage a numpy array over the storage's memory (not owning it) and the indices
    of its tables. A plan is only used for tables whose `plan_key` equals the one it was built for, and
    such tables are alive and own that memory for the duration of the apply.
    """

    __slots__ = ("groups", "base", "row_stride", "col_stride", "unit_col_stride", "rows", "cols")

    def __init__(self, tables: Sequence[torch.Tensor]):
        storages: dict[int, tuple[np.ndarray, list[int], int]] = {}
        base = []
        for i, t in enumerate(tables):
            storage = t.untyped_storage()
            address = storage.data_ptr()
            entry = storages.get(address)
            if entry is None:
                view = _host_array(address, storage.nbytes() // t.element_size() * t.element_size(), t.dtype)
                storages[address] = (view, [i], address)
            else:
                entry[1].append(i)
            base.append(t.storage_offset())
        self.groups = [(view, np.asarray(idx, dtype=np.int32)) for view, idx, _ in storages.values()]
        self.base = np.asarray(base, dtype=np.int64)
        self.row_stride = np.asarray([t.stride(0) for t in tables], dtype=np.int64)
        self.col_stride = np.asarray([t.stride(1) for t in tables], dtype=np.int64)
        self.unit_col_stride = bool((self.col_stride == 1).all())
        self.rows = np.asarray([t.shape[0] for t in tables], dtype=np.int64)
        self.cols = np.asarray([t.shape[1] for t in tables], dtype=np.int64)


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


class TorchCpuBackend(TorchDeviceWrites, Backend):
    """Applies batches to CPU tensors with one vectorized scatter per storage. Any number of tables.

    Shared by every writer (a module-level singleton): the plan cache is read without a lock (one dict
    lookup is atomic) and filled and evicted under `_lock`, so threads applying distinct tables at once
    never see a half-built plan or a failed eviction.

    Raises (from `apply`):
        StagedWriteError: a write outside its table's current shape (a table shrunk under staged
            writes, or a batch not built by multiwrite); nothing of the batch was written.
    """

    NAME = "torch-cpu"
    PRIORITY = 0
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        self._plans: dict[tuple, _Plan] = {}  # plan_key -> _Plan, at most PLAN_CACHE_SIZE, oldest first
        self._lock = threading.Lock()

    def _plan(self, batch: WriteBatch) -> _Plan:
        key = plan_key(batch.tables)
        plan = self._plans.get(key)
        if plan is None:
            plan = _Plan(batch.tables)
            remember(self._plans, key, plan, PLAN_CACHE_SIZE, self._lock)
        return plan

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Scatter every batch into its tables; see `Backend.apply`. Every batch not checked by multiwrite is
        checked (`WriteBatch.check_bounds`) before any is written."""
        work = []
        for batch in batches:
            if batch.values.shape[0] == 0:
                continue  # only empty writes
            if not batch.checked:
                batch.check_bounds(self.NAME)
            work.append((batch, self._plan(batch)))
        for batch, plan in work:
            meta = batch.meta
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
