"""`StageCalls`: the gather, slot-mapping and whole-step calls of `BlockTables` (vLLM 0.33's semantics), each one
backend call: checked inputs (`StepInputs`), then the plan, graph mode, or the generic torch stage for the caller's
outputs. A part of `BlockTables` (its base class), in a file of its own; it uses the attributes `BlockTables` builds,
declared here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from multiwrite.capture import is_capturing, refuse_capture
from multiwrite.errors import StageInputError
from multiwrite.plugins.backend import TablesPlan
from multiwrite.stage.layout import PAD_SLOT_ID, TablesLayout
from multiwrite.stage.step import StepInputs, check_count
from multiwrite.stage.torch_stage import run_stage_torch
from multiwrite.staging.arena import LayoutGuard, StagingArena
from multiwrite.tables.graph import GraphMode


class StageCalls:
    """The stage calls of `BlockTables` (module docstring)."""

    graph: GraphMode | None
    num_blocks: np.ndarray
    _layout: TablesLayout
    _plan: TablesPlan
    _device: torch.device
    _arena: StagingArena
    _guard: LayoutGuard
    _outputs_guard: LayoutGuard
    _storage: torch.Tensor
    _outputs: torch.Tensor
    _applied: np.ndarray
    _stamps: np.ndarray
    _dirty_rows: int

    # (BlockTables' own, used here)
    num_groups: int
    apply_staged_writes: Callable[[], None]
    _run: Callable[[Callable[[], None]], None]
    _failure: Callable[[Exception], Exception]

    # -- the calls ------------------------------------------------------------------------------------------------
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
        if out is None and self.graph is None:  # (the fast path of an engine's device inputs: `_fast_stage`)
            step = self._fast_stage(apply_staged, idx_mapping, num_reqs_padded, None, None, None, None,
                                    num_computed_tokens)  # fmt: skip
            if step is not None:
                return step.gathered(self._layout)
        step = self._stage("gather_block_tables", apply_staged, out, None, idx_mapping, num_reqs_padded,
                           num_computed_tokens=num_computed_tokens)  # fmt: skip
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
        if out is None and self.graph is None:
            step = self._fast_stage(apply_staged, idx_mapping, None, query_start_loc, positions, num_tokens_padded,
                                    is_padding, None)  # fmt: skip
            if step is not None:
                return step.slots(self._layout)
        step = self._stage("compute_slot_mappings", apply_staged, None, out, idx_mapping, None, query_start_loc,
                           positions, num_tokens_padded, is_padding)  # fmt: skip
        return step.slots(self._layout) if out is None else out[:, : step.num_tokens_padded]

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """Zero `input_block_tables[g][:num_reqs]` (and the rows the last gather left past them) and return those
        views (fixed addresses: what a CUDA graph of a dummy batch reads). The caller may write ids into them: the
        next gather zeroes the rows it does not fill.

        Raises:
            StageInputError: `num_reqs` outside `[0, max_num_reqs]`.
        """
        n = check_count("get_dummy_block_tables: num_reqs", num_reqs, self.max_num_reqs, "max_num_reqs")
        for t in self._layout.input_block_tables:
            t[: max(n, self._dirty_rows)].zero_()
        self._dirty_rows = n
        return self._layout.gathered(n)

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill the whole `slot_mappings` buffer with PAD (-1) and return `slot_mappings[:, :num_tokens]` (a fixed
        address).

        Raises:
            StageInputError: no slot_mappings buffer (built without `max_num_batched_tokens`), or `num_tokens` outside
                `[0, max_num_batched_tokens]`.
        """
        layout = self._layout
        if layout.slot_mappings is None:
            raise StageInputError(
                "get_dummy_slot_mappings: these BlockTables were built without max_num_batched_tokens, so they have no "
                "slot_mappings buffer"
            )
        assert layout.max_num_batched_tokens is not None
        n = check_count(
            "get_dummy_slot_mappings: num_tokens", num_tokens, layout.max_num_batched_tokens, "max_num_batched_tokens"
        )
        layout.slot_mappings.fill_(PAD_SLOT_ID)
        return layout.slots(n)

    def refresh_layout(self) -> None:
        """Rewrite what the device holds about the tables' addresses (the backend's descriptors), e.g. after the
        memory pool they were allocated from slept and woke and its contents were discarded. The tables' own
        contents are the caller's (re-stage them).

        Raises:
            GraphCaptureError: during a CUDA graph capture.
            BackendError: the backend failed to rewrite them.
        """
        refuse_capture(self.device, "BlockTables.refresh_layout")
        self._run(self._plan.refresh)

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
        graph = self.graph
        if graph is not None:  # (eager, it applies what is staged first: host positions see the staged counts)
            step = self._step("prepare_inputs", idx_mapping, num_reqs_padded, query_start_loc, positions,
                              num_tokens_padded, is_padding, staged=not is_capturing(self.device),
                              num_computed_tokens=num_computed_tokens)  # fmt: skip
            self._launch(lambda s: graph.stage(s, consume=True), step)
            return step.gathered(self._layout), step.slots(self._layout)
        refuse_capture(self._device, "BlockTables.prepare_inputs")
        if self._storage._version != self._guard.version:  # (one read when nothing was resized: the common case)
            self._guard.check()
        if self._outputs._version != self._outputs_guard.version:
            self._outputs_guard.check()
        layout = self._layout
        step = StepInputs.on_device(
            layout, idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded, is_padding,
            num_computed_tokens,
        ) or self._step("prepare_inputs", idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded,
                        is_padding, staged=True, num_computed_tokens=num_computed_tokens)  # fmt: skip
        self._launch(self._plan.prepare, step)
        gathered = layout.gathered_views.get(step.num_reqs_padded)
        slots = layout.slot_views.get(step.num_tokens_padded)
        return (step.gathered(layout) if gathered is None else gathered), (
            step.slots(layout) if slots is None else slots
        )

    # -- what every job shares ------------------------------------------------------------------------------------
    def _fast_stage(self, apply_staged: bool, idx, padded, qsl, pos, tokens, pad, nct) -> StepInputs | None:
        """A gather or slot mapping of tables without graph mode, into their own buffers, from an engine's device
        inputs (`StepInputs.on_device`), straight to the plan; None (nothing done) for anything else, which
        `_stage` then checks in full.

        It asks whether a capture is under way only when the call would apply writes: a stage it records reads
        everything by address, and the rows it zeroes (`num_rows`) only ever differ past the batch's padded rows."""
        if self._storage._version != self._guard.version:
            self._guard.check()
        if self._outputs._version != self._outputs_guard.version:
            self._outputs_guard.check()
        writes = apply_staged and self._arena.num_writes
        if writes and is_capturing(self._device):
            return None
        step = StepInputs.on_device(self._layout, idx, padded, qsl, pos, tokens, pad, nct)
        if step is None:
            return None
        self._launch(self._plan.prepare if writes else self._plan.stage, step)
        return step

    def _stage(self, what: str, apply_staged: bool, gather_outs, slots_out, *inputs, **named) -> StepInputs:
        """A gather or slot-mapping job (`what`; with `apply_staged`, the apply first) that `_fast_stage` did not
        take: its `inputs` checked in full (`_step`), host inputs copied to the device, then staged by graph mode
        (recorded during a capture, else run), into the caller's outputs by the torch stage, or by the backend's
        plan (eager, or recorded by a capture: the plan's stage launches read everything by address)."""
        graph = self.graph
        device = self._device
        capturing = is_capturing(device)
        if graph is None:
            if apply_staged and self._arena.num_writes:
                refuse_capture(device, f"BlockTables.{what}(apply_staged=True)")
            if self._storage._version != self._guard.version:
                self._guard.check()
            if self._outputs._version != self._outputs_guard.version:
                self._outputs_guard.check()
        layout = self._layout
        step = self._step(what, *inputs, staged=apply_staged, device_only=capturing, **named)
        if gather_outs is not None:
            gather_outs = _outputs(layout, what, gather_outs, step)
        if slots_out is not None:
            slots_out = _slot_output(layout, what, slots_out, step)
        if gather_outs is not None or slots_out is not None:  # (the caller's outputs: the generic torch stage)
            if apply_staged:
                self.apply_staged_writes()
            self._run(lambda: run_stage_torch(layout, step, gather_outs, slots_out))
        elif graph is not None:
            if apply_staged:
                self.apply_staged_writes()
            self._launch(lambda s: graph.stage(s, consume=False), step)
        else:
            self._launch(self._plan.prepare if apply_staged and self._arena.num_writes else self._plan.stage, step)
        return step

    def _launch(self, job: Callable[[StepInputs], None], step: StepInputs) -> None:
        """`job(step)`, a backend job that gathers into `input_block_tables` when `step.do_gather`. The rows it
        writes include those the last gather (or dummy) left past this one's padded rows, zeroed (vLLM 0.33's rule;
        a captured gather bakes them in, as vLLM's capture would). The count of rows it leaves non-zero moves only
        once the launch was issued: not when the job raises an `Exception` (raised as `_failure`: it launched
        nothing), to the larger of both counts on an interrupt (which may come either side of the launch)."""
        gather = step.do_gather
        dirty = self._dirty_rows
        if gather and dirty > step.num_rows:
            step.num_rows = dirty
        try:
            job(step)
        except Exception as exc:
            raise self._failure(exc) from exc
        except BaseException:
            if gather:
                self._dirty_rows = max(dirty, step.num_reqs)
            raise
        if gather:
            self._dirty_rows = step.num_reqs

    def _step(self, what: str, idx_mapping, num_reqs_padded=None, query_start_loc=None, positions=None,
              num_tokens_padded=None, is_padding=None, staged: bool = False, device_only: bool | None = None,
              num_computed_tokens=None) -> StepInputs:  # fmt: skip
        """The call's inputs, checked. Host positions are checked against the counts the tables will hold: as staged
        (`staged`: the call applies first) or as last landed. `device_only` (default: graph mode capturing): refuse
        host inputs (a capture would bake their copy)."""
        counts = (lambda: self.num_blocks) if staged else self._landed_counts
        if device_only is None:
            device_only = self.graph is not None and is_capturing(self.device)
        return StepInputs.check(self._layout, what, idx_mapping, num_reqs_padded, query_start_loc, positions,
                                num_tokens_padded, is_padding, counts, device_only=device_only,
                                num_computed_tokens=num_computed_tokens)  # fmt: skip

    def _landed_counts(self) -> np.ndarray:
        """Host `num_blocks` as of the last landed batch (rows changed since come from the saved counts)."""
        changed = self._stamps[self.num_groups] == self._arena.batch
        return np.where(changed[None, :], self._applied, self.num_blocks)


def _outputs(layout: TablesLayout, what: str, outs, step: StepInputs) -> list[torch.Tensor]:
    """The caller's gather outputs, checked: one int32 `[>= num_reqs_padded, width_g]` tensor per group on the
    tables' device, rows contiguous."""
    if isinstance(outs, torch.Tensor) or not isinstance(outs, Sequence) or len(outs) != layout.num_groups:
        raise StageInputError(f"{what}: out must be a sequence of {layout.num_groups} tensors, one per KV-cache group")
    for g, (t, w) in enumerate(zip(outs, layout.widths)):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device == layout.device and t.dim() == 2
                and t.shape[0] >= step.num_reqs_padded and t.shape[1] == w and t.stride(1) == 1):  # fmt: skip
            found = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise StageInputError(
                f"{what}: out[{g}] must be an int32 [>= {step.num_reqs_padded}, {w}] tensor with contiguous rows on "
                f"{layout.device}, got {found}"
            )
    return list(outs)


def _slot_output(layout: TablesLayout, what: str, out, step: StepInputs) -> torch.Tensor:
    """The caller's slot-mapping output, checked: int64 `[num_groups, >= num_tokens_padded]` on the tables' device."""
    G, T = layout.num_groups, step.num_tokens_padded
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.device == layout.device
            and out.dim() == 2 and out.shape[0] == G and out.shape[1] >= T):  # fmt: skip
        found = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        )
        raise StageInputError(f"{what}: out must be an int64 [{G}, >= {T}] tensor on {layout.device}, got {found}")
    return out
