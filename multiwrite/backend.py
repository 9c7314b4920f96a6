"""The `Backend` base class every backend plugin subclasses, the `WriteBatch` it receives, and the
column constants of `WriteBatch.meta` (`META_TABLE` ... `META_COLUMNS`). The written contract, priority
ranges included, is `docs/backends.md`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from multiwrite.staging import (
    META_COLUMNS,
    META_LENGTH,
    META_ROW,
    META_START,
    META_TABLE,
    META_VALUE_OFFSET,
    SUPPORTED_DTYPES,
    StagingArena,
    StagingBuffers,
    dtype_name,
)

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
    "WriteBatch",
]

#: Priority of `torch-generic`, the built-in fallback for every torch device type (the lowest).
PRIORITY_FALLBACK = -100
#: Priority of the built-in CPU backends: `torch-cpu` 0, `compiled-cpu` 10.
PRIORITY_BUILTIN_CPU = 0
#: Priority of the built-in GPU backends (`triton-cuda`, `triton-rocm`).
PRIORITY_BUILTIN_GPU = 100

if TYPE_CHECKING:
    from multiwrite.stage import StageInputs


class WriteBatch:
    """The staged writes of one dtype that one `FusedStagedWriter.apply` hands to a backend.

    Attributes:
        tables: the target tables, 2-D tensors (possibly strided views) on the writer's device. A 1-D
            `StagedWriteTensor` arrives as a `[n, 1]` view.
        meta: int32 `[num_writes, 5]`, one row per write in staging order, columns `META_TABLE`,
            `META_ROW`, `META_START`, `META_LENGTH` (values = cells written), `META_VALUE_OFFSET`.
        values: `[num_values]` numpy array of the tables' dtype; write `w` reads
            `values[offset:offset + length]`, as they are: kernel block ids were expanded when staged.
        may_overlap: false guarantees that no two writes touch the same row of the same table, so they
            can be applied in any order; when true, later writes must win where they overlap.
        values_in_order: true guarantees that each write's values start where the previous write's end
            (`META_VALUE_OFFSET` is the running sum of `META_LENGTH`, from 0), so `values` is every cell's
            value in staging order.
        buffers: the `StagingBuffers` that lent `meta` and `values` (from this backend's
            `staging_buffers`, or another's), or None for plain numpy arrays. A backend that recognizes
            its own lender may read them in place instead of copying; the arena takes fresh arrays from
            the lender after the apply.

    Every write was validated against its table's shape and dtype when staged. `meta` and `values`
    may be views of the staging buffers: they are valid only until `Backend.apply` returns.
    """

    __slots__ = ("tables", "meta", "values", "may_overlap", "values_in_order", "buffers")

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        meta: np.ndarray,
        values: np.ndarray,
        may_overlap: bool,
        values_in_order: bool = False,
        buffers: StagingBuffers | None = None,
    ):
        self.tables = tables
        self.meta = meta
        self.values = values
        self.may_overlap = may_overlap
        self.values_in_order = values_in_order
        self.buffers = buffers

    @property
    def dtype(self) -> torch.dtype:
        """dtype shared by every table of the batch."""
        return self.tables[0].dtype

    @property
    def num_writes(self) -> int:
        """Number of staged writes, empty ones included."""
        return int(self.meta.shape[0])

    def __repr__(self) -> str:
        return (
            f"WriteBatch({len(self.tables)} tables, {self.num_writes} writes, {self.values.shape[0]} values, "
            f"{dtype_name(self.dtype)}, may_overlap={self.may_overlap})"
        )


class Backend:
    """A way to apply staged writes on some devices. Subclass it and return an instance from the
    `multiwrite_backends` hook of a plugin registered in the `multiwrite` entry-point group.

    Class attributes:
        NAME: the name users force it by (`backend=` or `MULTIWRITE_BACKEND`), e.g. `"torch-cpu"`.
        PRIORITY: higher wins when several backends can run (ties: name, then distribution). Built-ins:
            -100 `torch-generic`, 0 `torch-cpu`, 10 `compiled-cpu`, 100 `triton-cuda`/`triton-rocm`.
            Third party: 50-90 for a device no built-in serves, above 100 to override a built-in;
            see `docs/backends.md`.
        SUPPORTED_DEVICE_TYPES: torch device types it can write to, e.g. `{"cuda"}`.
        SUPPORTED_DTYPES: table dtypes it can write.
    """

    NAME: ClassVar[str] = ""
    PRIORITY: ClassVar[int] = 0
    SUPPORTED_DEVICE_TYPES: ClassVar[frozenset[str]] = frozenset()
    SUPPORTED_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset(SUPPORTED_DTYPES)

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
        """Arrays for staging `np_dtype` values that this backend's kernels read in place on `device`, or
        None (the default) to stage into plain numpy arrays and consume them by copying."""
        return None

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """Apply every batch (one per dtype), each write in staging order where writes overlap.

        Called once per `FusedStagedWriter.apply`. GPU backends enqueue their work on the current stream
        and return without synchronizing; everything they read from `batches` must be consumed (copied or
        guarded) before returning.

        Failure contract: a backend that cannot finish raises any `Exception` (it need not undo what it
        wrote). The writer then raises `BackendError` naming this backend and the tables, with that
        exception as its `__cause__`, and drops nothing: every write of the call stays staged (a
        `BlockTables` keeps its host `num_blocks` as staged). Writes are assignments, so the next apply
        rewrites them all in staging order and the tables, and host and device `num_blocks`, end exactly
        as if the first apply had succeeded. A backend must therefore leave the `StagingBuffers` it lent
        usable after raising (the arena stages on into them), must not keep `batches` beyond the call,
        and must not raise after having left a table in a state a plain rewrite cannot fix. Exceptions
        that are not `Exception`s (`KeyboardInterrupt`, `SystemExit`) reach the caller as they are, the
        writes staged as well.

        Thread safety: different writers may call one backend instance from different threads at once
        (one per thread, each with its own tables); shared caches must stay correct under that.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.NAME!r}>"

    def graph_stage(self, tables: list[torch.Tensor], arena: StagingArena) -> Any:
        """Optional: the CUDA-graph mode of a `BlockTables` (`cuda_graphs=True`), or None (the default:
        this backend cannot replay its apply from a graph, and such tables are refused at construction).

        `tables` are the tables' 2-D int32 tensors in `arena`'s table order, fixed for good; `arena` is the
        empty staging arena of the `BlockTables`. The returned object must offer `commit(arena) -> int`
        (publish the staged writes for the next run; host work only), `launch(-1)` (what a capture records:
        consume the next published batch), `apply_eager()` (consume every committed batch now),
        `would_wait(arena)` (whether a commit would wait for a run) and `pending()`. Optionally, to let
        `prepare_inputs`, `gather_block_tables` and `compute_slot_mappings` be captured too:
        `bind_stage(layout)` (called once at construction, outside any capture, with a
        `multiwrite.stage.StageInputs` holding the layout fields) and `record_stage(stage, consume)` (launch, under
        a capture: record, the stage of `stage`, after `launch(-1)` if `consume`, keeping alive whatever the
        launches read by address); without them those captures raise `GraphCaptureError`. See
        `multiwrite/backends/triton_graph.py` for the built-in one and its ordering rules.
        """
        return None

    def prepare_inputs(self, batches: Sequence[WriteBatch], stage: StageInputs) -> None:
        """Optional: a step's whole block-table stage in one call (one launch on a GPU, if you can).

        `BlockTables.prepare_inputs` calls it exactly once per call, instead of `apply`, with the batches
        `apply` would have received (an empty list when nothing was staged); `BlockTables.gather_block_tables`
        and `compute_slot_mappings` call it with no batches and one job (`stage.do_gather`, `stage.do_slots`
        say which jobs are asked for). `stage` is a
        `multiwrite.stage.StageInputs`: the source tables, `num_blocks`, the persistent outputs
        (`input_block_tables`, `slot_mappings`), block and kernel block sizes, context-parallel settings,
        and the step's inputs (`idx_mapping`, `query_start_loc`, `positions`, `is_padding`, already checked
        and on the tables' device; `num_reqs`, `num_reqs_padded`, `num_tokens_padded`).

        Contract: afterwards the tables, `num_blocks`, `input_block_tables` and `slot_mappings` must hold
        exactly what `apply(batches)` followed by `multiwrite.stage.run_stage_torch(stage)` leaves there
        (gather and slot mappings read the tables as the apply left them; see `multiwrite/stage.py` and
        `multiwrite.reference` for the semantics). The same rules as `apply` hold: enqueue on the current
        stream, do not synchronize, consume `batches` before returning.

        The default does exactly that composition, so a backend that implements only `apply` stays correct.
        """
        from multiwrite.stage import run_stage_torch

        if batches:
            self.apply(batches)
        run_stage_torch(stage)
