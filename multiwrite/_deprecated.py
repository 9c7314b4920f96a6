"""The import paths of 0.2.0 that moved in 0.3.0, kept as deprecated aliases until 0.4.0: each warns
(`DeprecationWarning`, pointing at the importing line) and names the new path."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

#: The release that removes the aliases.
REMOVED_IN = "0.4.0"
#: The alias modules (each a thin module at a path of 0.2.0 calling `warn_moved` when imported).
ALIASES = frozenset({
    "multiwrite.backend", "multiwrite.block_tables", "multiwrite.dispatch", "multiwrite.hookspecs",
    "multiwrite.tables.stage_calls",
})


def _stacklevel() -> int:
    """The `stacklevel` of the first frame outside this module, an alias module's body and `importlib.import_module`
    (`warnings.warn` itself skips the frozen import machinery's frames, so those are not counted)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
            continue
        if frame.f_code.co_filename != __file__ and frame.f_globals.get("__name__") != "importlib" and not (
            frame.f_globals.get("__name__") in ALIASES and frame.f_code.co_name == "<module>"
        ):
            break
        frame, level = frame.f_back, level + 1
    return level


def _warn(message: str) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=_stacklevel())


def warn_moved(old: str, new: str) -> None:
    """Warn that the module `old` moved to `new` (called by the alias module `old` when it is imported)."""
    _warn(f"{old} is deprecated: import from {new} instead ({old} is removed in {REMOVED_IN})")


def moved_names(package: str, namespace: dict[str, Any], homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` (its globals: `namespace`), whose 0.2.0 module held names that now live in
    its submodules: each name of `homes` (name -> the module it lives in now) resolves from there with a
    `DeprecationWarning` (once: the value is then kept in `namespace`); any other name raises `AttributeError`."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name} is deprecated: import it from {home} instead (the alias is removed in {REMOVED_IN})")
        value = namespace[name] = getattr(importlib.import_module(home), name)
        return value

    return __getattr__
