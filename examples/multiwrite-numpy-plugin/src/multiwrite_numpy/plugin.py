"""`numpy-cpu`: applies multiwrite's staged writes to CPU tables with numpy, one write at a time.

A deliberately small backend, to show what a plugin must do: read each `WriteBatch` (one per dtype),
write every write in staging order so that where two overlap the later one wins, and respect each
table's strides (a table may be a view). Its priority (-50) is below the built-in CPU backends, so
installing it changes nothing unless it is forced (`MULTIWRITE_BACKEND=numpy-cpu`).
"""

from __future__ import annotations

from collections.abc import Sequence

from multiwrite import Backend, WriteBatch, hookimpl
from multiwrite.plugins.backend import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET


class NumpyCpuBackend(Backend):
    """Row copies through numpy views of the tables, in staging order."""

    NAME = "numpy-cpu"
    PRIORITY = -50
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Write every write of every batch, in staging order (later writes win where they overlap). A batch
        multiwrite did not stage and check (`batch.checked` false: built by hand) is checked against its tables
        first, every batch before any is written (`WriteBatch.check_bounds` raises `StagedWriteError`)."""
        for batch in batches:
            if not batch.checked:
                batch.check_bounds(self.NAME)
        for batch in batches:
            views = [t.numpy() for t in batch.tables]  # share memory with the tables, strides included
            for table, row, start, length, offset in self.order(batch.meta):
                views[table][row, start : start + length] = batch.values[offset : offset + length]

    def order(self, meta):
        """The writes in the order they must land: staging order."""
        return (
            (int(m[META_TABLE]), int(m[META_ROW]), int(m[META_START]), int(m[META_LENGTH]), int(m[META_VALUE_OFFSET]))
            for m in meta
        )


_BACKEND = NumpyCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """This plugin's backends: module-level singletons, the same instances on every call."""
    return [_BACKEND]
