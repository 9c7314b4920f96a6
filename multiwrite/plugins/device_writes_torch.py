"""Device-sourced writes with torch ops only (`torch-generic`, `torch-cpu`, `compiled-cpu`): per set, the cells'
storage indices by index arithmetic (the write owning each cell by `searchsorted` of a cell counter in the running
ends of the lengths), one `index_put_` for the call. No Python loop runs over writes or cells. The number of cells of
a set comes from its host copies, else from one read of the device (`int(lengths.sum())`, one synchronization per
set): these backends cannot be captured in a CUDA graph. Per-row sources are read from their tensors (`torch.cat`),
never by address. docs/device-writes.md has the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from multiwrite.capture import is_capturing
from multiwrite.errors import GraphCaptureError

if TYPE_CHECKING:
    from multiwrite.plugins.backend import DeviceWriteSet

#: The source kinds these backends read (`Backend.DEVICE_WRITE_SOURCES`).
TORCH_DEVICE_WRITE_SOURCES = frozenset({"values", "tensors"})


class TorchDeviceWrites:
    """The device-sourced writes of a backend by torch ops: put it before `Backend` in the backend's bases; it
    declares `TORCH_DEVICE_WRITE_SOURCES` and applies them with `apply_device_writes_torch` (module docstring)."""

    NAME: str
    DEVICE_WRITE_SOURCES = TORCH_DEVICE_WRITE_SOURCES

    def apply_device_writes(self, table: torch.Tensor, writes: Sequence[DeviceWriteSet], *, ordered: bool,
                            faults: torch.Tensor | None) -> None:  # fmt: skip
        """`Backend.apply_device_writes` with torch ops (module docstring)."""
        apply_device_writes_torch(table, writes, ordered, faults, self.NAME)


def apply_device_writes_torch(table: torch.Tensor, writes: Sequence[DeviceWriteSet], ordered: bool,
                              faults: torch.Tensor | None, backend: str) -> None:  # fmt: skip
    """`Backend.apply_device_writes` with torch ops (module docstring).

    Raises:
        GraphCaptureError: the current stream captures a CUDA graph (the cell counts are read on the host).
    """
    if is_capturing(table.device):
        raise GraphCaptureError(f"{backend}: device-sourced writes read their lengths on the host and cannot be "
                                "captured in a CUDA graph; use a Triton backend")  # fmt: skip
    rows, cols = table.shape
    device = table.device
    dsts, vals = [], []
    for s, w in enumerate(writes):
        r, st, ln = (x.to(torch.int64) for x in (w.rows, w.starts, w.lengths))
        valid = (r >= 0) & (r < rows) & (st >= 0) & (ln >= 0) & (st + ln <= cols)
        counted = ln.clamp(min=0)
        if w.kind == "values":
            offsets = torch.cumsum(counted, 0) - counted
            valid &= offsets + ln <= w.values.shape[0]  # type: ignore[union-attr]
        else:
            numel = torch.tensor([t.shape[0] for t in w.sources], dtype=torch.int64, device=device)  # type: ignore
            offsets = torch.cumsum(numel, 0) - numel
            valid &= ln <= numel
        if faults is not None:
            _record(faults, s, ~valid, r, st, ln, rows, cols)
        eff = torch.where(valid, ln, 0)
        total = int(w.host_arrays[2].sum()) if w.host_arrays is not None else int(eff.sum())
        if total == 0:
            continue
        ends = torch.cumsum(eff, 0)
        cell = torch.arange(total, device=device, dtype=torch.int64)
        owner = torch.searchsorted(ends, cell, right=True)
        within = cell - (ends - eff)[owner]
        dsts.append(table.storage_offset() + r[owner] * table.stride(0) + (st[owner] + within) * table.stride(1))
        source = w.values if w.kind == "values" else torch.cat(list(w.sources))  # type: ignore[arg-type]
        vals.append(source[offsets[owner] + within].to(table.dtype))  # type: ignore[index]
    if not dsts:
        return
    dst, val = torch.cat(dsts), torch.cat(vals)
    if ordered:  # keep each cell's last write: sets in order, writes in index order
        order = torch.sort(dst, stable=True).indices
        sorted_dst = dst[order]
        last = torch.ones_like(sorted_dst, dtype=torch.bool)
        last[:-1] = sorted_dst[1:] != sorted_dst[:-1]
        keep = order[last]
        dst, val = dst[keep], val[keep]
    numel = table.untyped_storage().nbytes() // table.element_size()
    table.as_strided((numel,), (1,), 0).index_put_((dst,), val)


def _record(faults: torch.Tensor, s: int, bad: torch.Tensor, r: torch.Tensor, st: torch.Tensor, ln: torch.Tensor,
            rows: int, cols: int) -> None:  # fmt: skip
    """Count the bad writes of set `s` into `faults` and, when it held none, keep the first one (device ops only)."""
    count = bad.sum()
    first = torch.argmax(bad.to(torch.int32))
    record = torch.stack([torch.full_like(r[first], s), first, r[first], st[first], ln[first],
                          torch.full_like(r[first], rows), torch.full_like(r[first], cols)])  # fmt: skip
    keep = (faults[0] == 0) & (count > 0)
    faults[1:] = torch.where(keep, record, faults[1:])
    faults[0] += count
