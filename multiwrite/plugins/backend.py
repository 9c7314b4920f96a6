"""The plugin contract: the `Backend` base class every backend subclasses, the `WriteBatch` it applies (and the
columns of `WriteBatch.meta`, `META_TABLE` ... `META_COLUMNS`), the `DeviceWriteSet` it reads, and the plans that run
a `BlockTables`' jobs (`TablesPlan`, `GraphPlan`). The written contract, priority ranges included, is
docs/backends.md."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from multiwrite.errors import BackendError, StagedWriteError
from multiwrite.plugins.checked import broken, lender, shown
from multiwrite.stage.entry import StageLaunchSpec
from multiwrite.stage.torch_stage import run_stage_torch
from multiwrite.staging.arena import Lease, StagingArena, StagingBuffers
from multiwrite.staging.layout import (
    META_COLUMNS,
    META_LENGTH,
    META_ROW,
    META_START,
    META_TABLE,
    META_VALUE_OFFSET,
    SUPPORTED_DTYPES,
    dtype_name,
)

if TYPE_CHECKING:
    from multiwrite.stage.layout import TablesLayout
    from multiwrite.stage.step import StepInputs
    from multiwrite.staging.headers import HeaderRing

#: Priority of `torch-generic`, the built-in fallback for every torch device type (the lowest).
PRIORITY_FALLBACK = -100
#: Priority of the built-in CPU backends: `torch-cpu` 0, `compiled-cpu` 10.
PRIORITY_BUILTIN_CPU = 0
#: Priority of the built-in GPU backends (`triton-cuda`, `triton-rocm`).
PRIORITY_BUILTIN_GPU = 100


class WriteBatch:
    """The staged writes of one dtype that one apply hands to a backend.

    Attributes:
        tables: the target tables, 2-D tensors (possibly strided views, possibly over one storage) on the
            backend's device. A 1-D `StagedWriteTensor` arrives as a `[n, 1]` view.
        meta: int32 `[num_writes, 5]`, one row per write in staging order, columns `META_TABLE`, `META_ROW`,
            `META_START`, `META_LENGTH` (cells written), `META_VALUE_OFFSET`.
        values: `[num_values]` numpy array of the tables' dtype; write `w` sets
            `tables[t][row, start:start + length] = values[offset:offset + length]` (kernel block ids expanded).
        may_overlap: false guarantees that no two writes touch the same row of the same table; true: where writes
            overlap, the later one must win.
        values_in_order: true guarantees that `META_VALUE_OFFSET` is the running sum of `META_LENGTH` from 0.
        lease: the `Lease` whose arrays `meta` and `values` are (a staging arena's memory, read in place by a
            backend that lent it), or None for arrays of no lease.
        checked: true when every write was checked against its table's current shape by multiwrite (staged
            through a `StagedWriteTensor` or `BlockTables`); false for a batch built by hand, which a backend must
            check before writing anything (`check_bounds`).

    `meta` and `values` are valid only until `Backend.apply` returns.
    """

    __slots__ = ("tables", "meta", "values", "may_overlap", "values_in_order", "lease", "checked")

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        meta: np.ndarray,
        values: np.ndarray,
        may_overlap: bool,
        values_in_order: bool = False,
        lease: Lease | None = None,
        checked: bool = False,
    ):
        self.tables = tables
        self.meta = meta
        self.values = values
        self.may_overlap = may_overlap
        self.values_in_order = values_in_order
        self.lease = lease
        self.checked = checked

    @property
    def dtype(self) -> torch.dtype:
        """dtype shared by every table of the batch."""
        return self.tables[0].dtype

    @property
    def num_writes(self) -> int:
        """Number of writes, empty ones included."""
        return int(self.meta.shape[0])

    def check_bounds(self, backend: str) -> None:
        """Raise `StagedWriteError` naming the first non-empty write that lies outside its table's current shape or
        outside the values (or names no table); return quietly otherwise. Vectorized; every backend calls it for a
        batch that is not `checked`, before writing anything."""
        meta = self.meta
        if not meta.shape[0]:
            return
        shapes = np.asarray([(t.shape[0], t.shape[1]) for t in self.tables], dtype=np.int64).reshape(-1, 2)
        table = meta[:, META_TABLE].astype(np.int64)
        named = (table >= 0) & (table < shapes.shape[0])
        t = np.where(named, table, 0)
        row = meta[:, META_ROW].astype(np.int64)
        start = meta[:, META_START].astype(np.int64)
        length = meta[:, META_LENGTH].astype(np.int64)
        offset = meta[:, META_VALUE_OFFSET].astype(np.int64)
        inside = (row >= 0) & (row < shapes[t, 0]) & (start >= 0) & (start + length <= shapes[t, 1])
        inside &= (offset >= 0) & (offset + length <= self.values.shape[0])
        ok = named & ((length == 0) | ((length > 0) & inside))
        if ok.all():
            return
        w = int(np.argmin(ok))
        columns = [META_TABLE, META_ROW, META_START, META_LENGTH, META_VALUE_OFFSET]
        tab, r, s, n, off = (int(x) for x in meta[w, columns])
        if not named[w]:
            raise StagedWriteError(
                f"{backend}: write {w} (table {tab} of a batch of {len(self.tables)} tables, row {r}, start {s}, "
                f"length {n}) names no table of the batch; nothing was written"
            )
        shape = tuple(self.tables[tab].shape)
        raise StagedWriteError(
            f"{backend}: write {w} (table {tab}, row {r}, start {s}, length {n}) is outside its table (shape {shape}, "
            f"{dtype_name(self.tables[tab].dtype)}) or the values (offset {off} of {self.values.shape[0]}); nothing "
            "was written"
        )

    def __repr__(self) -> str:
        return (
            f"WriteBatch({len(self.tables)} tables, {self.num_writes} writes, {self.values.shape[0]} values, "
            f"{dtype_name(self.dtype)}, may_overlap={self.may_overlap})"
        )


class DeviceWriteSet(Protocol):
    """One set of device-sourced writes as `Backend.apply_device_writes` reads it: the part of
    `multiwrite.device_writes.DeviceWrites` (which builds and checks a set, and documents each field) that a backend
    may rely on. Write i puts `lengths[i]` values into `table[rows[i], starts[i] : starts[i] + lengths[i]]`.

    Attributes:
        rows, starts, lengths: `[n]` int32 or int64 tensors on the table's device; `num_writes` is `n`.
        kind: the source, one of `DEVICE_WRITE_SOURCES`: "values" (`values`, one flat tensor), "tensors" (`sources`,
            `n` 1-D tensors of `source_dtype`, whose `data_ptr()`s and sizes are `source_addresses` and
            `source_sizes`, int64 `[n]`) or "addresses" (`sources`, `[n]` device addresses of `source_dtype`).
        host_arrays: int64 host copies of rows, starts and lengths, or None; with them every write was checked.
        length_bound: the largest length the host knows of, or None.
    """

    @property
    def rows(self) -> torch.Tensor: ...

    @property
    def starts(self) -> torch.Tensor: ...

    @property
    def lengths(self) -> torch.Tensor: ...

    @property
    def num_writes(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def values(self) -> torch.Tensor | None: ...

    @property
    def sources(self) -> torch.Tensor | Sequence[torch.Tensor] | None: ...

    @property
    def source_dtype(self) -> torch.dtype | None: ...

    @property
    def source_addresses(self) -> np.ndarray | None: ...

    @property
    def source_sizes(self) -> np.ndarray | None: ...

    @property
    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None: ...

    @property
    def length_bound(self) -> int | None: ...


class Backend:
    """A way to apply staged writes on some devices. Subclass it and return an instance from the
    `multiwrite_backends` hook of a plugin registered in the `multiwrite` entry-point group.

    Class attributes:
        NAME: the name users force it by (`backend=` or `MULTIWRITE_BACKEND`), e.g. `"torch-cpu"`.
        PRIORITY: higher wins when several backends can run (ties: name, then distribution). Built-ins:
            -100 `torch-generic`, 0 `torch-cpu`, 10 `compiled-cpu`, 100 `triton-cuda`/`triton-rocm`.
            Third party: 50-90 for a device no built-in serves, above 100 to override a built-in.
        SUPPORTED_DEVICE_TYPES: torch device types it can write to, e.g. `{"cuda"}`.
        SUPPORTED_DTYPES: table dtypes it can write.

    Required: `apply`. Optional capabilities, each with a default that is correct for any backend: `priority`,
    `not_supported_reasons` (call `super()`), `staging_buffers` (memory the kernels read in place), `plan` (how a
    `BlockTables` runs its jobs: the default applies through `apply` and gathers with torch ops), `graph_plan`
    (graph mode: the default, None, has none), `apply_device_writes` with `DEVICE_WRITE_SOURCES` (device-sourced
    writes, `multiwrite.device_writes`: the default declares none).
    """

    NAME: ClassVar[str] = ""
    PRIORITY: ClassVar[int] = 0
    SUPPORTED_DEVICE_TYPES: ClassVar[frozenset[str]] = frozenset()
    SUPPORTED_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset(SUPPORTED_DTYPES)
    #: The source kinds `apply_device_writes` reads (`DEVICE_WRITE_KINDS`): "values" (one flat tensor), "tensors"
    #: (per-row tensors given in Python), "addresses" (per-row device addresses only). Empty: no device writes.
    DEVICE_WRITE_SOURCES: ClassVar[frozenset[str]] = frozenset()

    def priority(self, device: torch.device) -> int:
        """Priority of this backend for `device`; `PRIORITY` unless a subclass knows better."""
        return self.PRIORITY

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """Why this backend cannot apply writes to tables of `dtypes` on `device`; empty if it can.

        The base class checks the device type and dtypes; subclasses call `super()` and append their own
        reasons. Each reason names the value found and what would be accepted.
        """
        reasons = []
        if device.type not in self.SUPPORTED_DEVICE_TYPES:
            allowed = ", ".join(sorted(self.SUPPORTED_DEVICE_TYPES))
            reasons.append(f"device type {device.type} (supported: {allowed})")
        for dtype in dtypes:
            if dtype not in self.SUPPORTED_DTYPES:
                allowed = ", ".join(sorted(dtype_name(d) for d in self.SUPPORTED_DTYPES))
                reasons.append(f"dtype={dtype_name(dtype)} (supported: {allowed})")
        return reasons

    def staging_buffers(self, device: torch.device, np_dtype: type[np.generic]) -> StagingBuffers | None:
        """Memory for staging `np_dtype` values that this backend's kernels read in place on `device`, or None (the
        default: stage into plain numpy arrays, which `apply` consumes by copying)."""
        return None

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Apply every batch (one per dtype), each write in staging order where writes overlap.

        GPU backends enqueue their work on the current stream and return without synchronizing; everything they
        read from `batches` must be consumed (copied, or guarded until read) before returning. A batch whose
        `lease` this backend lent may be read in place: the caller lands its arena on a fresh lease afterwards.

        Failure: raise any `Exception` (having written part of the batches is allowed, leaving a table in a state
        a plain rewrite cannot fix is not). The caller raises `BackendError` with it as the cause and drops
        nothing: every write stays staged, and the next apply rewrites them all in staging order. Leave lent
        memory usable after raising, keep nothing of `batches` beyond the call. A batch that is not `checked`
        must be checked first (`WriteBatch.check_bounds`).

        Threads: different callers may call one backend instance from different threads at once, each with its
        own tables; shared caches must stay correct under that.
        """
        raise NotImplementedError

    def plan(self, layout: TablesLayout, arena: StagingArena) -> TablesPlan:
        """How a `BlockTables` with this memory `layout` runs its jobs (apply, gather, slot mappings); built once
        per `BlockTables`, which stages into `arena` (empty; the plan may attach a lender to it). The default,
        `TablesPlan`, applies through `apply` and runs gather and slot mappings with torch
        ops; override to do better (the Triton backends run the whole stage in one launch)."""
        return TablesPlan(self, layout, arena)

    def graph_plan(self, layout: TablesLayout, arena: StagingArena) -> GraphPlan | None:
        """The plan of a `BlockTables(..., cuda_graphs=True)`: a `GraphPlan`, whose launches can be captured in a
        CUDA graph and replayed (docs/graph-mode.md), or None (the default: no graph mode; such tables are refused
        at construction)."""
        return None

    def apply_device_writes(
        self, table: torch.Tensor, writes: Sequence[DeviceWriteSet], *, ordered: bool, faults: torch.Tensor | None
    ) -> None:
        """Apply device-sourced writes (`DeviceWriteSet`s: `multiwrite.device_writes.DeviceWrites`, every kind of
        source in `DEVICE_WRITE_SOURCES`) to the 2-D `table`, on the current stream, without a host synchronization
        where the backend can (docs/device-writes.md).

        The caller has checked the structure of every set and, for sets with host copies, every write. `ordered`:
        writes may overlap, and sets in order, writes in index order, the later must win; false guarantees that no
        two writes touch one cell. A write that is bad on the device (row outside the table, start < 0, length < 0,
        past its row, past its values) is skipped whole, never clipped, and counted into `faults` (int64 [8] on the
        table's device, `DeviceWriteFaults` layout) when given. The default declares no support.
        """
        raise NotImplementedError(f"backend {self.NAME!r} does not apply device-sourced writes")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.NAME!r}>"


def backend_error(
    backend: Backend, device: torch.device, names: Iterable[str], writes: int, exc: Exception, left: str | None = None
) -> BackendError:
    """The `BackendError` of a failed backend call applying `writes` staged writes to the tables `names` on `device`:
    names the backend (name and class), the tables (each once) and `exc`, and says what is left to apply: `left`,
    by default that every staged write is still staged. The caller raises it `from exc`."""
    names = tuple(dict.fromkeys(names))
    left = left or "every staged write is still staged, and applying again lands them all"
    return BackendError(
        f"backend {backend.NAME!r} ({type(backend).__module__}.{type(backend).__qualname__}) failed applying {writes} "
        f"staged writes to {', '.join(names)} on {device}: {type(exc).__name__}: {exc}. The tables may hold part "
        f"of the writes; {left}",
        backend,
        names,
    )


def plan_of(backend: Backend, layout: TablesLayout, arena: StagingArena) -> TablesPlan:
    """`backend.plan(layout, arena)`, checked to be a `TablesPlan` (`multiwrite.plugins.checked`).

    Raises:
        BackendContractError: it returned anything else; the backend is set aside (what it raises propagates).
    """
    value = backend.plan(layout, arena)
    if not isinstance(value, TablesPlan):
        raise broken(backend, f"plan() returned {shown(value)}, not a TablesPlan")
    return value


def graph_plan_of(backend: Backend, layout: TablesLayout, arena: StagingArena) -> GraphPlan | None:
    """`backend.graph_plan(layout, arena)`, checked to be a `GraphPlan` or None (no graph mode).

    Raises:
        BackendContractError: it returned anything else; the backend is set aside (what it raises propagates).
    """
    value = backend.graph_plan(layout, arena)
    if value is not None and not isinstance(value, GraphPlan):
        raise broken(backend, f"graph_plan() returned {shown(value)}, not a GraphPlan or None")
    return value


def remember(cache: dict, key: Any, value: Any, limit: int, lock: threading.Lock) -> None:
    """Store `value` under `key` in `cache`, a backend's per-layout cache (plans, descriptors): a dict read without a
    lock (one lookup is atomic) and filled under `lock`, where the oldest entries go first so that at most `limit`
    remain."""
    with lock:
        while len(cache) >= limit:
            del cache[next(iter(cache))]
        cache[key] = value


class TablesPlan:
    """The jobs of one `BlockTables` on one backend, for its fixed memory `layout` and the staging `arena` all its
    groups stage into (the tables of the arena, in `META_TABLE` order, are `layout.tables` then
    `layout.counts_table`).

    The default applies through `Backend.apply` and runs the gather and slot mappings with torch ops
    (`multiwrite.stage.torch_stage`). A backend overrides what it does better; the contract of each job:

    - `apply()`: land the arena's staged writes (it holds some) on the tables, then `arena.land(lease)` with the
      lease to stage into next. Raise, having landed nothing, on failure: the caller raises `BackendError` and
      every write stays staged.
    - `stage(step)`: the jobs `step` asks for (`do_gather`, `do_slots`), reading the tables as they are.
    - `prepare(step)`: `apply()` if anything is staged, then `stage(step)`: the whole step (one launch, if you can).
    - `refresh()`: rewrite what the plan keeps on the device about addresses (descriptors); default: nothing.

    GPU plans enqueue on the current stream and never synchronize. The `BlockTables` checks every input, refuses
    calls during a CUDA graph capture (unless in graph mode), and calls one job at a time.

    Attributes:
        backend, layout, arena: as given.
        tables: the arena's tables, in `META_TABLE` order.
    """

    def __init__(self, backend: Backend, layout: TablesLayout, arena: StagingArena):
        self.backend = backend
        self.layout = layout
        self.arena = arena
        self.tables = [*layout.tables, layout.counts_table]
        lent = lender(backend, layout.device, np.int32)
        if lent is not None:
            arena.attach(lent)

    def batch(self) -> WriteBatch:
        """The arena's staged writes as the `WriteBatch` `Backend.apply` receives (checked, read in place)."""
        a = self.arena
        return WriteBatch(self.tables, a.meta[: a.num_writes], a.values[: a.num_values], a.may_overlap, True, a.lease,
                          True)  # fmt: skip

    def apply(self) -> None:
        """`Backend.apply` of the staged batch, landing the arena on its next lease afterwards."""
        self.arena.land_after(self._apply_batch)

    def _apply_batch(self, lease: Lease) -> None:
        self.backend.apply([self.batch()])

    def stage(self, step: StepInputs) -> None:
        """The gather and/or slot mappings with torch ops."""
        run_stage_torch(self.layout, step)

    def prepare(self, step: StepInputs) -> None:
        """The whole step: `apply()` (when anything is staged), then `stage(step)`."""
        if self.arena.num_writes:
            self.apply()
        self.stage(step)

    def refresh(self) -> None:
        """Rewrite whatever this plan keeps on the device about the layout's addresses (`BlockTables.refresh_layout`:
        the memory it lives in may have been discarded and restored); the default keeps nothing there."""

    def stage_launch_spec(self) -> StageLaunchSpec | None:
        """Optional: what the compiled entry of eager stage calls needs to launch this plan's stage kernel itself
        (`multiwrite.stage.entry`: the Triton backends' stage kernel and argument order); None (the default): every
        stage call runs `stage(step)` through the one Python path."""
        return None


class GraphPlan(TablesPlan):
    """A `TablesPlan` whose launches can be captured into a CUDA graph (graph mode, docs/graph-mode.md).

    Graph mode publishes every batch into a `HeaderRing` (the arena's lender must lend memory the kernels read in
    place, guarded by completion tokens) and applies it by `consume`. A subclass implements:

    - `consume(ring, limit)`: launch the consume kernel on the current stream. `limit = -1` (what a capture records):
      apply, in order, every header not yet applied up to the header of ticket `runs` (the replay's own) if that
      ticket is published, else nothing (counted as missed); count the run. `limit >= 0`: apply every header below
      `limit`; fewer runs than `ring.tickets_published` at the launch are counted as extra tickets, and the runs set
      to it (the words of `multiwrite/staging/headers.py`).
    - `record_stage(ring, step, consume)`: launch `consume(ring, -1)` first if `consume`, then the stage of `step`
      (gather and/or slot mappings) reading its inputs by address; return what must stay alive for the replays.

    Attributes:
        header_depth: entries of the header ring (a power of two, >= 2).
    """

    header_depth: int = 8

    @classmethod
    def missing_jobs(cls) -> list[str]:
        """The jobs (`consume`, `record_stage`) this class does not implement: graph mode is refused with any."""
        return [name for name in ("consume", "record_stage") if getattr(cls, name) is getattr(GraphPlan, name)]

    def consume(self, ring: HeaderRing, limit: int) -> None:
        """Launch (or, capturing, record) the consume kernel; see the class docstring."""
        raise NotImplementedError

    def record_stage(self, ring: HeaderRing, step: StepInputs, consume: bool) -> Any:
        """Launch (or record) the consume kernel if `consume`, then `step`'s stage; see the class docstring."""
        raise NotImplementedError


__all__ = [
    "META_COLUMNS",
    "META_LENGTH",
    "META_ROW",
    "META_START",
    "META_TABLE",
    "META_VALUE_OFFSET",
    "PRIORITY_BUILTIN_CPU",
    "PRIORITY_BUILTIN_GPU",
    "PRIORITY_FALLBACK",
    "Backend",
    "GraphPlan",
    "TablesPlan",
    "WriteBatch",
    "backend_error",
]
