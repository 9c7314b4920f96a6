"""The `vllm.general_plugins` entry point: vLLM calls `register()` at start-up in each of its processes.

It installs multiwrite's `BlockTables` (`multiwrite.vllm.install`) only when `MULTIWRITE_VLLM=1`; otherwise it does
nothing, so having multiwrite installed next to vLLM changes nothing until asked.
"""

from __future__ import annotations

import os

ENV = "MULTIWRITE_VLLM"


def register() -> None:
    """Call `multiwrite.vllm.install.install()` when the environment sets `MULTIWRITE_VLLM=1`; an unsupported vLLM
    then fails start-up with `UnsupportedVllmError` (asked for multiwrite's tables, it should not run without)."""
    if os.environ.get(ENV) != "1":
        return
    from multiwrite.vllm.install import install

    install()
