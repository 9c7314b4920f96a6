"""`BlockTables`: the block tables of every KV-cache group of a model, their block counts, and the rest of a
step's block-table stage (gather, slot mappings), each job one backend call, run by the tables' mode
(`multiwrite.tables.mode`: `EagerMode`, or `GraphMode` with `cuda_graphs=True`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.capture import refuse_capture, setup_calls
from multiwrite.env_switch import env_switch
from multiwrite.errors import BackendUnavailableError
from multiwrite.plugins import checked
from multiwrite.plugins.backend import Backend, graph_plan_of, plan_of
from multiwrite.plugins.dispatch import select_backend
from multiwrite.stage.layout import TablesLayout
from multiwrite.staging.arena import LayoutGuard, StagingArena
from multiwrite.staging.block_ids import BlockIdStaging, PyBlockIdStaging
from multiwrite.staging.layout import check_device
from multiwrite.staging.table import StagedWriteTensor
from multiwrite.tables.eager import EagerMode
from multiwrite.tables.graph import GraphMode
from multiwrite.tables.mode import ADDRESS_CHECK_PERIOD, TablesMode

_FIXED = (
    "a BlockTables' tables cannot be replaced or resized: every group's table and num_blocks share one "
    "allocation; build a new BlockTables with the new sizes"
)
#: Turns the address check of every call on for every `BlockTables` built while it is on (`multiwrite.env_switch`).
CHECK_ADDRESSES_ENV = "MULTIWRITE_CHECK_ADDRESSES"
#: What the calls before an address check that found a re-pointing did, per setting (the error's message).
_SINCE = {
    True: "every call before this one was checked (address checks at every call), so none of them ran re-pointed",
    False: (
        f"the writes of the calls since the last check (up to {ADDRESS_CHECK_PERIOD - 1}: without "
        f"check_addresses=True or {CHECK_ADDRESSES_ENV}=1 the check runs at every {ADDRESS_CHECK_PERIOD}th call, "
        "each capture and refresh_layout) may have gone to that old memory, not to the memory the tensor shows now"
    ),
}


class BlockTables(BlockIdStaging):
    """The block tables of every KV-cache group of a model, staged on the host, applied in one call.

    What runs: `append_block_ids` / `append_block_ids_batch` stage on the host (inherited from `BlockIdStaging`:
    compiled C where built, its exact Python twin otherwise; `multiwrite/staging/block_ids.py`). Every other job is
    one call of the backend's plan (`Backend.plan`, built once here): `apply_staged_writes` -> `plan.apply()`,
    `gather_block_tables` / `compute_slot_mappings` -> `plan.stage(step)`, `prepare_inputs` -> `plan.prepare(step)`
    (one launch on the Triton backends; two when a row is written in more than 8 overlap rounds of one batch: the
    apply, then the stage). The jobs are those of the tables' mode, chosen here once: an `EagerMode`, or with
    `cuda_graphs=True` a `GraphMode` (`self.graph`), which publishes batches into a header ring so that a CUDA graph
    can capture them (docs/graph-mode.md). Each call goes through the mode's one preamble (`TablesMode.enter`).
    docs/lifecycle.md says what a request's rows hold from admission to reuse.

    Args:
        block_sizes: tokens per KV-cache block, one per group (e.g. `[16, 32, 8]`).
        max_num_reqs: rows of every table (request slots).
        max_num_blocks_per_group: manager blocks a request may hold, per group.
        device: where the tables live.
        kernel_block_sizes: the attention kernel's block size per group (default: `block_sizes`). Group `g` writes
            each block id `b` as the `k = block_sizes[g] // kernel_block_sizes[g]` kernel block ids `b*k .. b*k+k-1`.
        backend: force a backend by name or instance (default: the best available for `device`).
        max_num_batched_tokens: tokens a step may schedule: the width of `slot_mappings` (keyword; without it the
            slot mappings are refused).
        cp_size, cp_rank, cp_interleave: decode context parallelism as vLLM's (keyword; default: none).
        cuda_graphs: graph mode (keyword, default False).
        check_addresses: keyword: check at every call, before anything is staged or launched, that no table or
            output was re-pointed to other memory (e.g. `tensor.data = other`): one `data_ptr()` per tensor. Default
            False: checked at every 64th call, at every capture of graph mode and at `refresh_layout`. Also on for
            every `BlockTables` built while `$MULTIWRITE_CHECK_ADDRESSES` is on (`1`, `true`, `yes`, `on`).
            docs/lifecycle.md says what each costs.

    Attributes:
        block_tables: one `StagedWriteTensor` per group; `block_tables[g].tensor` is group `g`'s int32 table
            `[max_num_reqs, max_num_blocks_per_group[g] * k_g]` of kernel block ids.
        num_blocks: host int32 `[num_groups, max_num_reqs]`: kernel blocks held per request and group, as staged.
        num_blocks_device: int32 `[num_groups, max_num_reqs]` on `device`: `num_blocks` as of the last apply.
        input_block_tables: per group the persistent int32 `[max_num_reqs, width_g]` target of the gather.
        slot_mappings: the persistent int64 `[num_groups, max_num_batched_tokens]`, or None.
        graph: the `GraphMode` with `cuda_graphs=True`, else None.
        checks_addresses: whether every call checks the addresses (`check_addresses`, or the environment variable).
        block_sizes, kernel_block_sizes, kernel_blocks_per_block, max_num_blocks_per_group, max_num_reqs,
        max_num_batched_tokens, cp_size, cp_rank, cp_interleave: the sizes (see `TablesLayout`).

    Not thread-safe: one thread at a time per object; distinct objects may be used from distinct threads at once.

    Raises:
        StagedWriteError: sizes that do not fit together (see `TablesLayout.build`).
        ValueError: `$MULTIWRITE_CHECK_ADDRESSES` is neither on nor off (`multiwrite.env_switch`), before anything is
            allocated.
        BackendUnavailableError: torch cannot allocate on `device`, no backend can run there (the forced one
            cannot), before anything is allocated; or `cuda_graphs=True` with a backend whose graph mode is missing
            or incomplete, once the tables are built (the constructor raises: nothing is kept).
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass that overrides `append_block_ids` alone gets the batch of the Python twin, which calls it once
        per request (the compiled batch stages in C and would pass the override by)."""
        super().__init_subclass__(**kwargs)
        if "append_block_ids" in vars(cls) and "append_block_ids_batch" not in vars(cls):
            cls.append_block_ids_batch = PyBlockIdStaging.append_block_ids_batch  # type: ignore[assignment]

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
        slot_mapping_enabled: Sequence[bool] | None = None,
        dcp_sharded: Sequence[bool] | None = None,
        sliding_window_reach: Sequence[int] | None = None,
        check_addresses: bool = False,
    ):
        # (read whatever the argument: a value that is neither on nor off is refused, never ignored)
        env = env_switch(os.environ, CHECK_ADDRESSES_ENV, "multiwrite does not guess whether BlockTables check their "
                         "addresses at every call")  # fmt: skip
        self.checks_addresses = bool(check_addresses) or env
        device = check_device(device, "BlockTables")
        refuse_capture(device, "BlockTables(...)")  # (its setup synchronizes: never inside a capture of this thread)
        groups = (slot_mapping_enabled, dcp_sharded, sliding_window_reach)
        # (setup_calls: a capture on another thread stays valid; inference mode off: every tensor the tables and the
        # backend's plan keep is a normal tensor, also when built under torch.inference_mode(), as vLLM builds its
        # runner's state, and used or refreshed outside it)
        with setup_calls(device), torch.inference_mode(False):
            self._build(block_sizes, max_num_reqs, max_num_blocks_per_group, device, kernel_block_sizes, backend,
                        max_num_batched_tokens, cp_size, cp_rank, cp_interleave, cuda_graphs, groups)  # fmt: skip

    def _build(self, block_sizes, max_num_reqs, max_num_blocks_per_group, device, kernel_block_sizes, backend,
               max_num_batched_tokens, cp_size, cp_rank, cp_interleave, cuda_graphs, groups) -> None:  # fmt: skip
        self.backend = (
            checked.refuse_unsupported(backend, device)
            if isinstance(backend, Backend)
            else select_backend(device, backend)
        )
        layout = self._layout = TablesLayout.build(
            block_sizes, max_num_reqs, max_num_blocks_per_group, device, kernel_block_sizes, max_num_batched_tokens,
            cp_size, cp_rank, cp_interleave, *groups,
        )  # fmt: skip
        G, R = layout.num_groups, layout.max_num_reqs
        self._device = device
        self.block_sizes, self.kernel_block_sizes = layout.block_sizes, layout.kernel_block_sizes
        self.kernel_blocks_per_block = layout.kernel_blocks_per_block
        self.max_num_blocks_per_group, self.max_num_reqs = layout.max_num_blocks_per_group, R
        self.max_num_batched_tokens = layout.max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = layout.cp_size, layout.cp_rank, layout.cp_interleave
        self.slot_mapping_enabled, self.dcp_sharded = layout.slot_mapping_enabled, layout.dcp_sharded
        self.sliding_window_reach = layout.sliding_window_reach
        self.num_blocks_device = layout.num_blocks
        self.input_block_tables = layout.input_block_tables
        self.slot_mappings = layout.slot_mappings
        arena = self._arena = StagingArena(np.int32)
        arena.stamped = True
        self.block_tables = [
            StagedWriteTensor.in_arena(t, arena, name=f"group {g}", kernel_blocks_per_block=k, fixed=_FIXED)
            for g, (t, k) in enumerate(zip(layout.tables, layout.kernel_blocks_per_block))
        ]
        StagedWriteTensor.in_arena(layout.counts_table, arena, name="num_blocks", fixed=_FIXED)
        outputs = [(t, f"input_block_tables[{g}] of a BlockTables") for g, t in enumerate(layout.input_block_tables)]
        if layout.slot_mappings is not None:
            outputs.append((layout.slot_mappings, "slot_mappings of a BlockTables"))
        since = _SINCE[self.checks_addresses]
        outputs_guard = LayoutGuard(
            outputs,
            layout.outputs_storage,
            "the outputs of a BlockTables share one allocation that kernels write",
            since,
        )
        guard = arena.guard = LayoutGuard(
            [(t, f"group {g} of a BlockTables") for g, t in enumerate(layout.tables)]
            + [(t, "num_blocks of a BlockTables") for t in (layout.counts_table, layout.num_blocks)],
            layout.storage,
            "the tables and num_blocks of a BlockTables share one allocation",
            since,
        )
        self.num_blocks = np.zeros((G, R), dtype=np.int32)
        applied = np.zeros((G, R), dtype=np.int32)
        stamps = np.zeros((G + 1, R), dtype=np.int64)
        # Per group: k, row width, largest manager id whose kernel ids b*k + k - 1 fit int32.
        ks = layout.kernel_blocks_per_block
        groups = tuple((k, w, (2**31 - 1 - (k - 1)) // k) for k, w in zip(ks, layout.widths))
        self._bind_staging(arena, self.num_blocks, applied, stamps, groups)
        names = (*(t.name for t in self.block_tables), "num_blocks")
        state = (layout, arena, guard, outputs_guard, self.num_blocks, applied, stamps, names)
        self.graph: GraphMode | None = None
        if cuda_graphs:
            plan = graph_plan_of(self.backend, layout, arena)
            if plan is None:
                raise BackendUnavailableError(
                    f"BlockTables(cuda_graphs=True): backend {self.backend.NAME!r} on {device} has no graph mode "
                    "(Backend.graph_plan); triton-cuda and triton-rocm have one. Use cuda_graphs=False"
                )
            missing = plan.missing_jobs()
            if missing:
                raise BackendUnavailableError(
                    f"BlockTables(cuda_graphs=True): backend {self.backend.NAME!r} on {device} returned a graph plan, "
                    f"{type(plan).__name__}, that does not implement {' and '.join(missing)} (GraphPlan); "
                    "use cuda_graphs=False"
                )
            mode: TablesMode = GraphMode(self.backend, plan, *state, check_addresses=self.checks_addresses)
            self.graph = mode
        else:
            mode = EagerMode(self.backend, plan_of(self.backend, layout, arena), *state,
                             check_addresses=self.checks_addresses)  # fmt: skip
        self._mode = mode

    # -- sizes ----------------------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups (tables)."""
        return len(self.block_tables)

    @property
    def num_staged_writes(self) -> int:
        """Writes staged and not yet applied (graph mode: not yet committed), the `num_blocks` rows included."""
        return self._arena.num_writes

    @property
    def num_staged_values(self) -> int:
        """Values those writes carry (kernel block ids, and the counts of the `num_blocks` rows): with
        `num_staged_writes`, the size of the batch the next apply lands (graph mode: whether it travels in its header,
        docs/graph-mode.md)."""
        return self._arena.num_values

    @property
    def device(self) -> torch.device:
        """Device of the tables."""
        return self._device

    @property
    def cuda_graphs(self) -> bool:
        """Whether these tables run in graph mode."""
        return self.graph is not None

    def __getitem__(self, group: int) -> StagedWriteTensor:
        """Group `group`'s `StagedWriteTensor`."""
        return self.block_tables[group]

    def __repr__(self) -> str:
        return (
            f"BlockTables(block_sizes={self.block_sizes}, kernel_block_sizes={self.kernel_block_sizes}, "
            f"max_num_reqs={self.max_num_reqs}, widths={self._layout.widths}, device={self.device}, "
            f"backend={self.backend.NAME!r}" + (", cuda_graphs=True)" if self.graph is not None else ")")
        )

    def __reduce_ex__(self, protocol: object) -> object:
        """Refused (`copy.copy`, `copy.deepcopy`, `pickle`): the tables own device memory and staging memory a kernel
        may still read; build a new `BlockTables` with the same arguments instead.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "a BlockTables cannot be copied or pickled: it owns its device tables and staging memory that kernels "
            "read; build a new BlockTables with the same arguments instead"
        )

    # -- apply ----------------------------------------------------------------------------------------------------
    def apply_staged_writes(self) -> None:
        """Apply every group's staged writes and the new `num_blocks` in one backend call (one kernel launch on a
        GPU, on the current stream, no host synchronization).

        Graph mode: inside `torch.cuda.graph(...)` this records the consume launch (each replay applies the batch of
        its commit); outside, it publishes what is staged and applies every published batch (docs/graph-mode.md).

        Raises:
            GraphCaptureError: called during a CUDA graph capture without graph mode; nothing changed.
            StagedWriteError: a table was resized or `set_` in place; nothing was written, the writes stay staged.
            BackendError: the backend failed; every staged write (the `num_blocks` row included) stays staged and
                `num_blocks` keeps the staged counts, so calling this again lands them all.
            RingStallError: staging memory a kernel reads was never released (see `multiwrite.errors`).
            GraphProtocolError: graph mode, outside a capture: a mis-pairing the device recorded (see
                `commit_staged_writes`); nothing was published or applied.
        """
        self._mode.apply()

    def commit_staged_writes(self) -> int:
        """Graph mode: publish the staged batch as the batch of the NEXT replay of a captured graph (host work only:
        a few stores into pinned memory). Commit exactly once, right before each replay, also when nothing is staged.

        Returns:
            The header index of the batch (0, 1, ... in commit order).

        Raises:
            StagedWriteError: the tables are not in graph mode, or were resized in place.
            RingStallError: the header or ticket ring stayed full of what no run consumed; nothing was committed.
            GraphProtocolError: the device recorded a mis-pairing (a replay without its commit, or a commit with no
                replay before an eager apply) not reported yet; nothing was committed, the pairing is restored.
        """
        entry = self._mode.commit_entry  # (the common commit in one compiled call; None from it: nothing done)
        if entry is not None:
            h = entry.commit()
            if h is not None:
                return h
        return self._mode.commit()

    def clear_staged_writes(self) -> None:
        """Drop every staged write and restore `num_blocks` to its counts as of the last apply (graph mode: commit).

        Reads no device state: each request's counts as of the last landed batch are kept on the host when a batch
        first changes them.

        Raises:
            GraphCaptureError: during a CUDA graph capture without graph mode; nothing is dropped.
        """
        self._mode.clear()

    # -- the stage ----------------------------------------------------------------------------------------------
    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        out: Sequence[torch.Tensor] | None = None,
        num_computed_tokens: torch.Tensor | None = None,
        apply_staged: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Gather the scheduled requests' rows into batch order in `input_block_tables` (vLLM 0.33's semantics).

        Batch entry `b < num_reqs` gets the first `num_blocks[g, idx_mapping[b]]` cells of row `idx_mapping[b]` of
        each group's table (its other cells keep what they held); an entry of -1 (a dummy request) gets a zero row;
        rows `num_reqs ..` up to the larger of `num_reqs_padded` and the previous gather's (or dummy's) row count
        become zero. With `num_computed_tokens`, a group with a `sliding_window_reach` gets 0 for every kernel block
        wholly below the window of the request's first scheduled token. Reads the tables as the last apply left
        them (`apply_staged`: applies the staged writes first, in the same launch).

        Args:
            idx_mapping: int32/int64 `[num_reqs]`, the request row (or -1) of each batch entry, on the tables' device
                or on the host.
            num_reqs_padded: `num_reqs <= num_reqs_padded <= max_num_reqs`.
            out: per group an int32 `[>= num_reqs_padded, width_g]` tensor on the tables' device to gather into
                instead (torch ops, several launches; nothing else is zeroed).
            num_computed_tokens: int32/int64 `[>= max_num_reqs]` per request row (the first scheduled position).
            apply_staged: exactly `apply_staged_writes()` first.

        Returns:
            `input_block_tables[g][:num_reqs_padded]` per group (or `out[g][:num_reqs_padded]`): views at fixed
            addresses (the same objects for the same size: read and write through them, do not `resize_` them).

        Raises:
            StageInputError: a wrong shape or dtype, a count above the tables, a row outside them (host inputs).
            GraphCaptureError: `apply_staged` with writes staged, during a CUDA graph capture without graph mode
                (otherwise a capture records the gather; its inputs must then be on the device).
        """
        entry = self._mode.entry  # (the common call in one compiled call; None from it: nothing done)
        if entry is not None and out is None and not apply_staged:
            views = entry.gather(idx_mapping, num_reqs_padded, num_computed_tokens)
            if views is not None:
                return views
        step = self._mode.stage_call("gather_block_tables", apply_staged, False, out, None, idx_mapping,
                                     num_reqs_padded, None, None, None, None, num_computed_tokens)  # fmt: skip
        return step.gathered(self._layout) if out is None else tuple(t[: step.num_reqs_padded] for t in out)

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        apply_staged: bool = False,
    ) -> torch.Tensor:
        """The KV-cache slot of every scheduled token in every group: int64 `[num_groups, num_tokens_padded]`.

        Token `i` of batch entry `b` (`query_start_loc[b] <= i < query_start_loc[b + 1]`) at position
        `p = positions[i]` gets `table[g][idx_mapping[b], p // kbs] * kbs + p % kbs` (kernel block size `kbs`);
        with context parallelism only the tokens this rank owns get a slot (every token, in a group whose
        `dcp_sharded` is False). Tokens of a dummy request (-1), padding tokens, every token of a group whose
        `slot_mapping_enabled` is False, and the buffer from `query_start_loc[num_reqs]` to its end get -1.
        Reads the tables as the last apply left them (`apply_staged`: applies the staged writes first, in the same
        launch).

        Args:
            idx_mapping: int32/int64 `[num_reqs]`, request rows (-1: a dummy request).
            query_start_loc: int32/int64 `[>= num_reqs + 1]`, from 0, non-decreasing, ending `<= num_tokens_padded`.
            positions: int32/int64 `[>= query_start_loc[num_reqs]]`, token positions (>= 0).
            num_tokens_padded: `<= max_num_batched_tokens`.
            is_padding: optional bool `[>= num_tokens_padded]`; true marks a token to skip.
            out: int64 `[num_groups, >= num_tokens_padded]` on the tables' device to write instead (torch ops,
                several launches), padded to its end.
            apply_staged: exactly `apply_staged_writes()` first.

        Returns:
            `slot_mappings[:, :num_tokens_padded]` (or `out[:, :num_tokens_padded]`), a view of the buffer.

        Raises:
            StageInputError: wrong shapes or dtypes, counts above the buffers, and for host inputs bad values (a
                position past its request's blocks names token, request and group).
            GraphCaptureError: `apply_staged` with writes staged, during a CUDA graph capture without graph mode
                (otherwise a capture records the slot mappings; its inputs must then be on the device).
        """
        entry = self._mode.entry
        if entry is not None and out is None and not apply_staged:
            view = entry.slots(idx_mapping, query_start_loc, positions, num_tokens_padded, is_padding)
            if view is not None:
                return view
        step = self._mode.stage_call("compute_slot_mappings", apply_staged, False, None, out, idx_mapping, None,
                                     query_start_loc, positions, num_tokens_padded, is_padding, None)  # fmt: skip
        return step.slots(self._layout) if out is None else out[:, : step.num_tokens_padded]

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """Zero `input_block_tables[g][:num_reqs]` (and the rows the last gather left past them) and return those
        views (fixed addresses: what a CUDA graph of a dummy batch reads). The caller may write ids into them: the
        next gather zeroes the rows it does not fill.

        Raises:
            StageInputError: `num_reqs` outside `[0, max_num_reqs]`.
        """
        return self._mode.dummy_block_tables(num_reqs)

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill the whole `slot_mappings` buffer with PAD (-1) and return `slot_mappings[:, :num_tokens]` (a fixed
        address).

        Raises:
            StageInputError: no slot_mappings buffer (built without `max_num_batched_tokens`), or `num_tokens` outside
                `[0, max_num_batched_tokens]`.
        """
        return self._mode.dummy_slot_mappings(num_tokens)

    def refresh_layout(self) -> None:
        """Rewrite what the device holds about the tables' addresses (the backend's descriptors), e.g. after the
        memory pool they were allocated from slept and woke and its contents were discarded. The tables' own
        contents are the caller's (re-stage them).

        Raises:
            GraphCaptureError: during a CUDA graph capture.
            TableMovedError: a table or output was re-pointed to other memory (`tensor.data = ...`): the descriptors
                would keep its old address; nothing rewritten.
            BackendError: the backend failed to rewrite them.
        """
        refuse_capture(self.device, "BlockTables.refresh_layout")
        self._mode.check_addresses("BlockTables.refresh_layout")
        self._mode.run(self._mode.plan.refresh)

    def prepare_inputs(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_reqs_padded: int,
        num_tokens_padded: int,
        is_padding: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Apply the staged writes, gather and compute the slot mappings in ONE backend call (one launch on the
        Triton backends, two for a row written in more than 8 overlap rounds; in graph mode, outside a capture, the
        consume launch and the stage launch): exactly `apply_staged_writes()`, `gather_block_tables(idx_mapping,
        num_reqs_padded, num_computed_tokens=num_computed_tokens)`, `compute_slot_mappings(idx_mapping,
        query_start_loc, positions, num_tokens_padded, is_padding)`. Inputs are checked first: a rejected call
        applies nothing and every staged write stays staged.

        Graph mode: inside `torch.cuda.graph(...)` this records the consume launch and the stage launch; the inputs
        must then be tensors on the tables' device (their values are read at each replay). Outside a capture it
        publishes and applies what is staged, then gathers and maps.

        Returns:
            (gathered tables, slot mappings), as the two methods return them.

        Raises:
            StageInputError, GraphCaptureError, and the errors of `apply_staged_writes`.
        """
        entry = self._mode.entry
        if entry is not None:
            got = entry.prepare(idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded,
                                is_padding, num_computed_tokens)  # fmt: skip
            if got is not None:
                return got
        step = self._mode.stage_call("prepare_inputs", True, True, None, None, idx_mapping, num_reqs_padded,
                                     query_start_loc, positions, num_tokens_padded, is_padding,
                                     num_computed_tokens)  # fmt: skip
        return step.gathered(self._layout), step.slots(self._layout)
