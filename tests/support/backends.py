"""Backends for tests: one that records every batch it is handed, one that fails half-way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, select_backend
from multiwrite.plugins.backend import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET
from tests.support.tables import CPU


@dataclass(frozen=True)
class Recorded:
    """A snapshot of one `WriteBatch` as a backend received it (its arrays are only valid during the call)."""

    num_tables: int
    dtype: torch.dtype
    meta: np.ndarray
    values: np.ndarray
    may_overlap: bool
    values_in_order: bool

    def writes(self) -> list[tuple[int, int, int, list]]:
        """`(table, row, start, values)` of every write, in the order the batch lists them."""
        out = []
        for m in self.meta:
            off, n = int(m[META_VALUE_OFFSET]), int(m[META_LENGTH])
            out.append((int(m[META_TABLE]), int(m[META_ROW]), int(m[META_START]), self.values[off : off + n].tolist()))
        return out


class RecordingBackend(Backend):
    """A backend instance (pass it as `backend=`) that snapshots every `WriteBatch` it is handed, then forwards the
    call to `inner` (a built-in backend, by name or instance). `calls[i]` is the list of batches of call `i`."""

    NAME = "recording"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu", "cuda"})

    def __init__(self, inner: str | Backend = CPU, device: str | torch.device = "cpu"):
        self.inner = inner if isinstance(inner, Backend) else select_backend(torch.device(device), inner)
        self.calls: list[list[Recorded]] = []

    def not_supported_reasons(self, device, dtypes=()):
        return self.inner.not_supported_reasons(device, dtypes)

    def staging_buffers(self, device, np_dtype):
        return self.inner.staging_buffers(device, np_dtype)

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        self.calls.append(
            [
                Recorded(
                    len(b.tables), b.dtype, b.meta.copy(), b.values.copy(), bool(b.may_overlap), bool(b.values_in_order)
                )  # fmt: skip
                for b in batches
            ]
        )
        self.inner.apply(batches)

    @property
    def last(self) -> Recorded:
        """The one batch of the last call (asserts there was exactly one)."""
        (batch,) = self.calls[-1]
        return batch


class HalfFailingBackend(Backend):
    """A backend that fails half-way: while `failures` is positive, each call writes the writes of the first half of
    each batch's tables, then raises `exc` (and counts one failure down); afterwards it applies everything. A plain
    sequential host backend otherwise (CPU tables)."""

    NAME = "half-failing"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self, exc: BaseException | None = None, failures: int = 1):
        self.exc = exc if exc is not None else RuntimeError("lost the device half-way")
        self.failures = failures
        self.calls = 0

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        self.calls += 1
        failing = self.failures > 0
        for batch in batches:
            limit = len(batch.tables) // 2 if failing else len(batch.tables)
            for m in batch.meta:
                table, row, start = int(m[META_TABLE]), int(m[META_ROW]), int(m[META_START])
                off, n = int(m[META_VALUE_OFFSET]), int(m[META_LENGTH])
                if table < limit and n:
                    batch.tables[table][row, start : start + n] = torch.from_numpy(batch.values[off : off + n].copy())
        if failing:
            self.failures -= 1
            raise self.exc
