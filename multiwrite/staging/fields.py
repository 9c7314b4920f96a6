"""The C-level fields of the staging objects: the types of `multiwrite.staging._cstaging` where that helper is
built (`COMPILED`), else these exact Python twins, with the same names and behaviour.

`ArenaFields` holds a staging arena's counters, the addresses and capacities of the memory it stages into (its
lease), its batch number and its runs on the staging clock; `LeaseFields` one piece of staging memory, with the
completion word and token of a kernel that reads it in place; `Countdown` a counter whose truth test counts (the
periodic address check of a `BlockTables`' preamble, `multiwrite/tables/mode.py`). The compiled staging
(`BlockIdStaging`) and graph mode's publish (`HeaderRingFields`) read and write these fields directly.
"""

from __future__ import annotations

import ctypes

import numpy as np

try:  # built where a C compiler existed at install time
    from multiwrite.staging import _cstaging
except ImportError:  # pragma: no cover - depends on the install
    _cstaging = None

#: Whether the compiled helper is built (then every class below is its C type).
COMPILED = _cstaging is not None

#: The staging clock every arena shares: `[uid of the arena that staged last, runs started]`. A run is a stretch
#: of consecutive writes into one arena; each arena records `(clock, first write)` when one starts, so that the
#: writes of several arenas applied together are put back in true staging order. One compare per write otherwise.
STAGE_CLOCK = np.zeros(2, dtype=np.int64)
CLOCK = STAGE_CLOCK.data  # int64 loads and stores without numpy scalars


class PyLeaseFields:
    """Python twin of `_cstaging.LeaseFields` (see that type)."""

    __slots__ = ("meta_addr", "values_addr", "bounds_addr", "done_addr", "meta_cap", "values_cap", "slot", "token")

    def __init__(self) -> None:
        self.meta_addr = self.values_addr = self.bounds_addr = self.done_addr = 0
        self.meta_cap = self.values_cap = 0
        self.slot = -1
        self.token = 0

    def released(self) -> bool:
        """No launched kernel still reads this memory (its completion word holds the token)."""
        return not self.done_addr or ctypes.c_int32.from_address(self.done_addr).value == self.token

    def next_token(self) -> int:
        """Advance the token (1 .. 2**31 - 1, wrapping) for the launch about to read this memory."""
        self.token = self.token % 0x7FFFFFFF + 1
        return self.token


class PyArenaFields:
    """Python twin of `_cstaging.ArenaFields` (see that type)."""

    __slots__ = ("num_writes", "num_values", "meta_addr", "values_addr", "meta_cap", "values_cap", "uid", "batch",
                 "may_overlap", "runs", "rows_seen", "lease")  # fmt: skip

    def __init__(self) -> None:
        self.num_writes = self.num_values = 0
        self.meta_addr = self.values_addr = self.meta_cap = self.values_cap = 0
        self.uid = 0
        self.batch = 1  # stamps start at 0: no row is written in the first batch yet
        self.may_overlap = False
        self.runs: list[tuple[int, int]] = []
        self.rows_seen: set[int] = set()
        self.lease = None

    def adopt(self, lease: PyLeaseFields) -> None:
        """Stage into `lease` from now on (nothing is copied)."""
        self.lease = lease
        self.meta_addr, self.values_addr = lease.meta_addr, lease.values_addr
        self.meta_cap, self.values_cap = lease.meta_cap, lease.values_cap

    def clear(self) -> None:
        """Drop every staged write; a new batch number; the next write starts a run."""
        self.num_writes = self.num_values = 0
        self.may_overlap = False
        self.batch += 1
        if CLOCK[0] == self.uid:
            CLOCK[0] = 0
        self.rows_seen.clear()
        self.runs.clear()

    def land(self, lease: PyLeaseFields | None) -> None:
        """The staged batch has landed: adopt `lease` (None: keep the current one), then `clear()`."""
        if lease is not None:
            self.adopt(lease)
        self.clear()

    def begin_run(self) -> None:
        """The next write starts a run of this arena on the staging clock."""
        clock = CLOCK[1] + 1
        self.runs.append((clock, self.num_writes))
        CLOCK[1] = clock
        CLOCK[0] = self.uid


class PyCountdown:
    """Python twin of `_cstaging.Countdown`: `Countdown(period)`, whose truth test is true at every `period`-th test
    (and at every test after it until `restart()`); in C one call of `nb_bool`, a few ns.

    Raises:
        ValueError: `period < 1`.
    """

    __slots__ = ("period", "left")

    def __init__(self, period: int) -> None:
        if period < 1:
            raise ValueError(f"Countdown: period must be >= 1, got {period}")
        self.period = self.left = period

    def __bool__(self) -> bool:
        if self.left > 1:
            self.left -= 1
            return False
        self.left = 0
        return True

    def restart(self) -> None:
        """The next true test is `period` tests away."""
        self.left = self.period


if _cstaging is not None:
    _cstaging.bind_clock(STAGE_CLOCK)
    ArenaFields: type = _cstaging.ArenaFields
    LeaseFields: type = _cstaging.LeaseFields
    Countdown: type = _cstaging.Countdown
else:  # pragma: no cover - depends on the install
    ArenaFields = PyArenaFields
    LeaseFields = PyLeaseFields
    Countdown = PyCountdown

__all__ = ["CLOCK", "COMPILED", "STAGE_CLOCK", "ArenaFields", "Countdown", "LeaseFields", "PyArenaFields",
           "PyCountdown", "PyLeaseFields"]  # fmt: skip
