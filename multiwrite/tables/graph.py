"""`GraphMode`: what a `BlockTables(..., cuda_graphs=True)` runs, so that its stage can be captured in a CUDA graph.

Every batch is published into a `HeaderRing` (host work: a few stores into pinned memory) and applied by the
plan's consume kernel, whose launch has fixed arguments. `commit()` publishes the staged batch with a ticket: the
batch of the next replay. A replay applies, in order, every header not yet applied up to its own ticket's header,
or nothing when its ticket is not published; an eager apply publishes what is staged (no ticket) and applies every
header published so far. So headers land exactly once and in commit order, and, with one commit before each
replay, a replay queued behind a busy stream never applies a batch committed after it was issued, whatever eager
applies happen in between. docs/graph-mode.md is the protocol with its conditions and reasons.
"""

from __future__ import annotations

from typing import Any

from multiwrite.capture import is_capturing, settle
from multiwrite.plugins.backend import GraphPlan
from multiwrite.stage.layout import TablesLayout
from multiwrite.stage.step import StepInputs
from multiwrite.staging.arena import LayoutGuard, StagingArena
from multiwrite.staging.headers import INLINE_VALUES, INLINE_WRITES, HeaderRing
from multiwrite.staging.wait import wait_until

#: Graph-mode state of every `BlockTables` whose launches were captured: a CUDA graph may outlive its
#: `BlockTables` and keeps reading this memory at every replay, so it is kept until the process ends.
_CAPTURED: list[GraphMode] = []


class GraphMode:
    """The graph mode of one `BlockTables` (module docstring): its header ring and what its captures recorded.

    Args:
        plan: the backend's `GraphPlan` for the tables.
        layout: the tables' memory.
        arena: the staging arena (its lender lends memory the kernels read in place).
        guard: the tables' `LayoutGuard` (captured launches read them by address: they must never move).
        outputs: the outputs' `LayoutGuard` (captured stage launches write them by address).

    Attributes:
        ring: the `HeaderRing` (its `published`, `tickets_published`, `applied`, `runs`, `idle_runs`, `rereads`
            counts tell where the protocol stands).
        recordings: what each capture recorded (inputs read by address at every replay), alive as long as this
            object.
    """

    def __init__(
        self, plan: GraphPlan, layout: TablesLayout, arena: StagingArena, guard: LayoutGuard, outputs: LayoutGuard
    ) -> None:
        self.plan = plan
        self.layout = layout
        self.arena = arena
        self.guard = guard
        self.outputs_guard = outputs
        self.ring = HeaderRing(plan.header_depth, layout.device)
        self.recordings: list[Any] = []
        self._eager_limit = 0  # headers an eager launch has been asked to apply
        plan.consume(self.ring, 0)  # compiles and loads the consume kernel now, never inside a capture
        settle(layout.device)
        arena.refusal = (
            "belongs to a BlockTables created with cuda_graphs=True: its writes are applied in commit order by "
            "BlockTables.apply_staged_writes() or a graph replay, never by a writer directly"
        )

    # -- publishing ---------------------------------------------------------------------------------------------
    def commit(self, ticketed: bool = True) -> int:
        """Publish the staged batch as the next header (with a ticket: the batch of the next replay). Returns the
        header's index.

        Waits while the header ring (or, ticketed, the ticket ring; or, for a batch that stays in its lease, the
        next lease) is full of what no run has consumed: `RingWaitWarning` after 1 s, `RingStallError` after 10 s
        (after a device synchronization, except during a capture). Nothing is published then and every write
        stays staged.
        """
        arena, ring = self.arena, self.ring
        h = ring.commit(arena, ticketed)  # the common case in one call: an inline batch (or none), room in the ring
        if h is not None:
            return h
        w = arena.num_writes
        rounds = 1
        if w and arena.may_overlap:  # later writes to one (table, row) land in later rounds
            rounds = arena.order_rounds()
        inline = 0 < w <= INLINE_WRITES and rounds == 1 and arena.num_values <= INLINE_VALUES
        device = self.layout.device
        if not ring.entry_free():
            wait_until(ring.entry_free, lambda why: self._full("a free header entry", why), device)
        if ticketed and not ring.ticket_free():
            wait_until(ring.ticket_free, lambda why: self._full("a free ticket", why), device)
        lease = arena.next_lease(lambda why: self._full("a free staging slot", why)) if w and not inline else None
        published = ring.published
        try:
            return ring.publish(arena, lease, ticketed, rounds)
        except BaseException:
            if lease is not None and ring.published == published:  # not published: the lease goes back
                arena.lender.release(lease)
            raise

    def _full(self, what: str, why: str) -> str:
        ring = self.ring
        return (
            f"commit_staged_writes (header {ring.published}) {why} for {what} of the graph-mode header ring "
            f"({ring.depth} entries) of BlockTables on {self.layout.device}: {ring.published - ring.applied} "
            f"published batches are not applied and {ring.tickets_published - ring.runs} tickets wait for their "
            "replay. Each graph replay applies the batch of ONE commit and an eager apply_staged_writes() all of "
            "them: commit once before each replay; if replays are queued, the stream they run on is held up. "
            "Nothing was committed; the staged writes stay staged."
        )

    # -- the BlockTables methods in graph mode ------------------------------------------------------------------
    def apply_staged_writes(self) -> None:
        """Capturing: record the consume launch (each replay applies its ticket's batch); nothing is committed.
        Otherwise: publish what is staged and apply every published batch now (one launch)."""
        self.guard.check()
        if is_capturing(self.layout.device):
            self._keep()
            self.plan.consume(self.ring, -1)
            return
        ring = self.ring
        if self.arena.num_writes:
            if not ring.entry_free():  # apply what is published first, so that the commit waits only for that
                self._apply_published()
            self.commit(ticketed=False)
        self._apply_published()

    def unapplied(self) -> str | None:
        """After a failed eager job: what was committed but not applied (the next eager apply or replay applies it),
        or None when nothing is."""
        ring = self.ring
        waiting = ring.published - ring.applied
        if waiting <= 0:
            return None
        return (
            f"{waiting} committed batches are not applied yet (the writes this call published among them): they stay "
            "committed, and the next apply_staged_writes() or replay applies them in commit order"
        )

    def _apply_published(self) -> None:
        published = self.ring.published
        if published > self._eager_limit:
            self.plan.consume(self.ring, published)
            self._eager_limit = published

    def stage(self, step: StepInputs, consume: bool) -> None:
        """Capturing: record the stage of `step` (after the consume launch if `consume`). Otherwise: apply first if
        `consume` (as `apply_staged_writes`), then run the stage now."""
        self.outputs_guard.check()
        if is_capturing(self.layout.device):
            self.guard.check()
            self._keep()
            self.recordings.append((step, self.plan.record_stage(self.ring, step, consume)))
            return
        if consume:
            self.apply_staged_writes()
        else:
            self.guard.check()
        self.plan.stage(step)

    def _keep(self) -> None:
        """A capture reads this memory at every replay, perhaps after the `BlockTables` is gone: keep it."""
        if not any(g is self for g in _CAPTURED):
            _CAPTURED.append(self)
