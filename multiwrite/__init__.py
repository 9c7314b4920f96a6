"""multiwrite: apply the block-table updates of every KV-cache group in one device launch.

Stage writes on the host with `StagedWriteTensor.stage_write` or `BlockTables.append_block_ids`, then
apply them all with one `FusedStagedWriter.apply` / `BlockTables.apply_staged_writes` (or `apply_writes`
for the shared writer of the tables' device). Backends are pluggy
plugins (entry-point group `multiwrite`); `select_backend` picks the best one for a device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multiwrite import _lazy
from multiwrite.version import __version__

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names resolve lazily (`__getattr__`)
    from multiwrite.device_writes import (
        DeviceWriteFaults,
        DeviceWrites,
        HostCopies,
        addresses_of,
        apply_device_writes,
    )
    from multiwrite.errors import (
        BackendError,
        BackendUnavailableError,
        BlockTableWriteError,
        ForkedCudaError,
        GraphCaptureError,
        GraphProtocolError,
        RingStallError,
        RingWaitWarning,
        StagedWriteError,
        StageInputError,
        TableMovedError,
    )
    from multiwrite.plugins.backend import Backend, GraphPlan, TablesPlan, WriteBatch
    from multiwrite.plugins.dispatch import BackendStatus, available_backends, get_plugin_manager, select_backend
    from multiwrite.plugins.hookspecs import hookimpl
    from multiwrite.staging.table import StagedWriteTensor
    from multiwrite.tables.block_tables import BlockTables
    from multiwrite.writer import FusedStagedWriter, apply_writes

#: Where each public name lives. `import multiwrite` stays light (no torch, no numpy, no pluggy) so that the
#: `multiwrite` command installs its Ctrl-C handling before anything heavy loads; each name is imported
#: from its module on first use (PEP 562).
_LAZY = {
    "Backend": "multiwrite.plugins.backend",
    "WriteBatch": "multiwrite.plugins.backend",
    "TablesPlan": "multiwrite.plugins.backend",
    "GraphPlan": "multiwrite.plugins.backend",
    "BlockTables": "multiwrite.tables.block_tables",
    "BackendStatus": "multiwrite.plugins.dispatch",
    "available_backends": "multiwrite.plugins.dispatch",
    "get_plugin_manager": "multiwrite.plugins.dispatch",
    "select_backend": "multiwrite.plugins.dispatch",
    "hookimpl": "multiwrite.plugins.hookspecs",
    "BackendError": "multiwrite.errors",
    "BackendUnavailableError": "multiwrite.errors",
    "BlockTableWriteError": "multiwrite.errors",
    "ForkedCudaError": "multiwrite.errors",
    "GraphCaptureError": "multiwrite.errors",
    "GraphProtocolError": "multiwrite.errors",
    "RingStallError": "multiwrite.errors",
    "RingWaitWarning": "multiwrite.errors",
    "StagedWriteError": "multiwrite.errors",
    "StageInputError": "multiwrite.errors",
    "TableMovedError": "multiwrite.errors",
    "StagedWriteTensor": "multiwrite.staging.table",
    "FusedStagedWriter": "multiwrite.writer",
    "apply_writes": "multiwrite.writer",
    "DeviceWrites": "multiwrite.device_writes",
    "DeviceWriteFaults": "multiwrite.device_writes",
    "HostCopies": "multiwrite.device_writes",
    "addresses_of": "multiwrite.device_writes",
    "apply_device_writes": "multiwrite.device_writes",
}

__getattr__, __dir__ = _lazy.lazy_names(globals(), _LAZY)


__all__ = [
    "Backend",
    "BackendError",
    "BackendStatus",
    "BackendUnavailableError",
    "BlockTableWriteError",
    "BlockTables",
    "DeviceWriteFaults",
    "DeviceWrites",
    "ForkedCudaError",
    "FusedStagedWriter",
    "GraphCaptureError",
    "GraphPlan",
    "GraphProtocolError",
    "HostCopies",
    "RingStallError",
    "RingWaitWarning",
    "StageInputError",
    "StagedWriteError",
    "StagedWriteTensor",
    "TableMovedError",
    "TablesPlan",
    "WriteBatch",
    "__version__",
    "addresses_of",
    "apply_device_writes",
    "apply_writes",
    "available_backends",
    "get_plugin_manager",
    "hookimpl",
    "select_backend",
]
