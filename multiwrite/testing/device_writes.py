"""Random device-sourced writes for the conformance kit and multiwrite's own tests: sets of every source kind, index
dtype and size, disjoint or overlapping, with or without host copies, checked against
`multiwrite.reference.apply_device_writes_reference`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.device_writes import DeviceWrites, HostCopies, addresses_of

KINDS = ("values", "tensors", "addresses")


@dataclass
class Drawn:
    """Sets drawn by `draw_sets`, and the per-row tensors an address set reads (kept alive here)."""

    sets: list[DeviceWrites]
    keep: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # set index -> the tensors behind its addresses

    def reference(self, table: torch.Tensor) -> np.ndarray:
        """What `apply_device_writes(table, self.sets)` must leave: the reference on a host copy of `table` (address
        sets read through the tensors behind their addresses, so that device addresses work too)."""
        from multiwrite.reference import apply_device_writes_reference

        sets = [dataclasses.replace(w, sources=self.keep[i], source_dtype=None) if i in self.keep else w
                for i, w in enumerate(self.sets)]  # fmt: skip
        return apply_device_writes_reference(table.detach().cpu().numpy().copy(), sets)


def draw_sets(rng: np.random.Generator, shape: tuple[int, int], device: torch.device, *, bs: int, kind: str = "values",
              index_dtype: torch.dtype = torch.int32, source_dtype: torch.dtype = torch.int64, host: bool = True,
              overlap: bool = False, max_len: int | None = None, sets: int = 1) -> Drawn:  # fmt: skip
    """`sets` sets of `bs` writes each into a table of `shape`: distinct rows per set (rows drawn from the whole table,
    so two sets may share rows but not cells: set `j` writes the columns of its band `j` of the row) unless
    `overlap` (rows from a few, columns anywhere: writes overlap); lengths up to `max_len` (default the band's
    width), some empty, some a full band. Values are small integers every dtype holds exactly."""
    rows, cols = shape
    band = cols // sets
    drawn = Drawn([])
    for j in range(sets):
        if overlap:
            r = rng.integers(0, min(rows, 3), bs)
        else:
            r = rng.choice(rows, size=bs, replace=bs > rows)
        top = band if max_len is None else min(max_len, band)
        ln = rng.integers(0, top + 1, bs)
        if bs > 2:
            ln[0], ln[1] = 0, top
        lo = 0 if overlap else j * band
        st = lo + np.asarray([rng.integers(0, (cols if overlap else band) - n + 1) for n in ln])
        st = np.minimum(st, cols - ln)
        as_dev = [torch.tensor(a, dtype=index_dtype, device=device) for a in (r, st, ln)]
        hostc = HostCopies(r.copy(), st.copy(), ln.copy()) if host else None
        hint = None if host or max_len is None else int(max_len)
        may = None if host else overlap
        if kind == "values":
            values = torch.tensor(rng.integers(-1000, 1000, int(ln.sum()) + 3), dtype=source_dtype, device=device)
            drawn.sets.append(DeviceWrites(*as_dev, values=values, host=hostc, may_overlap=may, max_length=hint))
            continue
        tensors = [torch.tensor(rng.integers(-1000, 1000, int(n) + int(rng.integers(0, 3))), dtype=source_dtype,
                                device=device) for n in ln]  # fmt: skip
        if kind == "tensors":
            drawn.sets.append(DeviceWrites(*as_dev, sources=tensors, host=hostc, may_overlap=may, max_length=hint))
        else:
            drawn.keep[j] = tensors
            drawn.sets.append(DeviceWrites(*as_dev, sources=addresses_of(tensors, device), source_dtype=source_dtype,
                                           host=hostc, may_overlap=may, max_length=hint))  # fmt: skip
    return drawn

