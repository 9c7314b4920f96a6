"""Deprecated (removed in 0.4.0): `StageCalls`, the base class that held the gather, slot-mapping and whole-step calls
of `BlockTables`. They are `BlockTables`' own methods now, run by its mode (`multiwrite.tables.mode`); `StageCalls` is
`BlockTables` itself, so that `isinstance(tables, StageCalls)` still holds."""

from multiwrite._deprecated import warn_moved

warn_moved("multiwrite.tables.stage_calls", "multiwrite.tables.block_tables")

from multiwrite.tables.block_tables import BlockTables as StageCalls  # noqa: E402

__all__ = ["StageCalls"]
