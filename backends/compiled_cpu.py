"""`compiled-cpu`: CPU tables written by one C call per batch, in staging order.

The fastest way to land a small batch in host memory is a loop of row copies in C: a decode step's
handful of writes costs less than one numpy call. This backend uses the compiled helper that `pip`
builds with multiwrite (`multiwrite/staging/_cstaging.c`, `scatter_writes`); where it was not built (no C
compiler at install time) it reports that as its reason and `torch-cpu`, the vectorized pure-torch
fallback, takes over. Writes land in staging order, so where they overlap the later one wins.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.plugins.backend import Backend, WriteBatch, remember
from multiwrite.plugins.device_writes_torch import TorchDeviceWrites
from multiwrite.plugins.hookspecs import hookimpl
from multiwrite.staging.layout import SUPPORTED_DTYPES, dtype_name

try:
    from multiwrite.staging._cstaging import scatter_writes
except ImportError:  # pragma: no cover - depends on the install
    scatter_writes = None

_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride
_DTYPE = torch.Tensor.dtype.__get__

#: Most descriptor tables kept (each `[num_tables, 5]` int64, no tensor memory); the oldest goes first.
DESCRIPTOR_CACHE_SIZE = 64


class CompiledCpuBackend(TorchDeviceWrites, Backend):
    """Applies batches to CPU tensors with one C call per batch (row copies in staging order).

    Shared by every writer (a module-level singleton): the descriptor cache is read without a lock (one
    dict lookup is atomic) and filled and evicted under `_lock`.

    Raises (from `apply`):
        StagedWriteError: a write outside its table's current shape or outside the values, or values of
            another dtype than the tables'; nothing of any batch was written.
    """

    NAME = "compiled-cpu"
    PRIORITY = 10
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        # (dtype, data_ptr, shape, stride of every table) -> (int64 [num_tables, 5] descriptors, numpy
        # dtype of the values). Holds no tensor: a new dtype, address, shape or stride is a new key, never
        # a stale address; the shape in the key is the one the C helper checks every write against.
        self._descriptors: dict[tuple, tuple[np.ndarray, np.dtype]] = {}
        self._lock = threading.Lock()

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """Base checks, then whether the compiled helper was built."""
        reasons = super().not_supported_reasons(device, dtypes)
        if scatter_writes is None:
            reasons.append("multiwrite.staging._cstaging is not built (no C compiler or Python headers at install)")
        return reasons

    def _describe(self, tables: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.dtype]:
        key = (*map(_DTYPE, tables), *map(_PTR, tables), *map(_SIZE, tables), *map(_STRIDE, tables))
        entry = self._descriptors.get(key)
        if entry is None:
            dtypes = {t.dtype for t in tables}
            if len(dtypes) != 1 or tables[0].dtype not in SUPPORTED_DTYPES:
                raise StagedWriteError(
                    f"{self.NAME}: a batch's tables must share one supported dtype, got "
                    f"{sorted(dtype_name(d) for d in dtypes)}; nothing was written"
                )
            descriptors = np.array(
                [(t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1]) for t in tables], dtype=np.int64
            )
            entry = (descriptors, np.dtype(SUPPORTED_DTYPES[tables[0].dtype]))
            remember(self._descriptors, key, entry, DESCRIPTOR_CACHE_SIZE, self._lock)
        return entry

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Write every batch into its tables; see `Backend.apply`. With several batches (dtypes), every
        batch is checked before any is written."""
        work = []
        for batch in batches:
            if not batch.values.shape[0]:
                continue  # only empty writes
            tables = batch.tables
            descriptors, np_dtype = self._describe(tables)
            values = batch.values
            if values.dtype != np_dtype:  # the C helper copies raw items: they must be the tables' own
                raise StagedWriteError(
                    f"{self.NAME}: values of dtype {values.dtype} for {dtype_name(tables[0].dtype)} tables; "
                    "nothing was written"
                )
            work.append((np.ascontiguousarray(batch.meta), np.ascontiguousarray(values), descriptors, tables[0].dtype))
        passes = (True, False) if len(work) > 1 else (False,)
        for check_only in passes:
            for meta, values, descriptors, dtype in work:
                try:
                    scatter_writes(meta, values, descriptors, check_only)
                except ValueError as exc:  # a write outside its table: the C helper checks before writing
                    raise StagedWriteError(f"{self.NAME} ({dtype_name(dtype)} tables): {exc}") from None


_BACKEND = CompiledCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `compiled-cpu` backend."""
    return [_BACKEND]
