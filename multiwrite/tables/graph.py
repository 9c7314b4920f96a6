"""`GraphMode`: what a `BlockTables(..., cuda_graphs=True)` runs, so that its stage can be captured in a CUDA graph.

Every batch is published into a `HeaderRing` (host work: a few stores into pinned memory) and applied by the
plan's consume kernel, whose launch has fixed arguments. `commit()` publishes the staged batch with a ticket: the
batch of the next replay. A replay applies, in order, every header not yet applied up to its own ticket's header,
or nothing when its ticket is not published; an eager apply publishes what is staged (no ticket) and applies every
header published so far. So headers land exactly once and in commit order, and, with one commit before each
replay, a replay queued behind a busy stream never applies a batch committed after it was issued, whatever eager
applies happen in between. Pairing is by count: the device records a replay that finds its ticket unpublished and an
eager run that finds commits no replay was issued for, and the next commit or eager apply raises
`GraphProtocolError` (once per fault, before it changes anything; the pairing is restored by then).
docs/graph-mode.md is the protocol with its conditions and reasons.
"""

from __future__ import annotations

from typing import Any

from multiwrite.capture import capture_id, is_capturing, settle
from multiwrite.errors import GraphCaptureError, GraphProtocolError
from multiwrite.plugins.backend import Backend, GraphPlan
from multiwrite.stage.layout import TablesLayout
from multiwrite.stage.step import StepInputs
from multiwrite.staging.arena import LayoutGuard, StagingArena
from multiwrite.staging.headers import INLINE_VALUES, INLINE_WRITES, HeaderRing, commit_entry
from multiwrite.staging.wait import wait_until
from multiwrite.tables.mode import TablesMode

#: Graph-mode state of every `BlockTables` whose launches were captured: a CUDA graph may outlive its
#: `BlockTables` and keeps reading this memory at every replay, so it is kept until the process ends.
_CAPTURED: list[GraphMode] = []


class GraphMode(TablesMode):
    """The graph mode of one `BlockTables` (module docstring): its header ring and what its captures recorded. The
    arguments are `TablesMode`'s; `plan` is the backend's `GraphPlan`, the arena's lender lends memory the kernels
    read in place, and the guards keep what captured launches read and write by address from moving.

    Attributes:
        ring: the `HeaderRing` (its `published`, `tickets_published`, `applied`, `runs`, `idle_runs`, `rereads`,
            `missed`, `extra` counts tell where the protocol stands).
        recordings: what each capture recorded (inputs read by address at every replay), alive as long as this
            object.
        commit_entry: `commit`'s common case in one compiled call (`multiwrite.staging.headers.CommitEntry`).
    """

    cuda_graphs = True

    def __init__(self, backend: Backend, plan: GraphPlan, layout: TablesLayout, arena: StagingArena,
                 guard: LayoutGuard, outputs: LayoutGuard, *counts: Any,
                 check_addresses: bool = False) -> None:  # fmt: skip
        super().__init__(backend, plan, layout, arena, guard, outputs, *counts, check_addresses=check_addresses)
        self.plan: GraphPlan = plan
        self.ring = HeaderRing(plan.header_depth, layout.device)
        self.commit_entry = commit_entry(self._countdown, guard, outputs, self.ring, arena)
        self.recordings: list[Any] = []
        self._eager_limit = 0  # headers an eager launch has been asked to apply
        self._stranded = False  # an eager call published a batch and its consume launch did not happen
        self._consume_capture: object = None  # the capture that recorded this object's consume launch last
        plan.consume(self.ring, 0)  # compiles and loads the consume kernel now, never inside a capture
        settle(layout.device)
        arena.refusal = (
            "belongs to a BlockTables created with cuda_graphs=True: its writes are applied in commit order by "
            "BlockTables.apply_staged_writes() or a graph replay, never by a writer directly"
        )

    # -- publishing ---------------------------------------------------------------------------------------------
    def publish(self, ticketed: bool = True, call: str = "commit_staged_writes") -> int:
        """Publish the staged batch as the next header (with a ticket: the batch of the next replay). Returns the
        header's index. `call`: the BlockTables method it runs for (messages).

        Waits while the header ring (or, ticketed, the ticket ring; or, for a batch that stays in its lease, the
        next lease) is full of what no run has consumed: `RingWaitWarning` after 1 s, `RingStallError` after 10 s
        (after a device synchronization, except during a capture). Nothing is published then and every write
        stays staged. Past the common case (one compiled call), a batch an eager call published without launching
        its consume (the launch failed) is applied first, outside a capture (one launch): the commit could otherwise
        wait for memory it holds, which no replay frees.

        Raises:
            GraphProtocolError: (ticketed) the device recorded a mis-pairing not reported yet; nothing is published.
        """
        arena, ring = self.arena, self.ring
        h = ring.commit(arena, ticketed)  # the common case in one call: an inline batch (or none), room in the ring
        if h is not None:
            return h
        if ticketed:  # (an eager call checks when it starts: what its own launches find is the next call's report)
            self.check_pairing(call)
        device = self.layout.device
        if self._stranded and ticketed and not is_capturing(device):
            self._apply_published()
        w = arena.num_writes
        rounds = 1
        if w and arena.may_overlap:  # later writes to one (table, row) land in later rounds
            rounds = arena.order_rounds()
        inline = 0 < w <= INLINE_WRITES and rounds == 1 and arena.num_values <= INLINE_VALUES
        if not ring.entry_free():
            wait_until(ring.entry_free, lambda why: self._full("a free header entry", why, call), device)
        if ticketed and not ring.ticket_free():
            wait_until(ring.ticket_free, lambda why: self._full("a free ticket", why, call), device)
        lease = None
        if w and not inline:
            lease = arena.next_lease(lambda why: self._full("a free staging slot", why, call))
            if lease is not None:
                arena.lender.handed_over(arena.lease)  # the consume kernel reads it: its slot's word guards it
        published = ring.published
        try:
            return ring.publish(arena, lease, ticketed, rounds)
        except BaseException:
            if lease is not None and ring.published == published:  # not published: the lease goes back
                arena.lender.release(lease)
            raise

    def _full(self, what: str, why: str, call: str) -> str:
        ring = self.ring
        waiting = ring.tickets_published - ring.runs
        if waiting >= 0:
            tickets = f"{waiting} tickets wait for their replay"
        else:  # (a replay that found no ticket still counts as a run; the next commit takes the next run's ticket)
            tickets = (f"no ticket waits for its replay ({-waiting} more replays have run than commits were made: "
                       "replays without their commit, which applied nothing)")  # fmt: skip
        if call == "commit_staged_writes":
            advice = (
                "Each graph replay applies the batch of ONE commit and an eager apply_staged_writes() all of them: "
                "commit once right before each replay; if replays are queued, the stream they run on is held up. "
                "Nothing was committed"
            )
        else:
            advice = (
                f"{call}() has launched the consume kernel for the published batches first, and it has not run: the "
                "stream it was launched on is held up by the work queued before it (queued replays, other "
                "kernels). Nothing of this call was published"
            )
        return (
            f"{call} (header {ring.published}) {why} for {what} of the graph-mode header ring ({ring.depth} entries) "
            f"of BlockTables on {self.layout.device}: {ring.published - ring.applied} published batches are not "
            f"applied and {tickets}. {advice}; the staged writes stay staged."
        )

    def check_pairing(self, call: str) -> None:
        """Raise `GraphProtocolError` (once) if the device recorded a mis-pairing of commits and replays that no
        call has reported yet (its pinned mirror, as last stored: a fault shows once the device has run it).

        Args:
            call: the BlockTables method that asks, for the message.
        """
        ring = self.ring
        missed, extra = ring.missed, ring.extra
        new_missed, new_extra = missed - ring.missed_seen, extra - ring.extra_seen
        if not (new_missed or new_extra):
            return
        last, first = ring.last_missed, ring.first_extra  # (stored before the counts)
        faults = []
        if new_missed == 1:
            faults.append(f"replay {last} (replays count from 0) found no commit for it: its ticket was not published "
                          "when it ran, so it applied nothing")  # fmt: skip
        elif new_missed:
            faults.append(f"{new_missed} replays found no commit for them (the last: replay {last}, counting from 0): "
                          "their tickets were not published when they ran, so they applied nothing")  # fmt: skip
        if new_extra:
            h = ring.ticket_header(first)
            which = f"commit {first} (counting commits from 0)" + ("" if h is None else f", header {h},")
            more = "" if new_extra == 1 else f" and the {new_extra - 1} commits after it"
            faults.append(f"{which}{more} had no replay issued before the eager apply_staged_writes() or "
                          "prepare_inputs() that ran after them (a commit without its replay, or an eager call "
                          "between a commit and its replay); that eager call applied their batches")  # fmt: skip
        ring.missed_seen, ring.extra_seen = missed, extra
        raise GraphProtocolError(
            f"{call} of graph-mode BlockTables on {self.layout.device}: commits and replays are mis-paired: "
            f"{'; '.join(faults)}. Commit exactly once right before each replay (also with nothing staged), with no "
            "eager apply between the commit and its replay; a warm-up replay needs its commit too. The pairing is "
            "restored: the next commit is the batch of the next replay to run. Nothing was published by this call; "
            "the staged writes stay staged and every published batch still lands (docs/graph-mode.md)",
            new_missed, last if new_missed else None, new_extra, first if new_extra else None,
        )  # fmt: skip

    # -- the BlockTables methods in graph mode ------------------------------------------------------------------
    def apply(self) -> None:
        """`BlockTables.apply_staged_writes`: `apply_staged_writes`, its failure raised as `failure`."""
        self.enter("BlockTables.apply_staged_writes", True, False)
        self.run(self.apply_staged_writes)

    def commit(self) -> int:
        """`BlockTables.commit_staged_writes`: `publish` with a ticket (the outputs checked too: captured stage
        launches write them)."""
        self.enter("BlockTables.commit_staged_writes", False, True)
        return self.publish()

    def launch(self, step: StepInputs, apply_staged: bool, consume: bool) -> None:
        """`stage(step, consume)`, after `apply_staged_writes` when `apply_staged` alone."""
        if apply_staged and not consume:
            self.apply_staged_writes()
        self.stage(step, consume)

    def apply_staged_writes(self, call: str = "apply_staged_writes") -> None:
        """Capturing: record the consume launch (each replay applies its ticket's batch); nothing is committed; a
        second consume launch in one capture is refused (`GraphCaptureError`). Otherwise: publish what is staged and
        apply every published batch now (one launch; two when the publish could wait for memory a published batch
        holds: those are applied first). `call`: the BlockTables method it runs for (messages).

        Raises:
            GraphProtocolError: (eager) a mis-pairing the device recorded; nothing is published.
            GraphCaptureError: a second consume launch in one capture; nothing is recorded.
        """
        if is_capturing(self.layout.device):
            self.check_addresses(f"BlockTables.{call} (captured)")  # (a graph keeps these addresses for good)
            key = self._consume_key(call)
            self._keep()
            self.plan.consume(self.ring, -1)
            self._consume_capture = key
            return
        self.check_pairing(call)
        arena, ring = self.arena, self.ring
        if arena.num_writes:
            if (arena.may_overlap or arena.num_writes > INLINE_WRITES or arena.num_values > INLINE_VALUES
                    or not ring.entry_free()):  # fmt: skip
                # The publish may wait for a header entry or a staging slot that a published batch holds (one not
                # replayed yet): apply those first, so that it waits only for that launch.
                self._apply_published()
            published = ring.published
            try:
                self.publish(False, call)
            finally:
                if ring.published != published:
                    self._stranded = True
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
        """Launch the consume kernel for every header published so far, unless one was asked to already or the device
        has applied them all."""
        ring = self.ring
        published = ring.published
        if published > self._eager_limit and ring.applied < published:
            self.plan.consume(ring, published)
            self._eager_limit = published
        self._stranded = False

    def stage(self, step: StepInputs, consume: bool) -> None:
        """Capturing: record the stage of `step` (after the consume launch if `consume`). Otherwise: apply first if
        `consume` (as `apply_staged_writes`), then run the stage now. (The preamble checked the layout.)"""
        if is_capturing(self.layout.device):
            self.check_addresses("BlockTables.prepare_inputs (captured)" if consume
                                 else "a captured gather or slot-mapping call")  # fmt: skip
            key = self._consume_key("prepare_inputs") if consume else None
            self._keep()
            self.recordings.append((step, self.plan.record_stage(self.ring, step, consume)))
            if consume:
                self._consume_capture = key
            return
        if consume:
            self.apply_staged_writes("prepare_inputs")
        self.plan.stage(step)

    def _consume_key(self, call: str) -> object:
        """The capture under way (`capture_id`), refused when it has recorded a consume launch of these tables."""
        key = capture_id(self.layout.device)
        if key is not None and key == self._consume_capture:
            raise GraphCaptureError(
                f"{call} on graph-mode BlockTables on {self.layout.device} during a CUDA graph capture that has "
                "already recorded their consume launch (by apply_staged_writes() or prepare_inputs()): a second one "
                "would take the ticket of a second commit at every replay. Record one of them per graph "
                "(prepare_inputs applies too; gather_block_tables and compute_slot_mappings record the stage alone). "
                "Nothing was recorded; the staged writes stay staged."
            )
        return key

    def _keep(self) -> None:
        """A capture reads this memory at every replay, perhaps after the `BlockTables` is gone: keep it."""
        if not any(g is self for g in _CAPTURED):
            _CAPTURED.append(self)
