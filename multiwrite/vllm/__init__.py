"""multiwrite in vLLM: `BlockTables` with vLLM 0.33's signature over multiwrite's, and `install()`, which puts it in
vLLM's model runner (docs/vllm.md).

The names resolve on first use (PEP 562), so that vLLM's plugin entry point (`multiwrite.vllm.plugin`) and a refused
`install()` import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'multiwrite.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["BlockCounts", "BlockTables", "GroupTable", "UnsupportedVllmError", "install", "uninstall"]
