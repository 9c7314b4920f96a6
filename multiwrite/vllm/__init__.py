"""multiwrite in vLLM: `BlockTables` with vLLM 0.33's signature over multiwrite's, and `install()`, which puts it in
vLLM's model runner (docs/vllm.md).

The names resolve on first use (PEP 562), so that vLLM's plugin entry point (`multiwrite.vllm.plugin`) and a refused
`install()` import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multiwrite import _lazy

if TYPE_CHECKING:
    from multiwrite.vllm.block_tables import BlockCounts, BlockTables, GroupTable
    from multiwrite.vllm.install import UnsupportedVllmError, install, uninstall

_LAZY = {
    "BlockCounts": "multiwrite.vllm.block_tables",
    "BlockTables": "multiwrite.vllm.block_tables",
    "GroupTable": "multiwrite.vllm.block_tables",
    "UnsupportedVllmError": "multiwrite.vllm.install",
    "install": "multiwrite.vllm.install",
    "uninstall": "multiwrite.vllm.install",
}

__getattr__, __dir__ = _lazy.lazy_names(globals(), _LAZY)


__all__ = ["BlockCounts", "BlockTables", "GroupTable", "UnsupportedVllmError", "install", "uninstall"]
