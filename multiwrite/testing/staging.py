"""Both staging paths of `BlockTables` for tests: the compiled one (`BlockIdStaging` from
`multiwrite.staging._cstaging`, what `BlockTables` inherits where it is built) and its exact Python twin."""

from __future__ import annotations

from multiwrite.staging.block_ids import PyBlockIdStaging
from multiwrite.staging.fields import COMPILED
from multiwrite.tables.block_tables import BlockTables

#: The staging paths: "c" (compiled; `BlockTables` itself), "python" (the twin).
STAGING_PATHS = ("c", "python")


class PythonStagedBlockTables(BlockTables):
    """`BlockTables` whose `append_block_ids` and `append_block_ids_batch` are the Python twin's
    (`multiwrite.staging.block_ids.PyBlockIdStaging`), over the same state: everything else is `BlockTables`'."""

    append_block_ids = PyBlockIdStaging.append_block_ids
    append_block_ids_batch = PyBlockIdStaging.append_block_ids_batch


def block_tables_class(staging: str) -> type[BlockTables]:
    """The `BlockTables` class that stages through `staging` ("c", "python", or "default": multiwrite's choice).

    Raises:
        ValueError: an unknown path, or "c" where the compiled helper is not built.
    """
    if staging == "python":
        return PythonStagedBlockTables
    if staging == "c" and not COMPILED:
        raise ValueError("the compiled staging helper multiwrite.staging._cstaging is not built")
    if staging not in ("c", "default"):
        raise ValueError(f"staging={staging!r} (known: c, python, default)")
    return BlockTables
