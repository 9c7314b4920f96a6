"""multiwrite in SGLang 0.5.23: its two page-table writers in one launch each, and `install()`, which puts them in
SGLang's allocation module (docs/sglang.md).

The names resolve on first use (PEP 562), so that SGLang's plugin entry point (`multiwrite.sglang.plugin`) imports
no torch while it is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multiwrite import _lazy

if TYPE_CHECKING:
    from multiwrite.sglang.install import UnsupportedSglangError, alloc_for_decode, install, uninstall
    from multiwrite.sglang.writes import SglangWriteError, write_cache_indices, write_decode

_LAZY = {
    "SglangWriteError": "multiwrite.sglang.writes",
    "UnsupportedSglangError": "multiwrite.sglang.install",
    "alloc_for_decode": "multiwrite.sglang.install",
    "install": "multiwrite.sglang.install",
    "uninstall": "multiwrite.sglang.install",
    "write_cache_indices": "multiwrite.sglang.writes",
    "write_decode": "multiwrite.sglang.writes",
}

__getattr__, __dir__ = _lazy.lazy_names(globals(), _LAZY)


__all__ = [
    "SglangWriteError",
    "UnsupportedSglangError",
    "alloc_for_decode",
    "install",
    "uninstall",
    "write_cache_indices",
    "write_decode",
]
