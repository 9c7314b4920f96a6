"""`BlockTables`: one block table per KV-cache group, updated for all groups in one apply."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from multiwrite import stage as _stage
from multiwrite import stage_graph as _stage_graph
from multiwrite.backend import Backend
from multiwrite.capture import is_capturing, refuse_capture
from multiwrite.errors import BackendUnavailableError, StagedWriteError
from multiwrite.staging import (
    _CLOCK,
    _INT32_MAX,
    META_COLUMNS,
    StagedWriteTensor,
    StagingArena,
    _checked_values,
    check_device,
    expand_kernel_blocks,
    strict_index,
    table_layout,
)
from multiwrite.writer import FusedStagedWriter, _check_frozen

try:  # the compiled staging paths (optional: built where a C compiler exists)
    from multiwrite._cstaging import Stager as _stage_block_ids
    from multiwrite._cstaging import commit_graph as _commit_graph
except ImportError:  # pragma: no cover - depends on the install
    _stage_block_ids = None
    _commit_graph = None

_META_BYTES = META_COLUMNS * 4  # one int32 metadata row
# Slots of the compiled path's int64 context, as the CTX_* enum of multiwrite/_cstaging.c.
(_CTX_NUM_BLOCKS, _CTX_MAX_REQS, _CTX_GROUPS, _CTX_COUNTS_TABLE, _CTX_STAMPS, _CTX_EPOCH, _CTX_NUM_BLOCKS_APPLIED,
 _CTX_GROUP0) = range(8)  # fmt: skip
_FIXED = (
    "a BlockTables' tables cannot be replaced or resized: every group's table and num_blocks share one "
    "allocation; build a new BlockTables with the new sizes"
)



def _batch_failure(error: BaseException, index: int, calls: int, req_index: object) -> BaseException:
    """The error to raise when call `index` of an `append_block_ids_batch` of `calls` calls raised `error`: the
    same type with a message that says which call failed and what stays staged (its cause is `error`); `error`
    itself when its type cannot be built from a message."""
    if not isinstance(error, (ValueError, TypeError, OverflowError)):
        return error
    try:
        failure = type(error)(
            f"append_block_ids_batch: call {index} of {calls} (request row {req_index!r:.40}) failed; the {index} "
            f"calls before it stay staged, it and the calls after it were not staged: {error}"
        )
    except Exception:
        return error
    failure.__cause__ = error
    return failure


def _overwrite_flag(req_index: object, overwrite: object) -> bool:
    """`overwrite` as a Python bool when it is a `numpy.bool_`; anything else but a bool is refused (a
    truthy string like "no" would overwrite, None would append)."""
    if isinstance(overwrite, np.bool_):
        return bool(overwrite)
    raise StagedWriteError(
        f"append_block_ids: request row {req_index!r}: overwrite must be a bool (True: a new request from column "
        f"0, False: append after the row's blocks), got {overwrite!r} ({type(overwrite).__name__})"
    )

class BlockTables:
    """The block tables of every KV-cache group of a model, staged on the host, applied in one call.

    Args:
        block_sizes: tokens per KV-cache block, one per group (e.g. `[16, 32, 8]`).
        max_num_reqs: rows of every table (request slots).
        max_num_blocks_per_group: manager blocks a request may hold, per group.
        device: where the tables live.
        kernel_block_sizes: the attention kernel's block size per group (default: `block_sizes`). Group
            `g` expands each block id `b` into the `k = block_sizes[g] // kernel_block_sizes[g]` kernel
            block ids `b*k .. b*k+k-1`.
        backend: force a backend by name or instance (default: the best available for `device`).
        max_num_batched_tokens: tokens a step may schedule: the width of `slot_mappings` (keyword only;
            without it `compute_slot_mappings` and `prepare_inputs` are refused).
        cp_size, cp_rank, cp_interleave: decode context parallelism as vLLM's: `cp_size` ranks, this one
            `cp_rank`, the sequence dealt to them in chunks of `cp_interleave` tokens, which must divide
            every block size when `cp_size > 1` (keyword only; default: no context parallelism).
        cuda_graphs: graph mode (keyword only, default False): `apply_staged_writes()` may then be called
            inside `torch.cuda.graph(...)`, recording one kernel launch whose arguments are all fixed
            addresses; each replay applies the batch closed by one `commit_staged_writes()` (see that
            method and "CUDA graphs" in the README). `prepare_inputs`, `gather_block_tables` and
            `compute_slot_mappings` may be captured too: `prepare_inputs` records that launch plus ONE launch
            of the gather + slot-mapping kernel, the other two one such launch each. Fixed at capture: the
            addresses of the tensors passed, `num_reqs = len(idx_mapping)`, `num_reqs_padded`,
            `num_tokens_padded`, the length of `positions`, whether `is_padding` is given; read at replay: the
            values of `idx_mapping`,
            `query_start_loc` (with `query_start_loc[num_reqs]`), `positions`, `is_padding` (see
            `multiwrite/stage_graph.py`). Needs a backend with a graph mode (`triton-cuda`, `triton-rocm`).
            Without it, every such capture is refused (`GraphCaptureError`).

    Attributes:
        block_tables: one `StagedWriteTensor` per group; `block_tables[g].tensor` is group `g`'s int32
            table `[max_num_reqs, max_num_blocks_per_group[g] * k_g]` of kernel block ids.
        num_blocks: host int32 numpy array `[num_groups, max_num_reqs]`: kernel blocks held per request
            and group, updated at staging time.
        num_blocks_device: int32 tensor `[num_groups, max_num_reqs]` on `device`: `num_blocks` as of the
            last `apply_staged_writes()`: each `append_block_ids` stages the request's new counts as one
            more write, applied by the same backend call (the same kernel launch on a GPU).
        input_block_tables: per group a persistent int32 `[max_num_reqs, width_g]` tensor on `device`, the
            target of `gather_block_tables` (its address never changes).
        slot_mappings: persistent int64 `[num_groups, max_num_batched_tokens]` on `device`, the target of
            `compute_slot_mappings`; None without `max_num_batched_tokens`.
        max_num_batched_tokens, cp_size, cp_rank, cp_interleave: the constructor's values.

    The rest of a step's block-table stage (`input_block_tables`, `slot_mappings`, `gather_block_tables`,
    `compute_slot_mappings`, `prepare_inputs`) is documented on those methods and in `multiwrite/stage.py`.

    `block_tables[g]` gives group `g`'s table; staging or clearing through it directly bypasses the
    `num_blocks` bookkeeping, so use `append_block_ids` and `clear_staged_writes` here.

    The tables cannot be resized: every group's table and `num_blocks_device` are views of one
    allocation. Replacing `block_tables[g].tensor` raises `StagedWriteError`; a `resize_` or `set_` in
    place of one of them is refused at the next apply (`StagedWriteError`, before anything is written,
    the staged writes kept). To grow, build a new `BlockTables`.

    Not thread-safe: one thread at a time per object; distinct objects may be used from distinct threads
    at once (see the README).

    Raises:
        StagedWriteError: list lengths that differ from the number of groups, a block size not divisible
            by its kernel block size, sizes that are not positive integers, a row width or row count of
            2**31 or more (rows, starts and lengths travel as int32).
        BackendUnavailableError: torch cannot allocate on `device`, or no backend can run there (the
            forced one cannot); raised before allocating.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        backend: str | Backend | None = None,
        *,
        max_num_batched_tokens: int | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        cuda_graphs: bool = False,
    ):
        def ints(what: str, seq: Sequence[int]) -> list[int]:
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
                raise StagedWriteError(f"BlockTables: {what} must be a sequence of integers, got {seq!r}")
            try:
                values = [strict_index(x) for x in seq]
            except TypeError:
                raise StagedWriteError(f"BlockTables: {what} must be integers, got {seq!r}") from None
            if any(x < 1 for x in values):
                raise StagedWriteError(f"BlockTables: {what} must be >= 1, got {values}")
            return values

        num_groups = len(block_sizes)
        if num_groups == 0:
            raise StagedWriteError("BlockTables: at least one KV-cache group is needed")
        self.block_sizes = ints("block_sizes", block_sizes)
        self.kernel_block_sizes = ints(
            "kernel_block_sizes", block_sizes if kernel_block_sizes is None else kernel_block_sizes
        )
        self.max_num_blocks_per_group = ints("max_num_blocks_per_group", max_num_blocks_per_group)
        try:
            self.max_num_reqs = strict_index(max_num_reqs)
        except TypeError:
            raise StagedWriteError(f"BlockTables: max_num_reqs must be an integer, got {max_num_reqs!r}") from None
        if self.max_num_reqs < 1:
            raise StagedWriteError(f"BlockTables: max_num_reqs must be >= 1, got {self.max_num_reqs}")
        for what, seq in (
            ("max_num_blocks_per_group", self.max_num_blocks_per_group),
            ("kernel_block_sizes", self.kernel_block_sizes),
        ):
            if len(seq) != num_groups:
                raise StagedWriteError(f"BlockTables: {what} has {len(seq)} entries for {num_groups} KV-cache groups")
        self.kernel_blocks_per_block: list[int] = []
        for g, (bs, kbs) in enumerate(zip(self.block_sizes, self.kernel_block_sizes)):
            if bs % kbs:
                raise StagedWriteError(
                    f"BlockTables: group {g} block size {bs} is not a positive multiple of its kernel block size {kbs}"
                )
            self.kernel_blocks_per_block.append(bs // kbs)
        widths = [m * k for m, k in zip(self.max_num_blocks_per_group, self.kernel_blocks_per_block)]
        R = self.max_num_reqs
        for g, w in enumerate(widths):
            if w > _INT32_MAX:
                raise StagedWriteError(
                    f"BlockTables: group {g} row width {self.max_num_blocks_per_group[g]} blocks x "
                    f"{self.kernel_blocks_per_block[g]} kernel blocks = {w} is past 2**31 - 1"
                )
        if R > _INT32_MAX:
            raise StagedWriteError(f"BlockTables: max_num_reqs {R} is past 2**31 - 1")
        # The device and the backend first: a device torch cannot use (or no backend for it) raises
        # BackendUnavailableError before anything is allocated.
        device = check_device(device, "BlockTables")
        self._writer = FusedStagedWriter(device, backend)
        # One allocation holds every table and num_blocks, so a CPU backend scatters into all of them at once.
        storage = torch.zeros(R * sum(widths) + num_groups * R, dtype=torch.int32, device=device)
        offsets = np.cumsum([0, *(R * w for w in widths)]).tolist()
        self._arena = StagingArena(np.int32)
        self.block_tables = [
            StagedWriteTensor._attach(storage[offsets[g] : offsets[g + 1]].view(R, w), f"group {g}", k, self._arena)
            for g, (w, k) in enumerate(zip(widths, self.kernel_blocks_per_block))
        ]
        self.num_blocks = np.zeros((num_groups, R), dtype=np.int32)
        self.num_blocks_device = storage[offsets[-1] :].view(num_groups, R)
        # Each append_block_ids stages one more write: the request's new counts, as row `req` of
        # num_blocks' transposed [max_num_reqs, num_groups] view, applied by the same backend call.
        self._num_blocks_staged = StagedWriteTensor._attach(self.num_blocks_device.t(), "num_blocks", 1, self._arena)
        self._num_blocks_view = self.num_blocks.data
        self._all = [*self.block_tables, self._num_blocks_staged]
        for t in self._all:
            t._fixed = _FIXED
        self._arena.frozen = [
            (t, table_layout(t), f"{what} of a BlockTables")
            for t, what in [(g.tensor, g.name) for g in self.block_tables]
            + [(self._num_blocks_staged._table, "num_blocks"), (self.num_blocks_device, "num_blocks")]
        ]
        self.cuda_graphs = bool(cuda_graphs)
        self._graph = None
        # The direct path of an eager prepare_inputs (`_bind_direct`): None until bound, False where there is none.
        self._direct: Callable | bool | None = None
        if self.cuda_graphs:
            self._graph = self.backend.graph_stage([t._table for t in self._arena.targets], self._arena)
            if self._graph is None:
                raise BackendUnavailableError(
                    f"BlockTables(cuda_graphs=True): backend {self.backend.NAME!r} on {device} has no CUDA-graph "
                    "mode (Backend.graph_stage); triton-cuda and triton-rocm have one. Use cuda_graphs=False"
                )
            # Graph mode replaces the two methods on this object only: the eager path pays nothing for it.
            self.apply_staged_writes = self._apply_graph_mode  # type: ignore[method-assign]
            self.clear_staged_writes = self._clear_graph_mode  # type: ignore[method-assign]
            self.prepare_inputs = self._prepare_inputs_graph_mode  # type: ignore[method-assign]
            self.gather_block_tables = self._gather_graph_mode  # type: ignore[method-assign]
            self.compute_slot_mappings = self._slot_mappings_graph_mode  # type: ignore[method-assign]
        # What clear_staged_writes restores, with no read of num_blocks_device (a stream may still be
        # writing it): column `req` holds the request's counts as of the last successful apply, saved when
        # the batch first changes them (the row's num_blocks stamp is then this batch's epoch). Nothing to
        # copy at apply time.
        self._num_blocks_applied = self.num_blocks.copy()
        self._widths = widths
        # Per group: k, row width, largest manager id whose kernel ids b*k + k - 1 fit int32.
        self._groups = [(k, w, (2**31 - 1 - (k - 1)) // k) for k, w in zip(self.kernel_blocks_per_block, widths)]
        # Overlap detection: per (table, row) the epoch of the batch that last staged a write there; a
        # batch's epoch ends when it is applied or cleared, so no stamp ever needs clearing.
        self._stamps = np.zeros((num_groups + 1, self.max_num_reqs), dtype=np.int64)
        self._stamps_view = self._stamps.data.cast("B").cast("q")
        self._arena.stamped = True
        self._counts_table = num_groups  # the num_blocks view's table index in the arena
        # The int64 context of the compiled path (layout: the CTX_* enum of multiwrite/_cstaging.c).
        ctx = self._context = np.zeros(_CTX_GROUP0 + 3 * num_groups, dtype=np.int64)
        ctx[_CTX_NUM_BLOCKS] = self.num_blocks.ctypes.data
        ctx[_CTX_MAX_REQS] = self.max_num_reqs
        ctx[_CTX_GROUPS] = num_groups
        ctx[_CTX_COUNTS_TABLE] = self._counts_table
        ctx[_CTX_STAMPS] = self._stamps.ctypes.data
        ctx[_CTX_EPOCH] = 1
        ctx[_CTX_NUM_BLOCKS_APPLIED] = self._num_blocks_applied.ctypes.data
        ctx[_CTX_GROUP0:] = np.asarray(self._groups, dtype=np.int64).reshape(-1)  # per group: k, width, max id
        self._context_view = ctx.data  # int64 stores without numpy scalar overhead
        # The compiled paths, on this object only, where built and not overridden by a subclass:
        # `append_block_ids` becomes a C callable (anything it does not take goes to the method below), and
        # graph mode's commit takes `_cstaging.commit_graph` in its common case.
        if _stage_block_ids is not None and type(self).append_block_ids is BlockTables.append_block_ids:
            methods = (BlockTables.append_block_ids, BlockTables.append_block_ids_batch)
            stager = _stage_block_ids(self, self._arena, ctx, ctx.ctypes.data, *methods)
            self.append_block_ids = stager  # type: ignore[method-assign]
            if type(self).append_block_ids_batch is BlockTables.append_block_ids_batch:
                self.append_block_ids_batch = stager.batch  # type: ignore[method-assign]
        self._fast_commit = _commit_graph if getattr(self._graph, "C_COMMIT", False) else None
        self._epoch_addr = ctx.ctypes.data + 8 * _CTX_EPOCH
        # The gather and slot-mapping stage (multiwrite/stage.py): buffers of its own, outside the storage above.
        config = self._stage_config = _stage.init_stage(self, max_num_batched_tokens, cp_size, cp_rank, cp_interleave)
        self.input_block_tables: list[torch.Tensor] = config.input_block_tables
        self.slot_mappings: torch.Tensor | None = config.slot_mappings
        self.max_num_batched_tokens: int | None = config.max_num_batched_tokens
        self.cp_size: int = config.cp_size
        self.cp_rank: int = config.cp_rank
        self.cp_interleave: int = config.cp_interleave
        if self._graph is not None:
            _stage_graph.bind(self)  # the stage descriptors of captured stage calls, built now (never in a capture)

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups (tables)."""
        return len(self.block_tables)

    @property
    def backend(self) -> Backend:
        """The backend that applies the writes."""
        return self._writer.backend

    @property
    def device(self) -> torch.device:
        """Device of the tables."""
        return self._writer.device

    def __reduce_ex__(self, protocol: object) -> object:
        """Refused (`copy.copy`, `copy.deepcopy`, `pickle`): the tables own device memory and pinned staging slots,
        and the compiled `append_block_ids` is bound to this object; a copy would stage into this object's arena
        (or fail once it is gone). Build a new `BlockTables` instead.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "a BlockTables cannot be copied or pickled: it owns its device tables, pinned staging memory and a "
            "staging callable bound to it; build a new BlockTables with the same arguments instead"
        )

    def __getitem__(self, group: int) -> StagedWriteTensor:
        """Group `group`'s `StagedWriteTensor`."""
        return self.block_tables[group]

    def append_block_ids(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage request `req_index`'s new manager block ids, one list per KV-cache group.

        With `overwrite`, each group's row is rewritten from column 0 (a new request); otherwise the
        kernel block ids go after the row's current `num_blocks` (a running request). A group with no new
        ids stages nothing when appending, and resets the row's count when overwriting.

        Where the C helper is built (`multiwrite/_cstaging.c`), each `BlockTables` replaces this method on
        itself by a C callable with the same arguments, checks and results, which hands every call it does not
        take (an unusual type, a bad value, a non-bool `overwrite`) to this method; a subclass that overrides
        the method keeps its override.

        Args:
            req_index: the request's row, `0 <= req_index < max_num_reqs`.
            new_block_ids: `num_groups` lists (or 1-D int arrays) of manager block ids `>= 0`.
            overwrite: start at column 0 instead of after the current blocks.

        Raises:
            StagedWriteError: wrong number of groups, row outside the tables, a row that would overflow
                its width, ids that are not integers or whose kernel ids overflow int32, an `overwrite`
                that is not a bool (`True`, `False` or a `numpy.bool_`). Nothing is staged for any group then.
        """
        if overwrite is not True and overwrite is not False:
            overwrite = _overwrite_flag(req_index, overwrite)
        self._append_block_ids_python(req_index, new_block_ids, overwrite)

    def append_block_ids_batch(
        self,
        req_indices: Sequence[int],
        new_block_ids: Sequence[Sequence[Sequence[int]]],
        overwrite: bool | Sequence[bool],
    ) -> None:
        """Stage a scheduler step's `append_block_ids` calls in one call: `append_block_ids(req_indices[i],
        new_block_ids[i], overwrite[i])` for each `i` in order (or `overwrite` for all when it is one bool).

        Same results as those calls; with the compiled staging path it stages them all in C, without a
        Python call per request (at C=256 on the real trace, 31 requests get new blocks per decode step).

        Args:
            req_indices: request rows, one per call.
            new_block_ids: per call, `num_groups` lists of manager block ids (as `append_block_ids` takes them).
            overwrite: one bool for every call, or one bool per call.

        Raises:
            StagedWriteError: `req_indices`, `new_block_ids` (and a sequence `overwrite`) differ in length,
                before anything is staged; or a call fails as `append_block_ids` would fail: the calls
                before it stay staged, that one stages nothing, the ones after it are not made. The error (of
                the type the call raised, caused by it) names the call's position and request row.
        """
        if isinstance(overwrite, (bool, np.bool_)):
            flags: Sequence[object] = [overwrite] * len(req_indices)
        elif isinstance(overwrite, Sequence) and not isinstance(overwrite, (str, bytes)):
            flags = overwrite
        else:
            raise StagedWriteError(
                f"append_block_ids_batch: overwrite must be a bool or one bool per call, got {overwrite!r:.60} "
                f"({type(overwrite).__name__})"
            )
        if not (len(req_indices) == len(new_block_ids) == len(flags)):
            raise StagedWriteError(
                f"append_block_ids_batch: {len(req_indices)} request rows, {len(new_block_ids)} lists of block ids"
                + ("" if flags is not overwrite else f" and {len(flags)} overwrite flags")
                + ": one of each per call; nothing was staged"
            )
        append = self.append_block_ids
        for i, (req, ids, flag) in enumerate(zip(req_indices, new_block_ids, flags)):
            try:
                append(req, ids, flag)
            except Exception as error:
                raise _batch_failure(error, i, len(req_indices), req) from error

    def _append_block_ids_python(self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """`append_block_ids` without the compiled path: same checks, same staged data, precise errors."""
        groups = self._groups
        if isinstance(new_block_ids, Mapping):
            raise StagedWriteError(
                f"append_block_ids: request row {req_index!r}: new_block_ids must be one sequence of block ids per "
                f"KV-cache group in group order, got a {type(new_block_ids).__name__} (a dict is not a sequence of "
                "per-group lists: pass [ids of group 0, ids of group 1, ...])"
            )
        if not isinstance(new_block_ids, Sequence):
            try:
                new_block_ids = list(new_block_ids)  # a generator of per-group lists
            except TypeError:
                raise StagedWriteError(
                    f"append_block_ids: request row {req_index!r}: new_block_ids must be one sequence of block "
                    f"ids per KV-cache group, got {type(new_block_ids).__name__}"
                ) from None
        if len(new_block_ids) != len(groups):
            raise StagedWriteError(
                f"append_block_ids: request row {req_index}: got block ids for {len(new_block_ids)} KV-cache "
                f"groups, the tables have {len(groups)} (block sizes {self.block_sizes})"
            )
        req = req_index
        if req.__class__ is bool:
            raise StagedWriteError(f"append_block_ids: request row {req_index!r} must be an integer, not a bool")
        if type(req) is not int:
            try:
                req = strict_index(req)
            except TypeError:
                raise StagedWriteError(f"append_block_ids: request row {req_index!r} is not an integer") from None
        if not 0 <= req < self.max_num_reqs:
            raise StagedWriteError(
                f"append_block_ids: request row {req} is outside [0, {self.max_num_reqs}) "
                f"(tables of shape ({self.max_num_reqs}, ...))"
            )
        arena = self._arena
        num_blocks = self._num_blocks_view
        w = w0 = arena.num_writes
        v = v0 = arena.num_values
        if w + len(groups) + 1 > arena.meta.shape[0]:
            arena.reserve(len(groups) + 1, 0)
        pack = arena.pack_meta
        stamps = self._stamps_view
        epoch = self._context_view[_CTX_EPOCH]
        R = self.max_num_reqs
        counts = []
        g, start = 0, None  # for errors: the group at hand, its start once known
        try:
            for g, ids in enumerate(new_block_ids):
                n = len(ids)
                k, width, max_id = groups[g]
                cells = n * k
                if n:
                    start = 0 if overwrite else num_blocks[g, req]
                    if start + cells > width:
                        raise StagedWriteError(
                            f"{self.block_tables[g]._describe(req, start, n)}: {n} block ids x {k} kernel blocks "
                            f"end at column {start + cells}, past the row width {width}"
                        )
                    if v + cells > arena.values.shape[0]:
                        arena.reserve(len(groups), v - v0 + cells)
                    if n <= 8 and type(ids) in (list, tuple):
                        if bool in map(type, ids):
                            raise StagedWriteError(
                                f"{self.block_tables[g]._describe(req, start, n)}: a bool block id: "
                                "stage integers, not bools"
                            )
                        low, high = min(ids), max(ids)
                        if low < 0 or high > max_id:
                            self._raise_bad_id(g, req, start, n, low if low < 0 else high)
                        flat = arena.values_flat
                        if k == 1:
                            for i, b in enumerate(ids, v):
                                flat[i] = b  # checks the type and the int32 range
                        else:
                            i = v
                            for b in ids:
                                b = operator.index(b)  # a numpy scalar times k would wrap in its own dtype
                                for j in range(b * k, b * k + k):
                                    flat[i] = j
                                    i += 1
                    else:
                        ids, n = _checked_values(ids, np.int32, self._describer(g, req, start))
                        low, high = int(min(ids)), int(max(ids))
                        if low < 0 or high > max_id:
                            self._raise_bad_id(g, req, start, n, low if low < 0 else high)
                        arena.values[v : v + cells] = expand_kernel_blocks(np.asarray(ids, dtype=np.int64), k)
                elif overwrite:
                    start = 0
                else:
                    continue
                pack(arena.meta_bytes, w * _META_BYTES, g, req, start, cells, v)  # after any reserve
                w += 1
                v += cells
                counts.append(start + cells)
                counts.append(g)
        except (TypeError, ValueError, OverflowError) as exc:
            # Nothing of this call stays staged: the counters never moved, no (table, row) was stamped.
            if isinstance(exc, StagedWriteError):
                raise
            describe = self._describer(g, req, start)
            ids = new_block_ids[g]
            if not hasattr(ids, "__len__"):
                raise StagedWriteError(
                    f"{describe(None)}: the block ids of group {g} must be a sequence, got {type(ids).__name__}"
                ) from None
            _checked_values(ids, np.int32, describe)  # raises, naming the offending value
            raise StagedWriteError(f"{describe(len(ids))}: {exc}") from None
        if w == w0:
            return
        for i in range(1, len(counts), 2):  # every check passed: stamp the rows written (overlap detection)
            at = counts[i] * R + req
            if stamps[at] == epoch:
                arena.may_overlap = True
            stamps[at] = epoch
        counts_table = self._counts_table
        # the request's new counts: one more write, row `req` of num_blocks.T
        new_counts = [num_blocks[g, req] for g in range(len(groups))]
        for i in range(0, len(counts), 2):
            new_counts[counts[i + 1]] = counts[i]
        if v + len(groups) > arena.values.shape[0]:
            arena.reserve(0, v - v0 + len(groups))
        flat = arena.values_flat
        for i, c in enumerate(new_counts, v):
            flat[i] = c
        arena.pack_meta(arena.meta_bytes, w * _META_BYTES, counts_table, req, 0, len(groups), v)
        w += 1
        v += len(groups)
        if stamps[counts_table * R + req] == epoch:
            arena.may_overlap = True
        else:  # the row's counts change for the first time in this batch: keep them for clears
            self._num_blocks_applied[:, req] = self.num_blocks[:, req]
        stamps[counts_table * R + req] = epoch
        if _CLOCK[0] != arena.uid:
            arena.begin_run()  # another arena staged last: these writes start a run of this one
        arena.num_writes = w
        arena.num_values = v
        for i in range(0, len(counts), 2):
            num_blocks[counts[i + 1], req] = counts[i]

    def _raise_bad_id(self, g: int, req: int, start: int, n: int, bad: int) -> None:
        k = self._groups[g][0]
        raise StagedWriteError(
            f"{self.block_tables[g]._describe(req, start, n)}: block id {bad} is "
            + (
                "negative"
                if bad < 0
                else "too large: it does not fit int32"
                if k == 1
                else f"too large: its {k} kernel block ids overflow int32"
            )
        )

    def _describer(self, g: int, req: int, start: int | None) -> Callable[[int | None], str]:
        table = self.block_tables[g]
        if start is None:  # failed before its start was known: name only what the user gave
            return lambda n: (
                f"append_block_ids: request row {req}, group {g}" + ("" if n is None else f", {n} block ids")
            )
        return lambda n: table._describe(req, start, n)

    def apply_staged_writes(self) -> None:
        """Apply every group's staged writes and the new `num_blocks` in one `FusedStagedWriter` call.

        On a GPU this enqueues one kernel launch on the current stream and returns without waiting.

        Graph mode (`cuda_graphs=True`): inside `torch.cuda.graph(...)` this records one launch of the
        consume kernel (fixed arguments) and commits nothing: each replay applies the next batch closed
        by `commit_staged_writes()`. Outside a capture it commits what is staged and applies every
        committed batch not yet applied, in commit order: one launch, or two when the header ring was full of
        committed batches (it applies those first, so that the commit does not wait for a replay); none when
        nothing was ever committed.

        Raises:
            StagedWriteError: a table was resized or `set_` in place (see the class docstring); nothing
                was written, the staged writes stay staged.
            BackendError: the backend failed; every staged write (the `num_blocks` row included) stays
                staged and `num_blocks` keeps the staged counts, so calling this again lands them all and
                host and device `num_blocks` agree after it (see `Backend.apply`).
        """
        self._writer.apply(self._all)
        self._context_view[_CTX_EPOCH] += 1  # a new batch: every (table, row) is free again

    def clear_staged_writes(self) -> None:
        """Drop every staged write and restore `num_blocks` to its value at the last successful
        `apply_staged_writes()`.

        Reads no device state (no copy back, no synchronization): each request's counts as of the last
        apply are kept on the host when a batch first changes them, so this is right even while an apply
        is still running on another stream.

        Graph mode (`cuda_graphs=True`): drops only the writes staged since the last commit, restoring
        `num_blocks` as of that commit; committed batches stay committed. Allowed during a capture.

        Raises:
            GraphCaptureError: the current CUDA stream is capturing a graph (not in graph mode); nothing is
                dropped.
        """
        refuse_capture(self.device, "BlockTables.clear_staged_writes")
        self._drop_staged_writes()

    def _drop_staged_writes(self) -> None:
        """Drop every staged write; `num_blocks` back to the counts of the last apply (or commit), from the host
        copy kept at staging time; a new batch epoch."""
        changed = np.flatnonzero(self._stamps[self._counts_table] == self._context_view[_CTX_EPOCH])
        self.num_blocks[:, changed] = self._num_blocks_applied[:, changed]
        self._arena.clear()
        self._context_view[_CTX_EPOCH] += 1

    def commit_staged_writes(self) -> int:
        """Graph mode: close the staged batch as the batch of the NEXT run of the apply kernel (a replay of
        a graph that captured `apply_staged_writes()`, or an eager `apply_staged_writes()`).

        The one host call per step in graph mode: it writes the next entry of a pinned header ring; no launch,
        no driver call. A batch of one overlap round with at most 256 writes and 256 values (a decode step) is
        copied into the entry with a checksum, and the arena keeps its ring slot; a bigger one stays in its
        pinned ring slot, the header says where (with the slot's completion token), and the arena gets a fresh
        slot. At most `depth` committed batches (the ring depth rounded up to a power of two: 8 by default) wait
        for a run, and at most ring depth - 1 of them in ring slots. Staging alone cannot be picked up by
        a replay: the replay runs asynchronously, while the host may already be staging the next step, so
        the kernel needs to be told where one step's batch ends. Each replay (of a captured
        `apply_staged_writes()` or `prepare_inputs(...)`) consumes exactly ONE committed batch, in commit
        order: commit once before every replay (with nothing staged, the commit publishes an empty batch and
        the replay applies nothing). A replay of a captured `prepare_inputs` gathers and computes the slot
        mappings after applying that batch. An eager `apply_staged_writes()` or
        `prepare_inputs()` commits and then applies every committed batch. `num_blocks_device` travels in the
        same batches.

        Does not check for tables resized in place (that check runs at capture and at eager applies).

        Returns:
            The batch's index (0, 1, ... in commit order).

        Raises:
            StagedWriteError: the tables were not created with `cuda_graphs=True`.
            RingStallError: the header ring (or, for a batch that stays in its ring slot, the next slot) is
                full of committed batches that no run consumed: the commit polls, warns (`RingWaitWarning`)
                after the writer's `wait_warn_s` (1 s), synchronizes the device after its `wait_timeout_s`
                (10 s), and raises if still full; nothing was committed, the writes stay staged.
        """
        graph = self._graph
        if graph is None:
            raise StagedWriteError(
                "commit_staged_writes() is for tables created with BlockTables(..., cuda_graphs=True); these apply "
                "with apply_staged_writes(). Nothing was committed; the staged writes stay staged"
            )
        fast = self._fast_commit
        if fast is not None:
            h = fast(graph, self._arena, self._epoch_addr)  # the common case, epoch bump included
            if h is not None:
                return h
        h = graph.commit(self._arena)
        self._context_view[_CTX_EPOCH] += 1  # a new batch: every (table, row) is free again
        return h

    def _apply_graph_mode(self) -> None:
        """`apply_staged_writes()` of a graph-mode `BlockTables` (the class method's docstring says what)."""
        graph = self._graph
        if is_capturing(self.device):
            _check_frozen(self._arena)  # descriptors are captured by address: the tables must be as built
            graph.launch(-1)  # recorded: every replay consumes the next committed batch
            return
        if self._arena.frozen is not None:
            _check_frozen(self._arena)
        if self._arena.num_writes:
            if graph.would_wait(self._arena):  # the ring is full of committed batches: apply those first, so
                graph.apply_eager()  # the commit below waits only for that launch, never for a replay
            self.commit_staged_writes()
        graph.apply_eager()

    def _clear_graph_mode(self) -> None:
        """`clear_staged_writes()` of a graph-mode `BlockTables`: drops the writes staged since the last
        commit; committed batches stay committed (host work only, allowed during a capture)."""
        self._drop_staged_writes()

    def _prepare_inputs_graph_mode(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_reqs_padded: int,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """`prepare_inputs()` of a graph-mode `BlockTables`: recorded when capturing (`multiwrite/stage_graph.py`)."""
        if is_capturing(self.device):
            return _stage_graph.capture_prepare_inputs(
                self, idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding
            )
        return _stage.prepare_inputs(
            self, idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding
        )

    def _gather_graph_mode(self, idx_mapping: torch.Tensor, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        """`gather_block_tables()` of a graph-mode `BlockTables`: recorded when capturing."""
        if is_capturing(self.device):
            return _stage_graph.capture_gather_block_tables(self, idx_mapping, num_reqs_padded)
        return _stage.gather_block_tables(self, idx_mapping, num_reqs_padded)

    def _slot_mappings_graph_mode(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`compute_slot_mappings()` of a graph-mode `BlockTables`: recorded when capturing."""
        if is_capturing(self.device):
            return _stage_graph.capture_compute_slot_mappings(
                self, idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding
            )
        return _stage.compute_slot_mappings(
            self, idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding
        )

    def __repr__(self) -> str:
        return (
            f"BlockTables(block_sizes={self.block_sizes}, kernel_block_sizes={self.kernel_block_sizes}, "
            f"max_num_reqs={self.max_num_reqs}, widths={self._widths}, device={self.device}, "
            f"backend={self.backend.NAME!r})"
        )

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        """Gather the scheduled requests' rows into batch order in `input_block_tables` (vLLM's semantics).

        Batch entry `b < num_reqs` gets the first `num_blocks[g, idx_mapping[b]]` cells of row
        `idx_mapping[b]` of each group's table (its other cells keep what they held); rows `num_reqs ..
        num_reqs_padded - 1` become zero. Reads the tables and `num_blocks_device` as the last apply left
        them; on a GPU it enqueues torch ops on the current stream and does not synchronize.

        Args:
            idx_mapping: int32/int64 `[num_reqs]`, the request row of each batch entry, on the tables'
                device or on the host (pinned memory for a GPU, copied asynchronously).
            num_reqs_padded: `num_reqs <= num_reqs_padded <= max_num_reqs`.

        Returns:
            `input_block_tables[g][:num_reqs_padded]` per group: views of persistent int32 tensors whose
            addresses never change. The same view objects come back for the same `num_reqs_padded` (no
            allocation per call): read and write through them, but do not `resize_` or `set_` them.

        Raises:
            StageInputError: a wrong shape or dtype, `num_reqs` or `num_reqs_padded` above `max_num_reqs`, a
                row outside `[0, max_num_reqs)` (checked for host inputs; device values are not read); during a
                capture (graph mode), an input that is not a tensor on the tables' device.
            GraphCaptureError: called during CUDA graph capture on tables without `cuda_graphs=True`. In graph
                mode the call is recorded instead: one launch that reads `idx_mapping`'s values at each replay
                (`num_reqs` and `num_reqs_padded` fixed at capture) and the tables as the last apply left them.
        """
        return _stage.gather_block_tables(self, idx_mapping, num_reqs_padded)

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The KV-cache slot of every scheduled token in every group: int64 `[num_groups, num_tokens_padded]`.

        Token `i` of batch entry `b` (`query_start_loc[b] <= i < query_start_loc[b + 1]`) at position
        `p = positions[i]` gets `table[g][idx_mapping[b], p // kbs] * kbs + p % kbs` with the group's kernel
        block size `kbs`; with context parallelism, only the tokens this rank owns (each token has exactly
        one owner, see `multiwrite/stage.py`) get a slot. Tokens past `query_start_loc[num_reqs]`, tokens
        whose `is_padding` is true, and `slot_mappings[:, num_tokens_padded:]` get `PAD_SLOT_ID` (-1).

        Args:
            idx_mapping: int32/int64 `[num_reqs]`, request rows.
            query_start_loc: int32/int64 `[>= num_reqs + 1]`, starting at 0, non-decreasing, the end
                `query_start_loc[num_reqs] <= num_tokens_padded`.
            positions: int32/int64 `[>= query_start_loc[num_reqs]]`, token positions (>= 0).
            num_tokens_padded: `<= max_num_batched_tokens`.
            is_padding: optional bool `[>= num_tokens_padded]`; true marks a token to skip.
            Tensors on the tables' device or on the host (pinned memory for a GPU).

        Returns:
            `slot_mappings[:, :num_tokens_padded]`, a view of the persistent buffer (the same object for the
            same `num_tokens_padded`, as for `gather_block_tables`).

        Raises:
            StageInputError: wrong shapes or dtypes, counts above the buffers, and for host inputs bad
                values: a row outside the tables, `query_start_loc` not starting at 0 or decreasing, a
                negative position or one past its table's row (naming token, request, group and width);
                during a capture (graph mode), an input that is not a tensor on the tables' device.
            GraphCaptureError: called during CUDA graph capture on tables without `cuda_graphs=True`. In graph
                mode the call is recorded instead: one launch that reads the inputs' values at each replay
                (`num_reqs`, `num_tokens_padded` and the length of `positions` fixed at capture).
        """
        return _stage.compute_slot_mappings(
            self, idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding
        )

    def prepare_inputs(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_reqs_padded: int,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Apply the staged writes, gather and compute slot mappings in ONE backend call.

        Exactly equal to `apply_staged_writes()`, `gather_block_tables(idx_mapping, num_reqs_padded)`,
        `compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding)` in
        that order; the backend's `Backend.prepare_inputs` does the work (by default its apply followed by
        the generic torch gather and slot mapping). Inputs are checked first: a rejected call applies
        nothing and every staged write stays staged.

        Graph mode (`cuda_graphs=True`): inside `torch.cuda.graph(...)` this records the consume kernel (the
        replay applies the NEXT batch closed by `commit_staged_writes()`, as a captured `apply_staged_writes()`
        does) followed by ONE launch of the gather + slot-mapping kernel, and commits nothing. The inputs must
        be tensors on the tables' device (values unchecked: they are read at each replay, from the engine's
        persistent buffers); fixed at capture: their addresses, `num_reqs = len(idx_mapping)`,
        `num_reqs_padded`, `num_tokens_padded`, the length of `positions` and whether `is_padding` is given.
        Call it once eagerly before capturing (it compiles the eager path's kernels; the captured stage kernel,
        a variant of its own, may compile at the first capture: host work, which a capture allows), and do not capture
        `apply_staged_writes()` in the same graph (each consumes one committed batch per replay). Outside a
        capture it commits what is staged, applies every committed batch, then gathers and computes the slot
        mappings.

        Returns:
            (gathered tables, slot mappings), as the two methods return them.

        Raises:
            StageInputError: as the two methods; during a capture (graph mode), an input that is not a tensor
                on the tables' device (its host->device copy would be captured). Nothing is recorded then.
            GraphCaptureError: called during CUDA graph capture on tables without `cuda_graphs=True`.
            And the errors of `apply_staged_writes`.
        """
        direct = self._direct
        if direct:  # the backend's direct path for the common eager step; None: not that case, nothing done
            out = direct(idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding)
            if out is not None:
                return out
        out = _stage.prepare_inputs(
            self, idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded, is_padding
        )
        if direct is None:
            self._direct = self._bind_direct()
        return out

    def _bind_direct(self) -> Callable | bool | None:
        """The backend's direct path of an eager `prepare_inputs` (`Backend`-optional `bind_direct_stage`, see
        `multiwrite/backends/triton_direct.py`): a callable, None while the backend cannot bind it yet (asked again
        after the next general call), or False when there is none (another backend, graph mode)."""
        bind = getattr(self.backend, "bind_direct_stage", None)
        if bind is None or self._graph is not None:
            return False
        return bind(self, _CTX_EPOCH)
