"""multiwrite: apply the block-table updates of every KV-cache group in one device launch.

Stage writes on the host with `StagedWriteTensor.stage_write` or `BlockTables.append_block_ids`, then
apply them all with one `FusedStagedWriter.apply` / `BlockTables.apply_staged_writes` (or `apply_writes`
for the shared writer of the tables' device). Backends are pluggy
plugins (entry-point group `multiwrite`); `select_backend` picks the best one for a device.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from multiwrite.hookspecs import hookimpl

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names resolve lazily (`__getattr__`)
    from multiwrite.backend import Backend, WriteBatch
    from multiwrite.block_tables import BlockTables
    from multiwrite.dispatch import BackendStatus, available_backends, get_plugin_manager, select_backend
    from multiwrite.errors import (
        BackendError,
        BackendUnavailableError,
        ForkedCudaError,
        GraphCaptureError,
        StagedWriteError,
        StageInputError,
    )
    from multiwrite.staging import StagedWriteTensor
    from multiwrite.writer import FusedStagedWriter, apply_writes

#: Where each public name lives. `import multiwrite` stays light (no torch, no numpy) so that the
#: `multiwrite` command installs its Ctrl-C handling before anything heavy loads; each name is imported
#: from its module on first use (PEP 562).
_LAZY = {
    "Backend": "multiwrite.backend",
    "WriteBatch": "multiwrite.backend",
    "BlockTables": "multiwrite.block_tables",
    "BackendStatus": "multiwrite.dispatch",
    "available_backends": "multiwrite.dispatch",
    "get_plugin_manager": "multiwrite.dispatch",
    "select_backend": "multiwrite.dispatch",
    "BackendError": "multiwrite.errors",
    "BackendUnavailableError": "multiwrite.errors",
    "ForkedCudaError": "multiwrite.errors",
    "GraphCaptureError": "multiwrite.errors",
    "StagedWriteError": "multiwrite.errors",
    "StageInputError": "multiwrite.errors",
    "StagedWriteTensor": "multiwrite.staging",
    "FusedStagedWriter": "multiwrite.writer",
    "apply_writes": "multiwrite.writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'multiwrite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)

__all__ = [
    "Backend",
    "BackendError",
    "BackendStatus",
    "BackendUnavailableError",
    "BlockTables",
    "ForkedCudaError",
    "FusedStagedWriter",
    "GraphCaptureError",
    "StageInputError",
    "StagedWriteError",
    "StagedWriteTensor",
    "WriteBatch",
    "__version__",
    "apply_writes",
    "available_backends",
    "get_plugin_manager",
    "hookimpl",
    "select_backend",
]
