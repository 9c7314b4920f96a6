"""`TablesMode`: how one `BlockTables` runs its jobs, chosen once at its construction: `EagerMode`
(`multiwrite/tables/eager.py`) or `GraphMode` (`multiwrite/tables/graph.py`, `cuda_graphs=True`).

Every public call of the tables but the staging is one method of its mode, and every one of them starts with the
mode's one preamble, `enter`: the refusals of the mode (eager: a call that would apply during a CUDA graph
capture), the layout checks of what the call touches (the tables, the outputs: one read of a version counter
each when nothing was resized) and, every `ADDRESS_CHECK_PERIOD`-th call (every call with `check_addresses`), the
address check of all of them (`check_addresses`: none re-pointed, e.g. by `tensor.data = other`). What a call
checks is decided by the mode (per table, at construction), never by a test of the mode per call. The stage calls
then share one path (`stage_call`): the inputs (`StepInputs`: the engine's device inputs in a few attribute reads,
anything else checked in full), the job (`launch`, the mode's), and the rows of `input_block_tables` the gather
leaves non-zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.capture import is_capturing, refuse_capture
from multiwrite.errors import OWN_ERRORS, StageInputError
from multiwrite.plugins.backend import Backend, TablesPlan, backend_error
from multiwrite.stage.entry import StageEntry
from multiwrite.stage.layout import PAD_SLOT_ID, TablesLayout
from multiwrite.stage.step import StepInputs, check_count
from multiwrite.stage.torch_stage import run_stage_torch
from multiwrite.staging.arena import LayoutGuard, StagingArena
from multiwrite.staging.fields import Countdown
from multiwrite.staging.headers import CommitEntry

_PTR = torch.Tensor.data_ptr
#: Calls of the preamble per address check when checking is off (docs/lifecycle.md): a `Countdown`, whose truth test
#: is one C call (a few ns a call; the Python twin's, where the helper is not built, costs more).
ADDRESS_CHECK_PERIOD = 64


class TablesMode:
    """The jobs of one `BlockTables` (module docstring). A subclass implements `apply`, `commit`, `launch`, its
    capture policy (`refuses_capture`, `refuse_clear`) and `unapplied`; the preamble and the rest are shared.

    Args:
        backend: the tables' backend (for failures).
        plan: its plan for the tables (`TablesPlan`; a `GraphPlan` in graph mode).
        layout: the tables' memory.
        arena: the staging arena every group stages into.
        guard: the `LayoutGuard` of the tables and counts; outputs: that of `input_block_tables` and `slot_mappings`.
        num_blocks, applied, stamps: the host counts as staged, as of the last landed batch, and the batch stamps
            (`multiwrite.staging.block_ids`).
        names: the arena's table names (failures).
        check_addresses: keyword: check the addresses at every call (else every `ADDRESS_CHECK_PERIOD`-th).

    Attributes:
        plan, layout, arena, guard, outputs_guard: as given.
        dirty_rows: rows of `input_block_tables` the last gather (or dummy) may have left non-zero.
        entry: the compiled entry of the stage calls that apply nothing (`multiwrite.stage.entry`; eager mode on a
            plan with a `stage_launch_spec`), or None: every call runs `stage_call`.
        commit_entry: the compiled common case of `commit` (graph mode: `multiwrite.staging.headers.CommitEntry`), or
            None: every commit runs `commit`.
    """

    #: What `BlockTables.cuda_graphs` says.
    cuda_graphs = False
    #: Whether a call that applies is refused during a CUDA graph capture (eager: its batch is read by address).
    refuses_capture = False
    entry: StageEntry | None = None
    commit_entry: CommitEntry | None = None

    def __init__(
        self,
        backend: Backend,
        plan: TablesPlan,
        layout: TablesLayout,
        arena: StagingArena,
        guard: LayoutGuard,
        outputs: LayoutGuard,
        num_blocks: np.ndarray,
        applied: np.ndarray,
        stamps: np.ndarray,
        names: tuple[str, ...],
        *,
        check_addresses: bool = False,
    ) -> None:
        self.backend, self.plan, self.layout, self.arena = backend, plan, layout, arena
        self.guard, self.outputs_guard = guard, outputs
        self.device = layout.device
        self._num_blocks, self._applied, self._stamps, self._names = num_blocks, applied, stamps, names
        # (decided once: the version counters the guards' fast checks read; whether inputs may be device tensors)
        self._storage, self._outputs = guard.base, outputs.base
        self._gpu = layout.device_index >= 0
        self.dirty_rows = 0
        # true at the calls of the preamble that check the addresses
        self._countdown = Countdown(1 if check_addresses else ADDRESS_CHECK_PERIOD)
        self._tensors = guard.tensors + outputs.tensors  # (the address check's one pass over both)
        self._addresses = guard.addresses + outputs.addresses

    # -- the preamble -------------------------------------------------------------------------------------------
    def enter(self, call: str, applies: bool, outputs: bool) -> None:
        """The one preamble of every call: a mode that `refuses_capture` refuses a call that applies (`applies`)
        during a CUDA graph capture; when the countdown ends (every call with `check_addresses`, else every
        `ADDRESS_CHECK_PERIOD`-th), `check_addresses`; then the tables (with `outputs`, the outputs too) must not
        have been resized or moved: one read of a version counter each in the common case.

        Raises:
            GraphCaptureError: naming `call` (`"BlockTables.apply_staged_writes"`); nothing changed.
            StagedWriteError: naming the table or output resized or `set_` in place; nothing changed.
            TableMovedError: naming the table or output re-pointed; nothing changed.
        """
        if applies and self.refuses_capture:
            refuse_capture(self.device, call)
        if self._countdown:  # (first: a re-pointed tensor written since also fails the version check, less clearly)
            self.check_addresses(call)
        if self._storage._version != self.guard.version:
            self.guard.check()
        if outputs and self._outputs._version != self.outputs_guard.version:
            self.outputs_guard.check()

    def check_addresses(self, call: str) -> None:
        """The address check of these tables, the one of every call that makes it (the preamble, a capture, a
        `refresh_layout`): every table and output (`LayoutGuard.check_addresses`) still at its address of
        construction. Restarts the countdown of the preamble when it passes (a call it refuses leaves the next call
        checked too).

        Raises:
            TableMovedError: naming `call`, the tensor and both addresses; nothing changed.
        """
        if list(map(_PTR, self._tensors)) != self._addresses:  # (one pass over both; each guard names what moved)
            self.guard.check_addresses(call)
            self.outputs_guard.check_addresses(call)
        self._countdown.restart()

    # -- the jobs of a mode -------------------------------------------------------------------------------------
    def apply(self) -> None:
        """`BlockTables.apply_staged_writes`, its preamble included."""
        raise NotImplementedError

    def commit(self) -> int:
        """`BlockTables.commit_staged_writes`, its preamble included."""
        raise NotImplementedError

    def launch(self, step: StepInputs, apply_staged: bool, consume: bool) -> None:
        """The stage job of `step` (checked) into the tables' own outputs: with `apply_staged` the apply first;
        `consume`: the call is `prepare_inputs` (graph mode records its consume and stage launches together)."""
        raise NotImplementedError

    def unapplied(self) -> str | None:
        """After a failed job: what was published but not applied (graph mode), or None."""
        return None

    # -- the shared calls ---------------------------------------------------------------------------------------
    def stage_call(self, what: str, apply_staged: bool, consume: bool, gather_outs: Any, slots_out: Any, idx: Any,
                   padded: Any, qsl: Any, pos: Any, tokens: Any, pad: Any, nct: Any) -> StepInputs:  # fmt: skip
        """`gather_block_tables`, `compute_slot_mappings` and `prepare_inputs` (`consume`): the preamble, the inputs
        (`padded` None: no gather, `tokens` None: no slot mappings) and the job; returns the checked step.

        A job that gathers into `input_block_tables` (`step.do_gather`) also writes the rows the last gather (or
        dummy) left past this one's padded rows, zeroed (vLLM 0.33's rule; a captured gather bakes them in, as
        vLLM's capture would). The count of rows left non-zero moves only once the launch was issued: not when the
        job raises an `Exception` (raised as `failure`: it launched nothing), to the larger of both counts on an
        interrupt (which may come either side of the launch). Other outputs (`gather_outs`, `slots_out`) are
        written by torch ops, after an apply when `apply_staged`.

        Raises:
            StageInputError: bad inputs; and what `enter` and the job raise.
        """
        applies = consume or (apply_staged and self.arena.num_writes > 0)
        # (the name a refusal gives the call, built only where it may be refused)
        self.enter("BlockTables.prepare_inputs" if consume else f"BlockTables.{what}(apply_staged=True)" if applies
                   else what, applies, True)  # fmt: skip
        custom = gather_outs is not None or slots_out is not None
        step = None
        if self._gpu and not custom:  # (an engine's device inputs: in a few attribute reads)
            step = StepInputs.on_device(self.layout, idx, padded, qsl, pos, tokens, pad, nct)
        if step is None:
            step = self.check_inputs(what, idx, padded, qsl, pos, tokens, pad, nct, apply_staged or consume)
        if not custom:  # (the job: `launch`, which gathers into `input_block_tables` when `step.do_gather`)
            gather = step.do_gather
            dirty = self.dirty_rows
            if gather and dirty > step.num_rows:
                step.num_rows = dirty
            try:
                self.launch(step, apply_staged, consume)
            except Exception as exc:
                raise self.failure(exc) from exc
            except BaseException:
                if gather:
                    self.dirty_rows = max(dirty, step.num_reqs)
                raise
            if gather:
                self.dirty_rows = step.num_reqs
            return step
        layout = self.layout
        if gather_outs is not None:
            gather_outs = _gather_outputs(layout, what, gather_outs, step)
        if slots_out is not None:
            slots_out = _slot_output(layout, what, slots_out, step)
        if apply_staged:
            self.apply()
        self.run(lambda: run_stage_torch(layout, step, gather_outs, slots_out))
        return step

    def check_inputs(self, what: str, idx: Any, padded: Any, qsl: Any, pos: Any, tokens: Any, pad: Any, nct: Any,
                     staged: bool) -> StepInputs:  # fmt: skip
        """The inputs checked in full (`StepInputs.check`): host positions against the counts as staged (`staged`:
        the call applies first) or as last landed; during a capture only device inputs (a capture would bake the
        copy of a host input)."""
        counts = (lambda: self._num_blocks) if staged else self.landed_counts
        return StepInputs.check(self.layout, what, idx, padded, qsl, pos, tokens, pad, counts,
                                device_only=is_capturing(self.device), num_computed_tokens=nct)  # fmt: skip

    def dummy_block_tables(self, num_reqs: Any) -> tuple[torch.Tensor, ...]:
        """`BlockTables.get_dummy_block_tables`."""
        layout = self.layout
        n = check_count("get_dummy_block_tables: num_reqs", num_reqs, layout.max_num_reqs, "max_num_reqs")
        self.enter("BlockTables.get_dummy_block_tables", False, True)
        for t in layout.input_block_tables:
            t[: max(n, self.dirty_rows)].zero_()
        self.dirty_rows = n
        return layout.gathered(n)

    def dummy_slot_mappings(self, num_tokens: Any) -> torch.Tensor:
        """`BlockTables.get_dummy_slot_mappings`."""
        layout = self.layout
        if layout.slot_mappings is None:
            raise StageInputError(
                "get_dummy_slot_mappings: these BlockTables were built without max_num_batched_tokens, so they have no "
                "slot_mappings buffer"
            )
        assert layout.max_num_batched_tokens is not None
        n = check_count(
            "get_dummy_slot_mappings: num_tokens", num_tokens, layout.max_num_batched_tokens, "max_num_batched_tokens"
        )
        self.enter("BlockTables.get_dummy_slot_mappings", False, True)
        layout.slot_mappings.fill_(PAD_SLOT_ID)
        return layout.slots(n)

    def clear(self) -> None:
        """`BlockTables.clear_staged_writes` (after the mode's refusal, `refuse_clear`)."""
        self.refuse_clear()
        changed = np.flatnonzero(self._stamps[self.layout.num_groups] == self.arena.batch)
        self._num_blocks[:, changed] = self._applied[:, changed]
        self.arena.clear()

    def refuse_clear(self) -> None:
        """Raise where the mode refuses `clear` (eager: during a capture)."""

    def landed_counts(self) -> np.ndarray:
        """Host `num_blocks` as of the last landed batch (rows changed since come from the saved counts)."""
        changed = self._stamps[self.layout.num_groups] == self.arena.batch
        return np.where(changed[None, :], self._applied, self._num_blocks)

    def run(self, job: Callable[[], None]) -> None:
        """Run a backend job, its failure raised as `failure` (writes stay staged)."""
        try:
            job()
        except Exception as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: Exception) -> Exception:
        """What a failed job raises: multiwrite's own errors as they are (a refusal, a stalled ring), anything else
        as the `BackendError` naming the backend and the tables."""
        if isinstance(exc, OWN_ERRORS):
            return exc
        return backend_error(self.backend, self.device, self._names, self.arena.num_writes, exc, self.unapplied())


def _gather_outputs(layout: TablesLayout, what: str, outs: Any, step: StepInputs) -> list[torch.Tensor]:
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


def _slot_output(layout: TablesLayout, what: str, out: Any, step: StepInputs) -> torch.Tensor:
    """The caller's slot-mapping output, checked: int64 `[num_groups, >= num_tokens_padded]` on the tables' device."""
    G, T = layout.num_groups, step.num_tokens_padded
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.device == layout.device
            and out.dim() == 2 and out.shape[0] == G and out.shape[1] >= T):  # fmt: skip
        found = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        )
        raise StageInputError(f"{what}: out must be an int64 [{G}, >= {T}] tensor on {layout.device}, got {found}")
    return out
