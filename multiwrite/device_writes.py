"""Device-sourced writes: rows, starts, lengths and values that are already on the device (an allocator's output, a
prefix cache's tensors) land in one 2-D table in one backend call, with no host synchronization on the Triton
backends (capturable in a CUDA graph). The design (the in-launch scan, address tables, the bad-input contract) is
docs/device-writes.md; the sequential semantics is `multiwrite.reference.apply_device_writes_reference`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from multiwrite.errors import OWN_ERRORS, StagedWriteError
from multiwrite.plugins.backend import Backend, backend_error
from multiwrite.plugins.checked import device_write_reasons, refuse_unsupported
from multiwrite.plugins.dispatch import BACKEND_ENV, select_backend
from multiwrite.staging.layout import SUPPORTED_DTYPES, dtype_name, shape_text
from multiwrite.staging.table import self_overlaps

#: dtypes of rows, starts and lengths.
INDEX_DTYPES = (torch.int32, torch.int64)
#: dtypes of the values (flat or per row); they are cast to the table's dtype as `Tensor.to` casts.
SOURCE_DTYPES = (torch.int32, torch.int64, torch.float32)
#: Words of a `DeviceWriteFaults` record: bad writes counted, then the set, write, row, start, length of one of them
#: and the table's rows and columns.
FAULT_WORDS = 8


def _host_ints(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise StagedWriteError(f"HostCopies.{what} is on {x.device}: host copies live in CPU memory")
        x = x.numpy()
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise StagedWriteError(f"HostCopies.{what} must be 1-D integers, got shape {a.shape} of {a.dtype}")
    return a.astype(np.int64)  # a copy: the set keeps what it was built with


@dataclass(frozen=True)
class HostCopies:
    """CPU copies of one set's `rows`, `starts` and `lengths` (what SGLang passes as `*_cpu`): CPU tensors, numpy
    arrays or lists, equal to the device tensors. With them every write is checked on the host before anything is
    launched, without a synchronization; they must equal the device values (the device values are what is written).
    A `DeviceWrites` reads them once, when it is built.
    """

    rows: Any
    starts: Any
    lengths: Any

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three copies as int64 numpy arrays (fresh copies)."""
        return _host_ints(self.rows, "rows"), _host_ints(self.starts, "starts"), _host_ints(self.lengths, "lengths")


@dataclass(frozen=True)
class DeviceWrites:
    """One set of device-sourced writes into one 2-D table: write i puts `lengths[i]` values into
    `table[rows[i], starts[i] : starts[i] + lengths[i]]`.

    Attributes:
        rows, starts, lengths: `[n]` int32 or int64 tensors on the table's device.
        values: a flat 1-D source (int32, int64 or float32): write i reads `values[o_i : o_i + lengths[i]]`,
            `o_i = sum(max(lengths[j], 0) for j < i)` (an exclusive scan, computed in the launch).
        sources: per-row sources: an `[n]` int64/uint64 tensor of device addresses (write i reads `lengths[i]`
            elements of `source_dtype` from address `sources[i]`; `addresses_of` builds one), or a sequence of `n`
            1-D contiguous tensors (write i reads the first `lengths[i]` elements of `sources[i]`). Exactly one of
            `values` and `sources`.
        source_dtype: the element type behind an address tensor (int32, int64, float32; required with one); for
            tensors, their common dtype (inferred).
        host: optional `HostCopies` of rows, starts, lengths: every write is then checked before the launch.
        may_overlap: True: writes of this call may touch one cell (sets in order, writes in index order, the later
            wins); False: the caller guarantees that no write of this set touches a cell another write of the call
            touches; None (default): decided from the host copies (exact), else True.
        max_length: a host-known upper bound of the lengths (decode writes: 1), a hint for the launch's shape only.

    Raises:
        StagedWriteError: a field of the wrong type, dtype, shape or device (checked without reading the device).
    """

    rows: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor | None = None
    sources: torch.Tensor | Sequence[torch.Tensor] | None = None
    source_dtype: torch.dtype | None = None
    host: HostCopies | None = None
    may_overlap: bool | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        n = None
        for what in ("rows", "starts", "lengths"):
            t = getattr(self, what)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
                raise StagedWriteError(f"DeviceWrites.{what} must be a 1-D int32 or int64 tensor, got {_shown(t)}")
            if n is not None and (t.shape[0] != n or t.device != self.rows.device):
                raise StagedWriteError(f"DeviceWrites.{what}: {_shown(t)}, but rows is {_shown(self.rows)}")
            n = t.shape[0]
        device = self.rows.device
        if (self.values is None) == (self.sources is None):
            raise StagedWriteError("DeviceWrites: give exactly one of values (a flat tensor) and sources (per row)")
        if self.values is not None:
            v = self.values
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in SOURCE_DTYPES or v.device != device:
                raise StagedWriteError(f"DeviceWrites.values must be a 1-D int32, int64 or float32 tensor on {device}, "
                                       f"got {_shown(v)}")  # fmt: skip
            if self.source_dtype not in (None, v.dtype):
                raise StagedWriteError(f"DeviceWrites.source_dtype {self.source_dtype} with values of {v.dtype}")
        elif isinstance(self.sources, torch.Tensor):
            s = self.sources
            if s.dim() != 1 or s.shape[0] != n or s.dtype not in (torch.int64, torch.uint64) or s.device != device:
                raise StagedWriteError(f"DeviceWrites.sources (addresses) must be [{n}] int64 or uint64 on {device}, "
                                       f"got {_shown(s)}")  # fmt: skip
            if self.source_dtype not in SOURCE_DTYPES:
                raise StagedWriteError(f"DeviceWrites.source_dtype must be int32, int64 or float32 with address "
                                       f"sources, got {self.source_dtype}")  # fmt: skip
        else:
            self._check_tensors(n, device)
        arrays = None
        if self.host is not None:
            if not isinstance(self.host, HostCopies):
                raise StagedWriteError(f"DeviceWrites.host must be a HostCopies, got {type(self.host).__name__}")
            arrays = self.host.arrays()
            for what, a in zip(("rows", "starts", "lengths"), arrays):
                if a.shape[0] != n:
                    raise StagedWriteError(f"DeviceWrites.host.{what} holds {a.shape[0]} entries, rows {n}")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 0):
            raise StagedWriteError(f"DeviceWrites.max_length must be an int >= 0 or None, got {self.max_length!r}")
        object.__setattr__(self, "_host_arrays", arrays)
        if self.values is not None or isinstance(self.sources, torch.Tensor):
            object.__setattr__(self, "_tensor_info", None)
        object.__setattr__(self, "_n", int(n))
        kind = "addresses" if isinstance(self.sources, torch.Tensor) else "tensors"
        kind = "values" if self.values is not None else kind
        object.__setattr__(self, "_kind", kind)
        bound = self.max_length if arrays is None else (int(arrays[2].max()) if n else 0)
        object.__setattr__(self, "_length_bound", bound)

    def _check_tensors(self, n: int, device: torch.device) -> None:
        tensors = tuple(self.sources)  # type: ignore[arg-type]
        if len(tensors) != n:
            raise StagedWriteError(f"DeviceWrites.sources: {len(tensors)} tensors for {n} writes")
        dtype = self.source_dtype or (tensors[0].dtype if tensors and isinstance(tensors[0], torch.Tensor) else None)
        info = _tensors_info(tensors, device, dtype)
        if info is None:  # some tensor is refused: find it (the one check, in order)
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.device != device or t.dtype != dtype:
                    raise StagedWriteError(f"DeviceWrites.sources[{i}] must be a 1-D tensor of {dtype} on {device}, "
                                           f"got {_shown(t)}")  # fmt: skip
                if t.shape[0] > 1 and t.stride(0) != 1:
                    raise StagedWriteError(f"DeviceWrites.sources[{i}] is not contiguous (stride {t.stride(0)})")
            raise AssertionError("_tensors_info refused tensors the check accepts")  # pragma: no cover
        if tensors and dtype not in SOURCE_DTYPES:
            raise StagedWriteError(f"DeviceWrites.sources: dtype {dtype} (supported: int32, int64, float32)")
        object.__setattr__(self, "sources", tensors)
        object.__setattr__(self, "source_dtype", dtype or torch.int64)
        object.__setattr__(self, "_tensor_info", info)

    @property
    def num_writes(self) -> int:
        """Writes in the set (`n`), empty ones included."""
        return self._n  # type: ignore[attr-defined]

    @property
    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The host copies as int64 numpy arrays (rows, starts, lengths), read when the set was built; None
        without host copies."""
        return self._host_arrays  # type: ignore[attr-defined]

    @property
    def source_sizes(self) -> np.ndarray | None:
        """Per-row tensors: their sizes (int64 `[n]`), read when the set was built; else None."""
        info = self._tensor_info  # type: ignore[attr-defined]
        return None if info is None else info[1]

    @property
    def source_addresses(self) -> np.ndarray | None:
        """Per-row tensors: their `data_ptr()`s (int64 `[n]`), read when the set was built; else None."""
        info = self._tensor_info  # type: ignore[attr-defined]
        return None if info is None else info[0]

    @property
    def length_bound(self) -> int | None:
        """The largest length the host knows of: the host copies' largest length (0 for no writes), else
        `max_length`, else None."""
        return self._length_bound  # type: ignore[attr-defined]

    @property
    def kind(self) -> str:
        """The source kind: "values", "tensors" or "addresses" (`Backend.DEVICE_WRITE_SOURCES`)."""
        return self._kind  # type: ignore[attr-defined]


def _shown(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dim()}-D {dtype_name(t.dtype)} tensor of shape {shape_text(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def _tensors_info(tensors: tuple, device: torch.device, dtype: torch.dtype | None
                  ) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
    """(addresses, sizes) as int64 arrays of 1-D contiguous tensors of `dtype` on `device`, read in one pass; None
    when any tensor is not one (the caller finds which)."""
    if not tensors:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ptrs, nbytes = [], []
    for t in tensors:  # (one loop that stops at the first refusal: 25-30% less time than gathering every attribute)
        if not isinstance(t, torch.Tensor) or t.dtype is not dtype or t.device != device or t.dim() != 1 or (
            not t.is_contiguous()
        ):
            return None
        ptrs.append(t.data_ptr())
        nbytes.append(t.nbytes)
    return np.array(ptrs, np.int64), np.array(nbytes, np.int64) // dtype.itemsize


class DeviceWriteFaults:
    """A record, on the device, of device-sourced writes skipped as bad (checked by nothing on the host: sets without
    host copies, captured replays). Pass it as `apply_device_writes(..., faults=)`; the kernel counts every bad write
    into it and keeps the set, write, row, start and length of one of them; `check()` reads it (one synchronization,
    when the caller chooses) and raises.

    Attributes:
        tensor: int64 `[FAULT_WORDS]` on `device`, at a fixed address (capturable): count, set, write, row, start,
            length, table rows, table columns.
    """

    def __init__(self, device: torch.device | str):
        self.tensor = torch.zeros(FAULT_WORDS, dtype=torch.int64, device=device)

    def check(self) -> None:
        """Raise `StagedWriteError` naming the bad write recorded (and how many there were), then clear the record;
        return quietly when none was recorded. Waits for the device."""
        count, s, w, row, start, length, rows, cols = (int(x) for x in self.tensor.tolist())
        if count:
            self.clear()
            raise StagedWriteError(
                f"device-sourced writes: {count} bad write(s) skipped, e.g. set {s}, request {w}: row {row}, start "
                f"{start}, length {length} outside the table (shape ({rows}, {cols})) or its values; those writes "
                "wrote nothing, the others landed"
            )

    def clear(self) -> None:
        """Zero the record (on the current stream)."""
        self.tensor.zero_()


def addresses_of(tensors: Sequence[torch.Tensor], device: torch.device | str, *, out: torch.Tensor | None = None
                 ) -> torch.Tensor:  # fmt: skip
    """The `[n]` int64 tensor of `tensors[i].data_ptr()` on `device` (`DeviceWrites.sources` as addresses).

    A fresh device tensor (or `out`, an int64 `[n]` device tensor filled in place: a fixed address for a graph), made
    by one non-blocking copy from a fresh pinned buffer: torch's pinned allocator records the copy on that buffer and
    hands it out again only once the copy has run, so no pinned memory is rewritten while the device may read it. The
    tensors must stay alive (and unmoved) until every launch that reads their addresses has run.

    Raises:
        StagedWriteError: a tensor not on `device`, `out` of the wrong shape, dtype or device.
        GraphCaptureError: the current stream captures a graph (the copy would re-read host memory at each replay:
            build the addresses before the capture).
    """
    from multiwrite.capture import refuse_capture
    from multiwrite.staging.layout import resolve_device

    device = resolve_device(device)
    refuse_capture(device, "addresses_of")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device != device:
            raise StagedWriteError(f"addresses_of: tensor {i} is {_shown(t)}, not on {device}")
    n = len(tensors)
    if out is not None and (out.shape != (n,) or out.dtype != torch.int64 or out.device != device):
        raise StagedWriteError(f"addresses_of: out must be [{n}] int64 on {device}, got {_shown(out)}")
    pin = device.type == "cuda"
    host = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if pin:
        host = host.pin_memory()
    if out is None:
        return host.to(device, non_blocking=True) if pin else host.to(device)
    out.copy_(host, non_blocking=pin)
    return out


def check_host_copies(table: torch.Tensor, writes: Sequence[DeviceWrites]) -> None:
    """Check every write of the sets that carry host copies against `table`'s shape and their sources (vectorized):
    raise `StagedWriteError` naming the set, the write (request), its row, start and length and the table's shape."""
    rows, cols = table.shape
    for s, w in enumerate(writes):
        if w.host_arrays is None:
            continue
        r, st, ln = w.host_arrays
        if _fits(w, r, st, ln, rows, cols):
            continue
        bad = (r < 0) | (r >= rows) | (st < 0) | (ln < 0) | (st > cols - ln)  # (st + ln could wrap)
        what = np.where(bad, 1, 0)
        if w.kind == "values":
            ends = np.cumsum(np.maximum(ln, 0))
            what = np.where(~bad & (ends > w.values.shape[0]), 2, what)  # type: ignore[union-attr]
        elif w.kind == "tensors":
            numel = w.source_sizes
            what = np.where(~bad & (ln > numel), 3, what)
        if not what.any():
            continue
        i = int(np.argmax(what != 0))
        where = (f"device writes set {s}, request {i}: row {int(r[i])}, start {int(st[i])}, length {int(ln[i])} "
                 f"into the table of shape ({rows}, {cols}), {dtype_name(table.dtype)}")  # fmt: skip
        if what[i] == 2:
            why = f"its values end at {int(ends[i])}, past the {w.values.shape[0]} values given"  # type: ignore
        elif what[i] == 3:
            why = f"its source tensor holds {int(numel[i])} elements"
        elif not 0 <= r[i] < rows:
            why = f"row {int(r[i])} is outside [0, {rows})"
        elif ln[i] < 0 or st[i] < 0:
            why = "a negative start or length"
        else:
            why = f"it ends at column {int(st[i]) + int(ln[i])}, past the row width {cols}"
        raise StagedWriteError(f"{where}: {why}; nothing was written")


def _fits(w: DeviceWrites, r: np.ndarray, st: np.ndarray, ln: np.ndarray, rows: int, cols: int) -> bool:
    """True when every write of `w` is good (a cheap precondition of `check_host_copies`' search, a few reductions);
    False when some write may be bad."""
    if not r.shape[0]:
        return True
    u = np.uint64
    # a negative row reads as a huge unsigned one; starts and lengths known >= 0 add up exactly as unsigned
    if r.view(u).max() >= rows or (st | ln).min() < 0 or (st.view(u) + ln.view(u)).max() > cols:
        return False
    if w.kind == "values":
        return int(ln.sum()) <= w.values.shape[0]  # type: ignore[union-attr]
    if w.kind == "tensors":
        return bool((w.source_sizes - ln).min() >= 0)  # type: ignore[operator]
    return True


def may_overlap(table: torch.Tensor, writes: Sequence[DeviceWrites]) -> bool:
    """Whether the writes must land in order (the later wins): a set that says so, a set that says nothing and has no
    host copies, or an overlap among the sets whose host copies decide (exact, vectorized)."""
    known = []
    for w in writes:
        if w.may_overlap or (w.may_overlap is None and w.host is None):
            return True
        if w.may_overlap is None:
            known.append(w.host_arrays)
    if not known:
        return False
    r, st, ln = (np.concatenate(a) for a in zip(*known))
    keep = ln > 0
    width = int(table.shape[1]) + 1
    lo, hi = r[keep] * width + st[keep], r[keep] * width + st[keep] + ln[keep]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    return bool(lo.shape[0] > 1 and (lo[1:] < np.maximum.accumulate(hi)[:-1]).any())


_local = threading.local()  # per thread: (device, dtype, kinds, forced) -> the backend chosen


def _backend_for(device: torch.device, dtype: torch.dtype, kinds: frozenset[str], backend: str | Backend | None
                 ) -> Backend:  # fmt: skip
    chosen = getattr(_local, "chosen", None)
    if chosen is None:
        chosen = _local.chosen = {}
    forced = backend if isinstance(backend, Backend) else (backend or os.environ.get(BACKEND_ENV) or None)
    key = (device, dtype, kinds, forced if not isinstance(forced, Backend) else id(forced))
    found = chosen.get(key)
    if found is not None and (not isinstance(forced, Backend) or found is forced):
        return found
    if isinstance(forced, Backend):
        from multiwrite.errors import BackendUnavailableError

        refuse_unsupported(forced, device)
        reasons = device_write_reasons(forced, kinds)
        if dtype not in forced.SUPPORTED_DTYPES:
            reasons.append(f"dtype={dtype_name(dtype)}")
        if reasons:
            raise BackendUnavailableError(f"backend {forced.NAME!r} cannot apply these writes: {'; '.join(reasons)}")
        found = forced
    else:
        found = select_backend(device, forced, [dtype], device_writes=kinds)
    chosen[key] = found
    return found


def apply_device_writes(table: torch.Tensor, writes: DeviceWrites | Sequence[DeviceWrites], *,
                        backend: str | Backend | None = None, faults: DeviceWriteFaults | None = None) -> None:
    """Apply every set in `writes` to `table` in ONE launch on the Triton backends, in order: sets in sequence order,
    writes in index order, the later winning where writes overlap (as `apply_device_writes_reference`). Values are
    cast to the table's dtype as `Tensor.to` casts. Enqueued on the current stream; no host synchronization on the
    Triton backends (the torch backends read the lengths to the host once per set unless host copies are given).
    Capturable in a CUDA graph on the Triton backends: a replay reads the device inputs at their captured addresses.

    Args:
        table: a 2-D int32, int64 or float32 tensor (a view works; its cells must not overlap in memory).
        writes: the sets (`DeviceWrites`), or one set.
        backend: a backend name or instance to force; None picks the best one that reads these sources
            (`Backend.DEVICE_WRITE_SOURCES`), remembered per thread.
        faults: a `DeviceWriteFaults` record: bad writes the host could not check are counted there.

    Raises:
        StagedWriteError: a bad set, a set on another device, a table that is not 2-D of a supported dtype or whose
            cells overlap; a bad write of a set with host copies (naming the set, request, row, start, length and
            the table's shape). Raised before anything is written. Bad writes without host copies are skipped whole
            (never written outside the table) and counted into `faults`.
        BackendUnavailableError: no backend reads these sources for this table (or the forced one cannot).
        BackendError: the backend failed (its exception is the cause).
    """
    if isinstance(writes, DeviceWrites):
        writes = [writes]
    writes = list(writes)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype not in SUPPORTED_DTYPES:
        raise StagedWriteError(f"apply_device_writes: the table must be a 2-D int32, int64 or float32 tensor, got "
                               f"{_shown(table)}")  # fmt: skip
    if self_overlaps(table):
        raise StagedWriteError(f"apply_device_writes: the table's cells overlap in memory (shape "
                               f"{shape_text(table.shape)}, strides {tuple(table.stride())})")  # fmt: skip
    for s, w in enumerate(writes):
        if not isinstance(w, DeviceWrites):
            raise StagedWriteError(f"apply_device_writes: set {s} is a {type(w).__name__}, not a DeviceWrites")
        if w.rows.device != table.device:
            raise StagedWriteError(f"apply_device_writes: set {s} is on {w.rows.device}, the table on {table.device}")
    if faults is not None and (faults.tensor.device != table.device):
        raise StagedWriteError(f"apply_device_writes: faults on {faults.tensor.device}, the table on {table.device}")
    check_host_copies(table, writes)
    writes = [w for w in writes if w.num_writes]
    if not writes or table.numel() == 0:
        return
    chosen = _backend_for(table.device, table.dtype, frozenset(w.kind for w in writes), backend)
    ordered = may_overlap(table, writes)
    try:
        chosen.apply_device_writes(table, writes, ordered=ordered, faults=None if faults is None else faults.tensor)
    except Exception as exc:
        if isinstance(exc, OWN_ERRORS):
            raise
        name = f"a table of shape {shape_text(table.shape)}"
        raise backend_error(chosen, table.device, [name], sum(w.num_writes for w in writes), exc,
                            left="nothing is staged: call again once the cause is fixed") from exc  # fmt: skip


__all__ = ["DeviceWriteFaults", "DeviceWrites", "HostCopies", "addresses_of", "apply_device_writes"]
