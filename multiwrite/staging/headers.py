"""Graph mode's ring of published batches: the pinned memory a captured consume kernel reads at every replay.

The wire format every reader shares (the compiled `publish` writes it, a backend's consume kernel reads it):

- `headers`: `depth` entries of `ENTRY_WORDS` int64 words, 64-byte aligned. Words `H_SEQ` .. `H_NUM_VALUES`:
  sequence (`h + 1` publishes header `h`), metadata address, values address, round-bounds address, completion-word
  address, token, counts (`num_writes | num_rounds << 32`, the sign bit set for an inline batch), number of values.
  A batch of one round with at most `INLINE_WRITES` writes and `INLINE_VALUES` values (a decode step) travels in
  the entry, after the header words: its metadata as five int32 columns of `INLINE_WRITES` cells (table, row,
  start, length, value offset), then its int32 values; the token word then holds a checksum: the sum of each int32
  of that area times its position there plus one. A bigger batch stays in its lease: the header gives its
  addresses, and the kernel stores the token into its completion word when it has read it.
- `tickets`: `depth` int64 words. Ticket `t` (for the `t`-th replay: the commit before it) is `(t + 1) << 32 | h`
  (both 31/32-bit wrapping): the header that replay `t` applies up to. A commit takes the ticket after the last
  one, or, when more replays have run than tickets were published (a replay without its commit), the ticket of
  the next replay to run: so a missed commit costs one replay, never the pairing of all later ones.
- `mirror` (pinned) and `state` (device): int64 `[MIRROR_WORDS]`: headers applied, captured runs, runs that
  applied nothing, inline batches read again after a checksum mismatch; captured runs that found their ticket not
  published (a replay without, or before, its commit) and the index of the last of them; tickets an eager run found
  with no run (a commit whose replay was not issued before that eager call) and the first ticket of the last such
  find. The kernel updates `state` and stores it into `mirror`.

A captured run `r` (the r-th replay) applies, in order, every header not yet applied up to ticket `r`'s header if
ticket `r` is published, else nothing (and counts itself as missed). An eager run applies every header published
when it was issued; it is also given the host's ticket count then, and when fewer runs than that have run it counts
the difference and sets the runs to it, so that the next commit pairs with the next replay. Either way headers land
exactly once, in commit order, and, with one commit right before each replay, a replay never applies a batch
committed after it was issued: `docs/graph-mode.md` gives the protocol, its conditions and why.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from multiwrite.capture import settle
from multiwrite.staging.fields import _cstaging

if _cstaging is not None:
    HEADER_WORDS: int = _cstaging.HEADER_WORDS
    ENTRY_WORDS: int = _cstaging.ENTRY_WORDS
    INLINE_WRITES: int = _cstaging.INLINE_WRITES
    INLINE_VALUES: int = _cstaging.INLINE_VALUES
    _Fields: type = _cstaging.HeaderRingFields
else:  # pragma: no cover - depends on the install
    HEADER_WORDS = ENTRY_WORDS = INLINE_WRITES = INLINE_VALUES = 0
    _Fields = object

#: Word indices of a header.
(H_SEQ, H_META, H_VALUES, H_BOUNDS, H_DONE, H_TOKEN, H_COUNTS, H_NUM_VALUES) = range(8)
#: Words of `mirror` and `state` (the C helper's M_APPLIED ... in _cstaging.h).
(M_APPLIED, M_RUNS, M_IDLE, M_REREADS, M_MISSED, M_LAST_MISSED, M_EXTRA, M_FIRST_EXTRA) = range(8)
MIRROR_WORDS = 8
#: int32 offset of an inline batch's values after its metadata columns.
INLINE_META = 5 * INLINE_WRITES


class HeaderRing(_Fields):  # type: ignore[misc, valid-type]
    """The header ring, ticket ring, mirror and device state of one graph-mode `BlockTables` (module docstring).

    Args:
        depth: entries (a power of two, >= 2).
        device: the tables' device: the memory is pinned there is a GPU, and `state` lives on it.

    Attributes:
        headers: int64 `[depth * ENTRY_WORDS]` (numpy view of the pinned entries).
        tickets: int64 `[depth]`.
        mirror: int64 `[MIRROR_WORDS]`, as the device last stored it (may lag).
        state: int64 `[MIRROR_WORDS]` on the device.
        published, tickets_published: headers and tickets published so far (host counts).
        missed_seen, extra_seen: the `missed` and `extra` counts the host has reported (`GraphProtocolError`); a
            commit in C leaves the report to its caller while the mirror differs.

    Raises:
        RuntimeError: the compiled helper `multiwrite.staging._cstaging` is not built (graph mode needs it).
    """

    __slots__ = ("_backing", "headers", "tickets_t", "tickets", "mirror_t", "mirror", "state", "_mirror_mv")

    def __init__(self, depth: int, device: torch.device):
        if _cstaging is None:
            raise RuntimeError("graph mode needs the compiled helper multiwrite.staging._cstaging, which is not built")
        assert depth >= 2 and depth & (depth - 1) == 0, depth
        pin = device.type != "cpu"
        backing = torch.zeros(depth * ENTRY_WORDS + 8, dtype=torch.int64, pin_memory=pin)
        skip = (-backing.data_ptr() % 64) // 8  # entries start on a 64-byte line: the header words are one line
        self._backing = backing
        entries = backing[skip : skip + depth * ENTRY_WORDS]
        self.headers = entries.numpy()
        self.tickets_t = torch.zeros(depth, dtype=torch.int64, pin_memory=pin)
        self.tickets = self.tickets_t.numpy()
        self.mirror_t = torch.zeros(MIRROR_WORDS, dtype=torch.int64, pin_memory=pin)
        self.mirror = self.mirror_t.numpy()
        self._mirror_mv = memoryview(self.mirror)  # type: ignore[arg-type]  # int64 loads without numpy scalars
        self.state = torch.zeros(MIRROR_WORDS, dtype=torch.int64, device=device)
        settle(device)  # the zeroed state is complete whatever stream launches next
        self.depth = depth
        self.headers_addr = entries.data_ptr()
        self.tickets_addr = self.tickets_t.data_ptr()
        self.mirror_addr = self.mirror_t.data_ptr()

    @property
    def applied(self) -> int:
        """Headers the device has applied, as last stored (may lag)."""
        return int(self._mirror_mv[M_APPLIED])

    @property
    def runs(self) -> int:
        """Captured runs (replays) that have run, as last stored."""
        return int(self._mirror_mv[M_RUNS])

    @property
    def idle_runs(self) -> int:
        """Captured runs that applied nothing (no new batch was due), as last stored."""
        return int(self._mirror_mv[M_IDLE])

    @property
    def rereads(self) -> int:
        """Inline batches read again because what a run read did not match the checksum, as last stored."""
        return int(self._mirror_mv[M_REREADS])

    @property
    def missed(self) -> int:
        """Captured runs that found their ticket not published (a replay without, or before, its commit), as last
        stored."""
        return int(self._mirror_mv[M_MISSED])

    @property
    def last_missed(self) -> int:
        """The run index (0, 1, ...) of the last captured run that found its ticket not published, as last stored."""
        return int(self._mirror_mv[M_LAST_MISSED])

    @property
    def extra(self) -> int:
        """Tickets that eager runs found with no captured run (a commit whose replay was not issued before that eager
        call), as last stored."""
        return int(self._mirror_mv[M_EXTRA])

    @property
    def first_extra(self) -> int:
        """The first ticket of the last such find by an eager run, as last stored."""
        return int(self._mirror_mv[M_FIRST_EXTRA])

    def ticket_header(self, t: int) -> int | None:
        """The header ticket `t` names, if its word still holds it (a later ticket reuses the word), else None."""
        word = int(self.tickets[t % self.depth])
        return word & 0xFFFFFFFF if word >> 32 == (t + 1) & 0x7FFFFFFF else None

    def entry_free(self) -> bool:
        """The next header's entry holds no header the device has not applied."""
        return self._mirror_mv[M_APPLIED] >= self.published - self.depth + 1

    def ticket_free(self) -> bool:
        """The next ticket's word holds no ticket whose replay has not run."""
        runs = self._mirror_mv[M_RUNS]
        return runs >= max(self.tickets_published, runs) - self.depth + 1

    def entry(self, h: int) -> np.ndarray:
        """The int64 words of header `h`'s entry (a view)."""
        e = h % self.depth
        return self.headers[e * ENTRY_WORDS : (e + 1) * ENTRY_WORDS]


class CommitEntry(Protocol):
    """Graph mode's `BlockTables.commit_staged_writes` in one compiled call (`_cstaging.CommitEntry`)."""

    def commit(self) -> int | None:
        """Its common case: the preamble's checks hold (the address check not due, no table or output resized) and
        `HeaderRing.commit`'s (an inline batch or none, room in the rings, no mis-pairing to report); then the staged
        batch is published with a ticket and its header index returned. Otherwise None, having changed nothing."""


def commit_entry(countdown: Any, guard: Any, outputs_guard: Any, ring: HeaderRing, arena: Any) -> CommitEntry:
    """The compiled commit of a graph mode: its preamble's `countdown` and `LayoutGuard`s (the tables and counts; the
    gather and slot outputs), its `ring` and the `arena` it publishes (`multiwrite/tables/graph.py`)."""
    return _cstaging.CommitEntry(countdown, guard, outputs_guard, ring, arena)


__all__ = [
    "ENTRY_WORDS",
    "HEADER_WORDS",
    "INLINE_META",
    "INLINE_VALUES",
    "INLINE_WRITES",
    "MIRROR_WORDS",
    "CommitEntry",
    "HeaderRing",
    "commit_entry",
]
