"""The `vllm.general_plugins` entry point: vLLM calls `register()` at start-up in each of its processes.

It installs multiwrite's `BlockTables` (`multiwrite.vllm.install`) only when `MULTIWRITE_VLLM` says so (`1`, `true`,
`yes`, `on`); unset, empty or `0`, `false`, `no`, `off`, it does nothing, so having multiwrite installed next to vLLM
changes nothing until asked. Any other value stops vLLM's start-up with an error naming it (docs/vllm.md says why).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "MULTIWRITE_VLLM"
#: The values of `MULTIWRITE_VLLM` (compared case-insensitively, surrounding blanks ignored).
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `MULTIWRITE_VLLM` in `environ` asks for multiwrite's tables (unset: no).

    Raises:
        ValueError: a value that is neither on (`ON`) nor off (`OFF`), named in the message with the accepted words.
    """
    raw = environ.get(ENV)
    value = "" if raw is None else raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(
        f"{ENV}={raw!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF[:-1])} or empty), case-insensitive; "
        "multiwrite.vllm stops vLLM's start-up rather than guess whether to replace its BlockTables"
    )


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
