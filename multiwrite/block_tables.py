"""Deprecated (removed in 0.4.0): `BlockTables` of 0.2.0, now in `multiwrite.tables.block_tables` (and `multiwrite`)."""

from multiwrite._deprecated import warn_moved

warn_moved("multiwrite.block_tables", "multiwrite.tables.block_tables")

from multiwrite.tables.block_tables import BlockTables  # noqa: E402

__all__ = ["BlockTables"]
