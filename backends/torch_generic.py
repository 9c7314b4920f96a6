"""`torch-generic`: correct fused writes on every torch device type, with nothing but torch.

The fallback for devices no other backend knows (Intel XPU, Apple MPS, Ascend NPU, Gaudi HPU, ...): at the
lowest priority of the built-ins (-100), so it is never chosen where `torch-cpu`, `compiled-cpu` or a
Triton backend can run, but a user of any other torch device gets correct fused writes with no plugin.

Per batch and per storage (tables sharing one allocation, as a `BlockTables` does, cost one pass):
1. the write metadata and the values are copied host -> device with one synchronous copy each (from
   pageable memory; torch returns only when the host arrays have been read, so they can be reused at
   once). This is the simplest correct choice for every device; it waits for the current stream.
2. each cell's storage element index is computed on the device by index arithmetic: the write that owns
   each cell (`searchsorted` of a cell counter in the writes' running cell ends), that write's row
   address, plus the cell's place within the write;
3. where writes may overlap, a stable sort by index keeps the last write of each cell (staging order
   wins), so the result never depends on the device's scatter order;
4. one `index_put_` into a flat view of the storage (`as_strided`), enqueued on the current stream.
No Python loop runs over writes or values. Every write is checked against its table's current shape
before anything is copied (defence in depth: nothing is written outside a table).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from multiwrite.plugins.backend import Backend, WriteBatch
from multiwrite.plugins.device_writes_torch import TorchDeviceWrites
from multiwrite.plugins.hookspecs import hookimpl
from multiwrite.staging.layout import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET

#: Device types that hold no data (nothing to write into).
_NO_DATA_DEVICE_TYPES = frozenset({"meta"})


class TorchGenericBackend(TorchDeviceWrites, Backend):
    """Applies batches on any torch device with device-side index arithmetic and one `index_put_` per
    storage. Lowest built-in priority (-100)."""

    NAME = "torch-generic"
    PRIORITY = -100
    SUPPORTED_DEVICE_TYPES = frozenset()  # every type but those in _NO_DATA_DEVICE_TYPES

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """Any device type but `meta`; the dtypes multiwrite stages."""
        reasons = []
        if device.type in _NO_DATA_DEVICE_TYPES:
            reasons.append(f"device type {device.type} holds no data (supported: every other torch device type)")
        elif not _device_type_available(device.type):
            reasons.append(f"torch reports no {device.type} device ({device.type}.is_available() is False)")
        for dtype in dtypes:
            if dtype not in self.SUPPORTED_DTYPES:
                allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.SUPPORTED_DTYPES))
                reasons.append(f"dtype={str(dtype).removeprefix('torch.')} (supported: {allowed})")
        return reasons

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Write every batch into its tables; see `Backend.apply`.

        Raises:
            StagedWriteError: a write outside its table's current shape (not possible for writes staged and
                applied through multiwrite); raised before anything of any batch is written.
        """
        for batch in batches:
            batch.check_bounds(self.NAME)
        for batch in batches:
            if batch.values.shape[0] == 0:
                continue  # only empty writes
            meta = np.ascontiguousarray(batch.meta)
            meta = meta[meta[:, META_LENGTH] > 0]
            storages: dict[tuple, list[int]] = {}
            for i, t in enumerate(batch.tables):
                key = (t.device, t.untyped_storage().data_ptr())
                storages.setdefault(key, []).append(i)
            if len(storages) == 1:
                _scatter(batch, meta, list(range(len(batch.tables))))
            else:
                for members in storages.values():
                    part = meta[np.isin(meta[:, META_TABLE], members)]
                    if part.shape[0]:
                        _scatter(batch, part, members)


def _device_type_available(device_type: str) -> bool:
    """Whether torch has a usable device of this type: `torch.<type>.is_available()` (or
    `torch.backends.mps.is_available()`), true where torch offers no such probe."""
    if device_type == "cpu":
        return True
    module = torch.backends.mps if device_type == "mps" else getattr(torch, device_type, None)
    probe = getattr(module, "is_available", None)
    if probe is None:
        return True
    try:
        return bool(probe())
    except Exception:
        return False


def _scatter(batch: WriteBatch, meta: np.ndarray, members: list[int]) -> None:
    """Write the writes of `meta` (all to tables in `members`, which share one storage) in one index_put_."""
    tables = batch.tables
    anchor = tables[members[0]]
    device = anchor.device
    ntab = len(tables)
    geometry = np.zeros((ntab, 3), dtype=np.int64)
    for i in members:
        t = tables[i]
        geometry[i] = (t.storage_offset(), t.stride(0), t.stride(1))
    lengths = meta[:, META_LENGTH].astype(np.int64)
    total = int(lengths.sum())
    # One synchronous host -> device copy each: the host arrays may be reused as soon as this returns.
    m = torch.from_numpy(meta.astype(np.int64)).to(device)
    vals = torch.from_numpy(np.ascontiguousarray(batch.values)).to(device)
    geo = torch.from_numpy(geometry).to(device)
    table = m[:, META_TABLE]
    g = geo[table]
    row_addr = g[:, 0] + m[:, META_ROW] * g[:, 1] + m[:, META_START] * g[:, 2]
    cell_len = m[:, META_LENGTH]
    ends = torch.cumsum(cell_len, 0)  # one past each write's last cell in the flat cell list
    cell = torch.arange(total, device=device, dtype=torch.int64)
    # The write each cell belongs to: the first whose end lies past it (empty writes own no cell). A
    # search rather than repeat_interleave, which costs ~13 ms a call on CPU in torch 2.13 whatever its size.
    owner = torch.searchsorted(ends, cell, right=True)
    within = cell - (ends - cell_len)[owner]
    dst = row_addr[owner] + within * g[owner, 2]
    src = m[owner, META_VALUE_OFFSET] + within
    if batch.may_overlap:  # keep each cell's last write: staging order wins, whatever the scatter order
        order = torch.sort(dst, stable=True).indices
        sorted_dst = dst[order]
        last = torch.ones(total, dtype=torch.bool, device=device)
        last[:-1] = sorted_dst[1:] != sorted_dst[:-1]
        keep = order[last]
        dst, src = dst[keep], src[keep]
    numel = anchor.untyped_storage().nbytes() // anchor.element_size()
    flat = anchor.as_strided((numel,), (1,), 0)
    flat.index_put_((dst,), vals[src].to(anchor.dtype))


_BACKEND = TorchGenericBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `torch-generic` backend."""
    return [_BACKEND]
