"""Host-side staging: `StagedWriteTensor` and the preallocated arrays that buffer its writes.

A staged write is `(row, start, values)`: it will set `tensor[row, start:start + len(values) * k]`, where
each value `v` becomes the `k` values `v * k + j` (`k` is `kernel_blocks_per_block`, 1 for a plain
table). The expansion happens here, at staging time, so backends write values exactly as staged.
Writes wait in a `StagingArena` (plain numpy arrays that grow geometrically) until a
`FusedStagedWriter` applies them; one arena may serve several tables of one dtype, so that all the
KV-cache groups of a `BlockTables` are packed in staging order, ready to hand to a kernel in one piece.
"""

from __future__ import annotations

import itertools
import numbers
import operator
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import BackendUnavailableError, StagedWriteError

# Columns of the per-write metadata rows (int32), the layout every backend receives.
META_TABLE = 0  #: index of the target table within the batch
META_ROW = 1  #: row of the table
META_START = 2  #: first column written
META_LENGTH = 3  #: number of values = cells written (kernel block ids are expanded when staged)
META_VALUE_OFFSET = 4  #: offset of the write's first value in the batch's value array
META_COLUMNS = 5

#: torch dtype -> numpy dtype of the staged values.
SUPPORTED_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
}

_INT_LIMITS = {np.int32: (-(2**31), 2**31 - 1), np.int64: (-(2**63), 2**63 - 1)}
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1  # rows, starts and lengths travel as int32 metadata
_TENSOR_VALUE_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float64,
}


#: The staging clock every arena shares (and the compiled path, through its address): `[uid of the arena
#: that staged last, number of runs started]`. A run is a stretch of consecutive writes into one arena;
#: each arena records `(clock, first write)` when one starts, so the writes of several arenas can be put
#: back in true staging order when they are applied together (`staging_order`). Staging into the arena
#: that staged last costs one compare.
STAGE_CLOCK = np.zeros(2, dtype=np.int64)
_CLOCK = STAGE_CLOCK.data  # int64 loads and stores without numpy scalars
_arena_uids = itertools.count(1)

try:  # the compiled staging paths (optional: built where a C compiler exists)
    from multiwrite._cstaging import ArenaFields as _ArenaFields
    from multiwrite._cstaging import bind_clock as _bind_clock
    from multiwrite._cstaging import rotate_lent as _rotate_lent

    _bind_clock(STAGE_CLOCK, STAGE_CLOCK.ctypes.data)
except ImportError:  # pragma: no cover - depends on the install
    _rotate_lent = None

    class _ArenaFields:  # type: ignore[no-redef]
        """What `multiwrite._cstaging.ArenaFields` holds as C fields, as plain attributes."""

        __slots__ = ("num_writes", "num_values", "meta_addr", "values_addr", "meta_cap", "values_cap", "uid",
                     "may_overlap")  # fmt: skip


def table_layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """`(data_ptr, shape, strides)` of a tensor: what a resize or `set_` in place changes."""
    return t.data_ptr(), tuple(t.shape), t.stride()


def layout_version(t: torch.Tensor) -> int:
    """`t._version` (bumped by every in-place op on `t`'s storage, `resize_` and `set_` included), or -1
    for inference tensors, which do not track it."""
    try:
        return t._version
    except RuntimeError:
        return -1


def device_unavailable_reason(device: torch.device) -> str | None:
    """Why torch cannot allocate on `device` at all (a CPU-only build asked for `"cuda"`, an index past
    the device count), or None. Checked before allocating, so that the error is
    `BackendUnavailableError` and not torch's own assertion."""
    module = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
    if module is None or not hasattr(module, "is_available"):
        return None
    if not module.is_available():
        return f"torch {torch.__version__} reports no {device.type} device on this machine"
    count = getattr(module, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        return f"{device} does not exist: torch reports {count()} {device.type} device(s)"
    return None


def check_device(device: torch.device | str, what: str) -> torch.device:
    """`torch.device(device)`, or `BackendUnavailableError` naming `what` when torch cannot allocate there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BackendUnavailableError(f"{what}: device {device!r} is not a torch device ({exc})") from None
    reason = device_unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"{what}: cannot place tables on {device}: {reason}")
    return device


def shape_text(shape: Sequence[int]) -> str:
    """`(4, 8)`, and `(5,)` for a 1-D shape."""
    return str(tuple(shape))


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.int32` -> `"int32"`."""
    return str(dtype).removeprefix("torch.")


def strict_index(x: Any) -> int:
    """`x` as a Python int for a row, start, size or count: anything `operator.index` takes but a bool
    (`True`, `numpy.bool_`, a one-element bool tensor or array), which would silently mean 1 or 0.

    Raises:
        TypeError: `x` is a bool or not an integer (callers turn it into their `StagedWriteError`).
    """
    if x.__class__ is int:
        return x
    if isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", None) in (torch.bool, np.bool_):
        raise TypeError(f"a bool ({x!r}), not an integer")
    return operator.index(x)


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise `StagedWriteError` unless `dtype` is one multiwrite can stage (int32, int64, float32)."""
    if dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise StagedWriteError(f"{what}: dtype={dtype} (supported: {allowed})")


class StagingBuffers:
    """Lends a `StagingArena` the arrays it stages into: memory a backend's kernels read in place.

    A GPU backend returns one from `Backend.staging_buffers` (pinned host memory that its kernel reads
    through unified virtual addressing), so an apply hands the staged writes over without a copy. The
    arena then asks for fresh arrays (`acquire`) before staging again; the lender must not return
    memory that a launched kernel may still read. The default, no lender, keeps plain numpy arrays.
    """

    def acquire(self, write_capacity: int, value_capacity: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Arrays nothing reads now: (meta int32 `[>= write_capacity, 5]`, values `[>= value_capacity]`,
        meta address, values address). Called after every apply that consumed the previous ones."""
        raise NotImplementedError

    def grow(self, write_capacity: int, value_capacity: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Larger arrays replacing the ones lent last (not yet applied), same tuple as `acquire`. The
        arena copies what it staged so far into them."""
        raise NotImplementedError

    def release(self) -> None:
        """The arena is being destroyed: memory lent to it may be freed once no kernel reads it."""


class StagingArena(_ArenaFields):
    """Staged writes of one or more tables of one dtype, in staging order, in growable numpy arrays.

    Values are appended in staging order with no gaps: write `w`'s value offset is the sum of the
    lengths of the writes before it (backends may rely on it; `drop_tables` keeps it so).

    `meta[:num_writes]` holds one int32 row per write with the `META_*` columns; `values[:num_values]`
    holds the staged values, each write's values contiguous. `may_overlap` turns true once two staged
    writes hit the same row of the same table (they may then touch the same cells, and backends must
    keep staging order there). `meta_flat` and `values_flat` are memoryviews of the same memory: a
    store through them costs a third of a numpy scalar store and checks the value's type and range.

    The counters (`num_writes`, `num_values`, `may_overlap`), the arrays' addresses and capacities
    (`meta_addr`, `values_addr`, `meta_cap`, `values_cap`) and `uid` are fields of the base class
    (`multiwrite._cstaging.ArenaFields` where the compiled paths are built), which those paths read and
    write directly; they must be assigned exact ints (bool for `may_overlap`).
    """

    __slots__ = (
        "np_dtype",
        "meta",
        "values",
        "meta_bytes",
        "values_flat",
        "targets",
        "rows_seen",
        "layout_version",
        "lender",
        "stamped",
        "runs",
        "frozen",
    )

    #: `pack_meta(meta_bytes, write_index * 20, table, row, start, length, value_offset)` stores one
    #: metadata row in one C call, raising `struct.error` when a field overflows int32.
    pack_meta = staticmethod(struct.Struct(f"{META_COLUMNS}i").pack_into)

    def __init__(self, np_dtype: type[np.generic], write_capacity: int = 64, value_capacity: int = 1024):
        self.np_dtype = np_dtype
        self.meta = np.zeros((write_capacity, META_COLUMNS), dtype=np.int32)
        self.values = np.zeros(value_capacity, dtype=np_dtype)
        self.meta_bytes = self.meta.data.cast("B")
        self.values_flat = self.values.data
        self.num_writes = 0
        self.num_values = 0
        self.targets: list[StagedWriteTensor] = []
        self.rows_seen: set[int] = set()  # row << 16 | table, for the writes staged now
        self.may_overlap = False
        self.layout_version = 0  # bumped whenever a table is added or replaced
        self.lender: StagingBuffers | None = None
        # True when an owner (BlockTables) tracks overlaps of its own writes outside `rows_seen`: any
        # other write into the arena is then assumed to overlap (correct, merely slower to apply).
        self.stamped = False
        self.uid = next(_arena_uids)  # this arena's name on the staging clock
        self.runs: list[tuple[int, int]] = []  # (clock, first write index) of each run staged now
        # Set by an owner whose tables must never be resized (BlockTables): (tensor, its `table_layout`,
        # what to call it) of each; checked by the writer at every apply that sees a layout change.
        self.frozen: list[tuple[torch.Tensor, tuple, str]] | None = None
        self.meta_addr = self.meta.ctypes.data
        self.values_addr = self.values.ctypes.data
        self.meta_cap, self.values_cap = write_capacity, value_capacity

    def add_target(self, target: StagedWriteTensor) -> int:
        """Register a table that stages here; returns its table index in this arena's metadata."""
        if len(self.targets) >= 1 << 16:
            raise StagedWriteError("a staging arena holds at most 65536 tables")
        self.targets.append(target)
        self.layout_version += 1
        return len(self.targets) - 1

    def reserve(self, writes: int, values: int) -> None:
        """Make room for `writes` more writes and `values` more values (geometric growth)."""
        w_cap, v_cap = self.meta.shape[0], self.values.shape[0]
        if self.num_writes + writes <= w_cap and self.num_values + values <= v_cap:
            return
        if self.num_writes + writes > w_cap:
            w_cap = max(self.num_writes + writes, 2 * w_cap)
        if self.num_values + values > v_cap:
            v_cap = max(self.num_values + values, 2 * v_cap)
        old_meta, old_values = self.meta, self.values
        if self.lender is None:
            meta = np.zeros((w_cap, META_COLUMNS), np.int32)
            vals = np.zeros(v_cap, dtype=self.np_dtype)
            self._use(meta, vals, meta.ctypes.data, vals.ctypes.data)
        else:
            self._use(*self.lender.grow(w_cap, v_cap))
        self.meta[: old_meta.shape[0]] = old_meta
        self.values[: old_values.shape[0]] = old_values  # uncommitted tail values too

    def _use(self, meta: np.ndarray, values: np.ndarray, meta_addr: int, values_addr: int) -> None:
        self.meta, self.values = meta, values
        self.meta_bytes = meta.data.cast("B")
        self.values_flat = values.data
        self.meta_addr, self.values_addr = meta_addr, values_addr
        self.meta_cap, self.values_cap = meta.shape[0], values.shape[0]

    def __del__(self) -> None:
        lender = getattr(self, "lender", None)
        if lender is not None:
            lender.release()

    def attach(self, lender: StagingBuffers) -> None:
        """Stage into `lender`'s arrays from now on (the arena must be empty)."""
        assert self.num_writes == 0, "attach a lender to an empty arena"
        self.lender = lender
        self.rotate()

    def rotate(self) -> None:
        """After an apply consumed every staged write: take fresh arrays from the lender (if any)."""
        lender = self.lender
        if lender is not None and not (_rotate_lent is not None and _rotate_lent(self, lender)):
            self._use(*lender.acquire(self.meta.shape[0], self.values.shape[0]))

    def push(self, table: int, row: int, start: int, values: Any, length: int) -> None:
        """Append one write whose row, start and length were validated. `values` is a list, tuple or
        numpy array; a value the dtype cannot hold raises (TypeError, ValueError or OverflowError) and
        then nothing is staged: the counters move only after every store succeeded.
        """
        self.reserve(1, length)
        v0 = self.num_values
        if length:
            if length <= 8 and not isinstance(values, np.ndarray):
                flat = self.values_flat
                for i, v in enumerate(values, v0):
                    flat[i] = v
            else:
                self.values[v0 : v0 + length] = values
        self.commit(table, row, start, length, v0)

    def begin_run(self) -> None:
        """The next write starts a run of this arena on the staging clock (another arena staged last)."""
        clock = _CLOCK[1] + 1
        _CLOCK[1] = clock
        _CLOCK[0] = self.uid
        self.runs.append((clock, self.num_writes))

    def commit(self, table: int, row: int, start: int, length: int, value_offset: int) -> None:
        """Record the metadata of a write whose values already sit at `values[value_offset:]`."""
        self.reserve(1, 0)
        if _CLOCK[0] != self.uid:
            self.begin_run()
        self.pack_meta(self.meta_bytes, self.num_writes * META_COLUMNS * 4, table, row, start, length, value_offset)
        key = row << 16 | table
        if key in self.rows_seen or self.stamped:
            self.may_overlap = True
        else:
            self.rows_seen.add(key)
        self.num_writes += 1
        self.num_values = value_offset + length

    def count_for(self, table: int) -> int:
        """Number of staged writes of one table."""
        if len(self.targets) == 1:
            return self.num_writes
        return int(np.count_nonzero(self.meta[: self.num_writes, META_TABLE] == table))

    def clear(self) -> None:
        """Drop every staged write of every table."""
        self.num_writes = 0
        self.num_values = 0
        self.may_overlap = False
        self.rows_seen.clear()
        self.runs.clear()
        if _CLOCK[0] == self.uid:  # the next write starts a run of its own
            _CLOCK[0] = 0

    def drop_tables(self, tables: Sequence[int]) -> None:
        """Drop the staged writes of some tables, keeping the others' in staging order."""
        if len(tables) == len(self.targets):
            self.clear()
            return
        meta = self.meta[: self.num_writes]
        keep = ~np.isin(meta[:, META_TABLE], np.asarray(tables, dtype=np.int32))
        kept = meta[keep]
        self.runs = remap_runs(self.runs, keep)
        if _CLOCK[0] == self.uid and not self.runs:
            _CLOCK[0] = 0
        lengths = kept[:, META_LENGTH].astype(np.int64)
        new_offsets = np.cumsum(lengths) - lengths
        gather = np.repeat(kept[:, META_VALUE_OFFSET].astype(np.int64) - new_offsets, lengths) + np.arange(
            int(lengths.sum())
        )
        self.values[: gather.size] = self.values[gather]
        kept[:, META_VALUE_OFFSET] = new_offsets
        self.meta[: kept.shape[0]] = kept
        self.num_writes = kept.shape[0]
        self.num_values = int(gather.size)
        keys = (kept[:, META_ROW].astype(np.int64) << 16) | kept[:, META_TABLE]
        self.rows_seen = set(keys.tolist())
        self.may_overlap = len(self.rows_seen) < kept.shape[0]


def remap_runs(runs: list[tuple[int, int]], keep: np.ndarray) -> list[tuple[int, int]]:
    """The runs `(clock, first write)` of an arena's writes after keeping only the writes where `keep`
    (bool `[num_writes]`) is true; runs left with no writes are dropped."""
    if not runs:
        return []
    before = np.concatenate(([0], np.cumsum(keep)))
    moved = [(clock, int(before[first])) for clock, first in runs]
    n = int(before[-1])  # a run left with no writes starts where the next one does, or at the end
    return [r for i, r in enumerate(moved) if r[1] < n and (i + 1 == len(moved) or moved[i + 1][1] != r[1])]


def _checked_values(values: Any, np_dtype: type[np.generic], describe: Any) -> tuple[Any, int]:
    """Validate staged values against the table dtype; return (something numpy assigns from, length).

    `describe(length)` builds the "which table, row, start, length, shape" part of an error message.
    """
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool:
            raise StagedWriteError(f"{describe(values.numel())}: values of dtype torch.bool: stage numbers, not bools")
        if values.device.type != "cpu":
            raise StagedWriteError(
                f"{describe(values.numel())}: values are on {values.device}; stage host values "
                "(a list, a numpy array or a CPU tensor)"
            )
        if values.dtype not in _TENSOR_VALUE_DTYPES:
            allowed = ", ".join(sorted(dtype_name(d) for d in _TENSOR_VALUE_DTYPES))
            raise StagedWriteError(f"{describe(values.numel())}: values of dtype {values.dtype} (supported: {allowed})")
        values = values.detach().numpy()
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise StagedWriteError(
            f"{describe(len(values))}: values must be numbers, got a {type(values).__name__} ({values!r:.40})"
        )
    if isinstance(values, (set, frozenset, dict)):
        raise StagedWriteError(
            f"{describe(len(values))}: values must be an ordered sequence, got a {type(values).__name__}"
        )
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise StagedWriteError(f"{describe(values.size)}: values must be 1-D, got shape {values.shape}")
        n = values.shape[0]
        kind = values.dtype.kind
        if kind == "b":
            raise StagedWriteError(f"{describe(n)}: values of dtype bool: stage numbers, not bools")
        if np_dtype is np.float32:
            if kind not in "biuf":
                raise StagedWriteError(f"{describe(n)}: values of dtype {values.dtype} into a float32 table")
            if kind == "f" and values.dtype.itemsize > 4 and n:
                _check_float32_range(values, describe)
            return values, n
        if kind not in "biu":
            raise StagedWriteError(
                f"{describe(n)}: values of dtype {values.dtype} cannot go into an integer table "
                f"({np.dtype(np_dtype).name})"
            )
        if n and not np.can_cast(values.dtype, np_dtype):
            lo, hi = _INT_LIMITS[np_dtype]
            vmin, vmax = int(values.min()), int(values.max())
            if vmin < lo or vmax > hi:
                bad = vmin if vmin < lo else vmax
                raise StagedWriteError(
                    f"{describe(n)}: value {bad} does not fit {np.dtype(np_dtype).name} [{lo}, {hi}]"
                )
        return values, n
    if not isinstance(values, (list, tuple)):
        if not isinstance(values, Iterable):
            raise StagedWriteError(f"{describe(1)}: values must be a sequence, got {type(values).__name__}")
        values = list(values)
    n = len(values)
    if not n:
        return values, 0
    if bool in map(type, values) or np.bool_ in map(type, values):
        raise StagedWriteError(f"{describe(n)}: a bool value: stage numbers, not bools")
    if np_dtype is np.float32:
        try:
            arr = np.asarray(values)
            if arr.dtype.kind == "O" and all(isinstance(v, numbers.Real) for v in values):
                arr = arr.astype(np.float64)  # Python ints past int64: as floats (or OverflowError)
            if arr.dtype.kind not in "iuf" or arr.ndim != 1:
                raise TypeError(f"got {', '.join(sorted({type(v).__name__ for v in values}))}")
            arr = arr.astype(np.float64, copy=False)
        except (TypeError, ValueError, OverflowError) as exc:
            raise StagedWriteError(f"{describe(n)}: values are not numbers ({exc})") from None
        _check_float32_range(arr, describe)
        return arr, n
    try:
        total = sum(values)
        lo_v = min(values)
        hi_v = max(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StagedWriteError(f"{describe(n)}: values are not integers ({exc})") from None
    if not isinstance(total, (int, np.integer)):
        raise StagedWriteError(
            f"{describe(n)}: a {type(total).__name__} value cannot go into an integer table ({np.dtype(np_dtype).name})"
        )
    lo, hi = _INT_LIMITS[np_dtype]
    if lo_v < lo or hi_v > hi:
        bad = lo_v if lo_v < lo else hi_v
        raise StagedWriteError(f"{describe(n)}: value {bad} does not fit {np.dtype(np_dtype).name} [{lo}, {hi}]")
    return values, n


def _check_float32_range(arr: np.ndarray, describe: Any) -> None:
    finite = arr[np.isfinite(arr)]
    if finite.size and float(np.abs(finite).max()) > _FLOAT32_MAX:
        raise StagedWriteError(f"{describe(arr.size)}: value {float(np.abs(finite).max())} overflows float32")


class StagedWriteTensor:
    """A 2-D device tensor whose row writes are staged on the host and applied in one batch.

    Args:
        size: `(rows, columns)` of the table, e.g. `(max_num_reqs, max_num_blocks)`; an int `n` makes a
            1-D tensor of `n` elements, staged as `n` rows of one column.
        dtype: `torch.int32` (block tables), `torch.int64` or `torch.float32`.
        device: where `.tensor` lives; writes are applied there by a `FusedStagedWriter`.
        name: how errors name this table (default `"table"`).
        kernel_blocks_per_block: `k`; each staged value `v` is written as the `k` values `v * k + j`,
            `j = 0..k-1` (a KV-cache group whose block size is `k` times the attention kernel's).

    `.tensor` starts zero-filled. Staging never touches it; only an apply does
    (`FusedStagedWriter.apply`, or `multiwrite.apply_writes` for the shared writer of the device).

    Not thread-safe: stage and apply from one thread at a time (staging is a hot path with no lock).

    Raises:
        StagedWriteError: unsupported dtype, a size that is not 1-D or 2-D, `kernel_blocks_per_block < 1`.
        BackendUnavailableError: torch cannot allocate on `device` (e.g. `"cuda"` on a CPU-only build);
            raised before allocating.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype = torch.int32,
        device: torch.device | str = "cpu",
        *,
        name: str = "table",
        kernel_blocks_per_block: int = 1,
    ):
        check_dtype(dtype, f"{name}")
        try:
            shape = (strict_index(size),) if not isinstance(size, Sequence) else tuple(map(strict_index, size))
        except TypeError:
            raise StagedWriteError(f"{name}: size must be integers (rows, columns) or n, got {size!r}") from None
        if len(shape) not in (1, 2) or min(shape) < 0 or max(shape) > _INT32_MAX:
            raise StagedWriteError(f"{name}: size must be (rows, columns) or n, each in [0, 2**31), got {size!r}")
        device = check_device(device, name)
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        self._init(tensor, name, kernel_blocks_per_block, StagingArena(SUPPORTED_DTYPES[dtype]))

    @classmethod
    def _attach(
        cls, tensor: torch.Tensor, name: str, kernel_blocks_per_block: int, arena: StagingArena
    ) -> StagedWriteTensor:
        """Wrap an existing 2-D tensor (or view) that stages into a shared arena."""
        self = cls.__new__(cls)
        self._init(tensor, name, kernel_blocks_per_block, arena)
        return self

    def _init(self, tensor: torch.Tensor, name: str, k: int, arena: StagingArena) -> None:
        try:
            k = operator.index(k)
        except TypeError:
            raise StagedWriteError(f"{name}: kernel_blocks_per_block must be an integer, got {k!r}") from None
        if k < 1:
            raise StagedWriteError(f"{name}: kernel_blocks_per_block must be >= 1, got {k}")
        if k > 1 and tensor.dtype.is_floating_point:
            raise StagedWriteError(
                f"{name}: kernel block expansion (kernel_blocks_per_block={k}) needs an integer table"
            )
        self.name = name
        self.kernel_blocks_per_block = int(k)
        self._user_tensor = tensor
        self._table = tensor if tensor.dim() == 2 else tensor.unsqueeze(1)
        self._rows, self._cols = self._table.shape
        self._np_dtype = SUPPORTED_DTYPES[tensor.dtype]
        self._fixed: str | None = None  # why `.tensor` cannot be replaced (set by BlockTables), or None
        self._arena = arena
        self._index = arena.add_target(self)

    # -- the table ---------------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The device tensor the writes land in, `[rows, columns]` (or `[n]` when built from an int).

        A standalone table may be replaced (`t.tensor = new`, e.g. after growing `max_num_reqs`) or
        resized in place (`t.tensor.resize_(...)`, `set_`): the new tensor must have the same dtype and
        number of dimensions, and every staged write must fit its shape; staging checks the shape
        installed now, and every apply re-checks the staged writes against it (shrunk or grown) before
        writing anything. Replacing raises `StagedWriteError` when that fails, keeping the old tensor.

        A group of a `BlockTables` cannot be replaced (`StagedWriteError`): its tables and `num_blocks`
        share one allocation. A resize or `set_` in place of one is refused at the next apply, before
        anything is written, with the staged writes kept.
        """
        return self._user_tensor

    @tensor.setter
    def tensor(self, new: torch.Tensor) -> None:
        # Replacing the table (for example after growing max_num_reqs) is allowed; writes already staged
        # must still fit, and the backends notice the new storage and never write through a stale pointer.
        if self._fixed is not None:
            raise StagedWriteError(f"{self.name} (shape {shape_text(self.shape)}): {self._fixed}")
        if not isinstance(new, torch.Tensor):
            raise StagedWriteError(f"{self.name}: replacement must be a torch.Tensor, got {type(new).__name__}")
        old = self._table
        if new.dtype != old.dtype or new.dim() != self._user_tensor.dim():
            raise StagedWriteError(
                f"{self.name}: replacement tensor must be {self._user_tensor.dim()}-D {dtype_name(old.dtype)}, "
                f"got {new.dim()}-D {dtype_name(new.dtype)}"
            )
        table = new if new.dim() == 2 else new.unsqueeze(1)
        if table.numel() and max(table.shape) > _INT32_MAX:
            raise StagedWriteError(f"{self.name}: replacement shape {shape_text(new.shape)} has a size past 2**31 - 1")
        self.check_staged_fit((table.shape[0], table.shape[1]))
        self._user_tensor, self._table = new, table
        self._rows, self._cols = table.shape
        self._arena.layout_version += 1  # writers re-check device and shape, backends see the new storage

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of `.tensor`."""
        return tuple(self._user_tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        """dtype of `.tensor`."""
        return self._table.dtype

    @property
    def device(self) -> torch.device:
        """Device of `.tensor`."""
        return self._table.device

    @property
    def num_staged_writes(self) -> int:
        """Writes staged for this table and not yet applied (empty writes count too)."""
        return self._arena.count_for(self._index)

    def _current_table(self) -> torch.Tensor:
        """The 2-D table as installed now. A 1-D tensor is staged through a `[n, 1]` view of it: after a
        `resize_` or `set_` of the 1-D tensor in place, that view is taken again."""
        table, user = self._table, self._user_tensor
        if table is not user and (
            table.shape[0] != user.shape[0] or table.data_ptr() != user.data_ptr() or table.stride(0) != user.stride(0)
        ):
            table = self._table = user.unsqueeze(1)
            self._arena.layout_version += 1
        return table

    def _describe(self, row: Any, start: Any, length: Any = None) -> str:
        """`name (shape (r, c), dtype): write at row R, start S[, length L]`: only values the user gave."""
        text = (
            f"{self.name} (shape {shape_text(self._user_tensor.shape)}, {dtype_name(self._table.dtype)}): "
            f"write at row {row!r}, start {start!r}"
        )
        return text if length is None else f"{text}, length {length}"

    # -- staging -----------------------------------------------------------------------------------
    def stage_write(self, index: int, start: int, values: Any) -> None:
        """Stage `tensor[index, start:start + len(values) * k] = values` (expanded when `k > 1`).

        Args:
            index: row, `0 <= index < rows`.
            start: first column, `>= 0`.
            values: a list, tuple, 1-D numpy array or 1-D CPU tensor; integers for integer tables.
                Empty values stage a no-op write.

        Raises:
            StagedWriteError: row outside the table, negative start, a write past the row's width, or a
                value the dtype cannot hold. Nothing is staged then.
        """
        if type(index) is not int or type(start) is not int:
            try:
                index, start = strict_index(index), strict_index(start)
            except TypeError as exc:
                raise StagedWriteError(
                    f"{self._describe(index, start)}: row and start must be integers ({exc})"
                ) from None
        # Short int lists are checked value by value by the memoryview stores (bools here); anything else
        # by _checked_values.
        fast = type(values) in (list, tuple) and len(values) <= 8 and self._np_dtype is not np.float32
        if fast:
            n = len(values)
            if bool in map(type, values):
                raise StagedWriteError(f"{self._describe(index, start, n)}: a bool value: stage numbers, not bools")
        else:
            values, n = _checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
        # The shape installed now (resized or set_ in place since: checked against the new one). The
        # writer re-checks every staged write against it at apply.
        table = self._table if self._table is self._user_tensor else self._current_table()
        rows, cols = table.shape
        if not 0 <= index < rows:
            raise StagedWriteError(f"{self._describe(index, start, n)}: row {index} is outside [0, {rows})")
        if start < 0:
            raise StagedWriteError(f"{self._describe(index, start, n)}: start is negative")
        k = self.kernel_blocks_per_block
        if start + n * k > cols:
            raise StagedWriteError(
                f"{self._describe(index, start, n)}: ends at column {start + n * k} past the row width {cols}"
                + (f" ({n} values x {k} kernel blocks each)" if k > 1 else "")
            )
        try:
            if k > 1 and n:
                if fast:  # check the values themselves first (type and range), then expand
                    values, _ = _checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
                _check_expanded_range(values, k, self._np_dtype, lambda: self._describe(index, start, n))
                values = expand_kernel_blocks(np.asarray(values, dtype=np.int64), k)
            self._arena.push(self._index, index, start, values, n * k)
        except (OverflowError, TypeError, ValueError) as exc:
            if isinstance(exc, StagedWriteError):
                raise
            # Stores through the memoryview check each value; say which one was wrong, then give up.
            _checked_values(values, self._np_dtype, lambda n: self._describe(index, start, n))
            raise StagedWriteError(f"{self._describe(index, start, n)}: {exc}") from None

    def stage_write_elem(self, index: int, value: int | float) -> None:
        """Stage one value at column 0 of row `index` (element `index` of a 1-D tensor).

        Raises:
            StagedWriteError: as `stage_write`.
        """
        self.stage_write(index, 0, (value,))

    def clear_staged_writes(self) -> None:
        """Drop this table's staged writes without applying them."""
        if self.num_staged_writes:
            self._arena.drop_tables([self._index])

    def check_staged_fit(self, shape: tuple[int, int]) -> None:
        """Raise `StagedWriteError` if a staged write of this table would not fit a `shape` table."""
        arena = self._arena
        meta = arena.meta[: arena.num_writes]
        mine = meta[meta[:, META_TABLE] == self._index]
        if not mine.shape[0]:
            return
        ends = mine[:, META_START].astype(np.int64) + mine[:, META_LENGTH]
        bad = np.nonzero((mine[:, META_ROW] >= shape[0]) | (ends > shape[1]))[0]
        if bad.size:
            row, start, length = (int(x) for x in mine[bad[0], [META_ROW, META_START, META_LENGTH]])
            raise StagedWriteError(
                f"{self._describe(row, start, length)}: staged before the table was resized, does not fit "
                f"shape {shape_text(shape if self._user_tensor.dim() == 2 else shape[:1])}; nothing was written "
                "and every staged write stays staged"
            )


def expand_kernel_blocks(ids: np.ndarray, k: int) -> np.ndarray:
    """Manager block ids `[n]` -> kernel block ids `[n * k]`: each `b` becomes `b*k, b*k+1, ..., b*k+k-1`."""
    return (ids[:, None] * k + np.arange(k, dtype=ids.dtype)).reshape(-1)


def _check_expanded_range(values: Any, k: int, np_dtype: type[np.generic], describe: Any) -> None:
    """Expanded ids `v * k + j` must fit the dtype too."""
    if np_dtype is np.float32:
        return
    lo, hi = _INT_LIMITS[np_dtype]
    # Python ints: a numpy scalar times k would wrap around in its own dtype and pass the check.
    vmin, vmax = (
        (int(values.min()), int(values.max()))
        if isinstance(values, np.ndarray)
        else (operator.index(min(values)), operator.index(max(values)))
    )
    if vmin * k < lo or vmax * k + k - 1 > hi:
        bad = vmin if vmin * k < lo else vmax
        raise StagedWriteError(
            f"{describe()}: value {bad} expanded to {k} kernel blocks ({bad * k}..{bad * k + k - 1}) "
            f"does not fit {np.dtype(np_dtype).name}"
        )
