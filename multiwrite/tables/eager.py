"""`EagerMode`: what a `BlockTables` without graph mode runs. Every job is one call of the backend's plan, enqueued
at once: `apply()` -> `plan.apply()`, a stage call -> `plan.stage(step)`, or `plan.prepare(step)` when it applies
first (one launch on the Triton backends). None of them may be recorded into a CUDA graph when it applies: the
apply reads its batch from staging memory by address, so its preamble refuses it during a capture."""

from __future__ import annotations

from typing import Any

from multiwrite.capture import refuse_capture
from multiwrite.errors import StagedWriteError
from multiwrite.stage.entry import stage_entry
from multiwrite.stage.step import StepInputs
from multiwrite.tables.mode import TablesMode


class EagerMode(TablesMode):
    """The eager mode of one `BlockTables` (module docstring; the arguments are `TablesMode`'s)."""

    refuses_capture = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (a stage call applying nothing, as an engine makes it on a GPU: in one compiled call, `stage_call` else)
        self.entry = stage_entry(self, self._countdown, self.guard, self.outputs_guard, self.failure,
                                 self.plan.stage_launch_spec())  # fmt: skip

    def apply(self) -> None:
        """Refused during a capture; one `plan.apply()` when anything is staged (the common case in one compiled
        call: `entry.apply()`; None from it: nothing done)."""
        entry = self.entry
        if entry is not None and entry.apply():
            return
        self.enter("BlockTables.apply_staged_writes", True, False)
        if self.arena.num_writes:
            try:
                self.plan.apply()
            except Exception as exc:
                raise self.failure(exc) from exc

    def commit(self) -> int:
        """Refused: eager tables have no commits."""
        raise StagedWriteError(
            "commit_staged_writes() is for tables created with BlockTables(..., cuda_graphs=True); these apply "
            "with apply_staged_writes(). Nothing was committed; the staged writes stay staged"
        )

    def launch(self, step: StepInputs, apply_staged: bool, consume: bool) -> None:
        """`plan.prepare(step)` when the call applies and anything is staged, else `plan.stage(step)` (during a
        capture only the latter: the preamble refused the former)."""
        plan = self.plan
        if (apply_staged or consume) and self.arena.num_writes:
            plan.prepare(step)
        else:
            plan.stage(step)

    def refuse_clear(self) -> None:
        """`GraphCaptureError` during a CUDA graph capture, nothing dropped (docs/lifecycle.md)."""
        refuse_capture(self.device, "BlockTables.clear_staged_writes")
