"""The `sglang.srt.plugins` entry point: SGLang calls `register()` early in each of its processes
(`sglang.srt.plugins.load_plugins`).

It installs multiwrite's writers (`multiwrite.sglang.install`) only when `MULTIWRITE_SGLANG` is on (`1`, `true`,
`yes`, `on`); unset, empty or `0`, `false`, `no`, `off`, it does nothing. Any other value raises `ValueError` naming
it. SGLang's loader logs an exception a plugin raises and starts without it (docs/sglang.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from multiwrite.env_switch import env_switch

ENV = "MULTIWRITE_SGLANG"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `MULTIWRITE_SGLANG` in `environ` asks for multiwrite's writers (unset: no).

    Raises:
        ValueError: a value that is neither on nor off (`multiwrite.env_switch`), named with the accepted words.
    """
    return env_switch(environ, ENV, "multiwrite.sglang does not guess whether to replace SGLang's page-table writers")


def register() -> None:
    """Call `multiwrite.sglang.install.install()` when `enabled()`.

    Raises:
        ValueError: `MULTIWRITE_SGLANG` is neither on nor off. UnsupportedSglangError: asked for, but SGLang's
            allocation module is not 0.5.23's where multiwrite replaces it, or does not import.
    """
    if not enabled():
        return
    from multiwrite.sglang.install import install

    install()
