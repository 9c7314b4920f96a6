"""multiwrite: apply the block-table updates of every KV-cache group in one device launch.

Stage writes on the host with `StagedWriteTensor.stage_write` or `BlockTables.append_block_ids`, then
apply them all with one `FusedStagedWriter.apply` / `BlockTables.apply_staged_writes` (or `apply_writes`
for the shared writer of the tables' device). Backends are pluggy
plugins (entry-point group `multiwrite`); `select_backend` picks the best one for a device.
"""

from multiwrite.backend import Backend, WriteBatch
from multiwrite.block_tables import BlockTables
from multiwrite.dispatch import BackendStatus, available_backends, get_plugin_manager, select_backend
from multiwrite.errors import (
    BackendError,
    BackendUnavailableError,
    ForkedCudaError,
    GraphCaptureError,
    StagedWriteError,
)
from multiwrite.hookspecs import hookimpl
from multiwrite.staging import StagedWriteTensor
from multiwrite.writer import FusedStagedWriter, apply_writes

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
