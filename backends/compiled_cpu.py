"""`compiled-cpu`: CPU tables written by one C call per batch, in staging order.

The fastest way to land a small batch in host memory is a loop of row copies in C: a decode step's
handful of writes costs less than one numpy call. This backend uses the compiled helper that `pip`
builds with multiwrite (`multiwrite/_cstaging.c`, `scatter_writes`); where it was not built (no C
compiler at install time) it reports that as its reason and `torch-cpu`, the vectorized pure-torch
fallback, takes over. Writes land in staging order, so where they overlap the later one wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, hookimpl

try:
    from multiwrite._cstaging import scatter_writes
except ImportError:  # pragma: no cover - depends on the install
    scatter_writes = None

_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride


class CompiledCpuBackend(Backend):
    """Applies batches to CPU tensors with one C call per batch (row copies in staging order)."""

    NAME = "compiled-cpu"
    PRIORITY = 10
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self) -> None:
        # (data_ptr, shape, stride) of every table -> int64 [num_tables, 5] descriptors. Holds no tensor:
        # a new storage, shape or stride is a new key, never a stale address.
        self._descriptors: dict[tuple, np.ndarray] = {}

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """Base checks, then whether the compiled helper was built."""
        reasons = super().not_supported_reasons(device, dtypes)
        if scatter_writes is None:
            reasons.append("multiwrite._cstaging is not built (no C compiler or Python headers at install time)")
        return reasons

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Write every batch into its tables; see `Backend.apply`.

        Raises:
            ValueError: a write outside its table (not possible for writes staged through multiwrite);
                nothing of that batch is written.
        """
        for batch in batches:
            if not batch.values.shape[0]:
                continue  # only empty writes
            tables = batch.tables
            key = (*map(_PTR, tables), *map(_SIZE, tables), *map(_STRIDE, tables))
            descriptors = self._descriptors.get(key)
            if descriptors is None:
                if len(self._descriptors) >= 64:
                    self._descriptors.clear()
                descriptors = self._descriptors[key] = np.array(
                    [(t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1]) for t in tables], dtype=np.int64
                )
            scatter_writes(np.ascontiguousarray(batch.meta), np.ascontiguousarray(batch.values), descriptors)


_BACKEND = CompiledCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `compiled-cpu` backend."""
    return [_BACKEND]
