"""The `vllm.general_plugins` entry point: vLLM calls `register()` at start-up in each of its processes.

It installs multiwrite's `BlockTables` (`multiwrite.vllm.install`) only when `MULTIWRITE_VLLM` says so (`1`, `true`,
`yes`, `on`); unset, empty or `0`, `false`, `no`, `off`, it does nothing, so having multiwrite installed next to vLLM
changes nothing until asked. Any other value stops vLLM's start-up with an error naming it (docs/vllm.md says why).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from multiwrite.env_switch import OFF as OFF
from multiwrite.env_switch import ON as ON
from multiwrite.env_switch import env_switch

ENV = "MULTIWRITE_VLLM"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `MULTIWRITE_VLLM` in `environ` asks for multiwrite's tables (unset: no).

    Raises:
        ValueError: a value that is neither on (`ON`) nor off (`OFF`), named in the message with the accepted words.
    """
    return env_switch(environ, ENV, "multiwrite.vllm stops vLLM's start-up rather than guess whether to replace its "
                      "BlockTables")  # fmt: skip


def register() -> None:
    """Call `multiwrite.vllm.install.install()` when `enabled()`.

    Raises:
        ValueError: `MULTIWRITE_VLLM` has a value that is neither on nor off (`enabled`).
        UnsupportedVllmError: asked for, but vLLM's class is not the one multiwrite replaces, or vLLM's block-table
            module fails to import (asked for multiwrite's tables, vLLM should not run without them).
    """
    if not enabled():
        return
    from multiwrite.vllm.install import install

    install()
