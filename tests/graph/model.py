"""What the device must hold after every commit, replay and eager apply of a graph-mode `BlockTables`: the model the
graph room's tests check the real tables against.

The tables are `triton-cuda` tables on the CPU: their kernels run through Triton's interpreter, and a capture is
`multiwrite.capture.simulated_capture()` (what it records runs at each `graph.replay()`, as a CUDA graph replay runs
what it captured). The protocol the model follows (docs/graph-mode.md):

- a commit publishes the staged batch as the next header WITH a ticket: the one after the last, or, when more
  replays have run than tickets were published, the ticket of the next replay to run;
- replay `r` applies every header not yet applied up to ticket `r`'s header, or nothing when ticket `r` is not
  published when it runs (then it counts as missed: a mis-pairing);
- an eager `apply_staged_writes()` publishes what is staged (no ticket) and applies every header published so far;
  when fewer replays have run than tickets were published, it counts the difference as extra (a mis-pairing) and
  sets the runs to the tickets. The next commit or eager apply then raises `GraphProtocolError`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.capture import simulated_capture
from multiwrite.errors import GraphProtocolError
from multiwrite.reference import ReferenceBlockTables
from multiwrite.testing.staging import block_tables_class
from tests.support.tables import host

CPU = torch.device("cpu")
#: Three groups, kernel blocks 16/16/8 (group 1 writes each block id b as 2b, 2b + 1), small tables.
BS, KBS, WIDTHS, REQS = [16, 32, 8], [16, 16, 8], [5, 4, 6], 6

State = tuple[list[np.ndarray], np.ndarray]  # (tables, num_blocks) as the reference holds them


def graph_tables(ring_depth: int = 8, reqs: int = REQS, widths=WIDTHS, staging: str = "default", **kw):
    """A graph-mode `BlockTables` of the BS/KBS groups on a backend instance of its own (`ring_depth` staging slots
    per ring; the header ring has the next power of two >= that many entries)."""
    cls = block_tables_class(staging)
    return cls(BS, reqs, widths, CPU, KBS, backend=TritonCudaBackend(ring_depth=ring_depth), cuda_graphs=True, **kw)


class GraphModel:
    """A graph-mode `BlockTables` whose `apply_staged_writes()` was captured once (simulated), beside its reference
    and the state the device must hold (module docstring)."""

    def __init__(self, ring_depth: int = 8, reqs: int = REQS, widths=WIDTHS, staging: str = "default", **kw):
        self.bt = graph_tables(ring_depth, reqs, widths, staging, **kw)
        self.widths = list(widths)
        with simulated_capture() as graph:
            self.bt.apply_staged_writes()  # records the consume launch; commits nothing
        self.graph = graph
        self.ref = ReferenceBlockTables(BS, reqs, widths, KBS)
        self.headers: list[State] = []  # the reference state each published header leaves
        self.tickets: list[int | None] = []  # the header of each ticket (None: a ticket no commit took)
        self.applied = 0  # headers the device has applied
        self.runs = 0  # replays run (and, after an eager run that found commits with no replay, those commits)
        self.idle = 0  # replays that applied nothing
        self.missed = 0  # replays that found their ticket unpublished
        self.extra = 0  # tickets eager runs found with no replay
        self.reported = (0, 0)  # (missed, extra) as a GraphProtocolError last reported them
        self.staged = False  # something is staged since the last commit / eager apply / clear
        self.device: State = self._snapshot()  # what the device tables hold

    # -- what a host does --------------------------------------------------------------------------------------
    def stage(self, req: int, ids, overwrite: bool) -> None:
        self.bt.append_block_ids(req, ids, overwrite)
        self.ref.append_block_ids(req, ids, overwrite)
        self.staged |= overwrite or any(len(i) for i in ids)

    def commit(self) -> int:
        assert not self.report_due(), "the commit would raise GraphProtocolError: expect_report() first"
        return self.committed(self.bt.commit_staged_writes())

    def committed(self, h: int) -> int:
        """Record a commit the test made itself (it returned header `h`)."""
        assert h == len(self.headers), (h, len(self.headers))
        self.ref.apply_staged_writes()  # what a clear returns to from now on
        self.headers.append(self._snapshot())
        self.tickets += [None] * (max(len(self.tickets), self.runs) - len(self.tickets))
        self.tickets.append(h)
        self.staged = False
        return h

    def replay(self) -> None:
        self.graph.replay()
        self.replayed()

    def replayed(self) -> None:
        """Record a replay of `self.graph` that ran (e.g. on another thread)."""
        r, self.runs = self.runs, self.runs + 1
        h = self.tickets[r] if r < len(self.tickets) else None
        if h is None:
            self.missed += 1
        if h is not None and h + 1 > self.applied:
            self.applied = h + 1
            self.device = self.headers[self.applied - 1]
        else:
            self.idle += 1

    def eager_apply(self) -> None:
        assert not self.report_due(), "the eager apply would raise GraphProtocolError: expect_report() first"
        self.bt.apply_staged_writes()
        self.ref.apply_staged_writes()
        if self.staged:
            self.headers.append(self._snapshot())
            self.staged = False
        self.eager_run()

    def published_eagerly(self) -> None:
        """Record an eager publish the test made itself whose consume launch did not run (no ticket)."""
        self.ref.apply_staged_writes()
        self.headers.append(self._snapshot())
        self.staged = False

    def eager_run(self) -> None:
        """Record an eager consume run: every header published lands; commits no replay was issued for are extra."""
        if self.applied < len(self.headers):  # (a launch: it finds the commits no replay was issued for)
            self.applied = len(self.headers)
            self.device = self.headers[-1]
            if self.runs < len(self.tickets):
                self.extra += len(self.tickets) - self.runs
                self.runs = len(self.tickets)

    def clear(self) -> None:
        self.bt.clear_staged_writes()
        self.ref.clear_staged_writes()
        self.staged = False

    def report_due(self) -> bool:
        """The device recorded a mis-pairing that no call has reported yet: the next commit or eager apply raises."""
        return (self.missed, self.extra) != self.reported

    def expect_report(self, call: str = "commit") -> GraphProtocolError:
        """The next `call` ("commit" or "eager") raises GraphProtocolError, changing nothing (checked), once: the
        same call then works. Returns the error."""
        assert self.report_due()
        before = [host(t.tensor).copy() for t in self.bt.block_tables], self.bt.num_blocks.copy()
        staged = [t.num_staged_writes for t in self.bt.block_tables]
        published = self.bt.graph.ring.published
        with pytest.raises(GraphProtocolError) as info:
            (self.bt.commit_staged_writes if call == "commit" else self.bt.apply_staged_writes)()
        assert self.bt.graph.ring.published == published and staged == [t.num_staged_writes for t in
                                                                          self.bt.block_tables]  # fmt: skip
        for g, t in enumerate(self.bt.block_tables):
            np.testing.assert_array_equal(host(t.tensor), before[0][g], err_msg=f"group {g} changed")
        np.testing.assert_array_equal(self.bt.num_blocks, before[1])
        err = info.value
        assert (err.replays_without_commit, err.commits_without_replay) == (
            self.missed - self.reported[0], self.extra - self.reported[1])  # fmt: skip
        self.reported = (self.missed, self.extra)
        return err

    # -- checks ------------------------------------------------------------------------------------------------
    def _snapshot(self) -> State:
        return [t.copy() for t in self.ref.tables], self.ref.num_blocks.copy()

    def check(self, where: str = "") -> None:
        """The device tables and `num_blocks_device` hold exactly the state of the last applied header, the host
        counts are the staged ones, and the ring's counts agree with the model's."""
        tables, counts = self.device
        for g, t in enumerate(self.bt.block_tables):
            np.testing.assert_array_equal(host(t.tensor), tables[g], err_msg=f"{where} group {g}")
        np.testing.assert_array_equal(host(self.bt.num_blocks_device), counts, err_msg=f"{where} num_blocks_device")
        np.testing.assert_array_equal(self.bt.num_blocks, self.ref.num_blocks, err_msg=f"{where} host num_blocks")
        ring = self.bt.graph.ring
        assert (ring.published, ring.tickets_published, ring.applied, ring.runs, ring.idle_runs, ring.missed,
                ring.extra) == (len(self.headers), len(self.tickets), self.applied, self.runs, self.idle,
                                self.missed, self.extra), where  # fmt: skip

    def can_commit(self) -> bool:
        """A commit would not wait: a free header entry and a free ticket."""
        depth = self.bt.graph.ring.depth
        return len(self.headers) - self.applied < depth and len(self.tickets) - self.runs < depth


#: Rows of 143 values when full (the kernel blocks of three groups and a counts row): `fill` stages them.
WIDE = [40, 20, 60]


def fill(m: GraphModel, rows, seed: int, twice: bool = True) -> None:
    """Stage full rows (overwrites with fresh ids) into `rows`, 143 values per row; `twice`: the first row overwritten
    again last, so that the writes overlap: a batch of two rounds, which stays in its staging slot whatever its size
    (a decode-sized batch travels in its header)."""
    rng = np.random.default_rng(seed)
    rows = list(rows)
    for r in rows + rows[:1] * twice:
        m.stage(r, [rng.integers(1, 10_000, w).tolist() for w in m.widths], True)


def staged(m: GraphModel) -> list[int]:
    return [t.num_staged_writes for t in m.bt.block_tables]


def report_one_replay_without_commit(m: GraphModel, replay: int) -> None:
    """The next commit reports replay `replay`, and it alone, as one that found no commit (GraphProtocolError,
    changing nothing); made again, the commit is the batch of the next replay (checked)."""
    err = m.expect_report()
    assert (err.replays_without_commit, err.last_replay, err.commits_without_replay) == (1, replay, 0)
    assert f"replay {replay} (replays count from 0) found no commit for it" in str(err)
    m.commit()
    m.replay()
    m.check("the replay after the commit made again")


def two_unapplied_commits() -> GraphModel:
    """A header ring of two entries, both holding a committed batch no replay has applied; a third batch staged."""
    m = GraphModel(ring_depth=2)
    m.stage(0, ([1], [2], [3]), True)
    m.commit()
    m.stage(2, ([7], [8], [9]), True)
    m.commit()
    m.stage(1, ([4], [5], [6]), True)
    return m


def retry_after_a_replay(m: GraphModel) -> None:
    """After a commit into `two_unapplied_commits`' full ring failed: a replay applies the first batch (room for one
    more), the commit is retried, and two replays apply everything; the tables are checked after each part."""
    m.replay()
    m.check("first replay")
    m.commit()
    m.replay()
    m.replay()
    m.check("after the retried commit")
