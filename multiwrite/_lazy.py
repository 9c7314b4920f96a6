"""Public names of a package that are imported from their modules on first use (PEP 562), so that importing the
package itself stays light (`lazy_names`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def lazy_names(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of the module whose globals are `namespace`, for the names of
    `homes` (name -> the module that defines it): a name is imported from its module on first use and kept in
    `namespace` (later lookups skip `__getattr__`); `dir()` lists the module's globals and every name of `homes`.

    The `__getattr__` raises `AttributeError` ("module 'NAME' has no attribute ...") for any other name.
    """
    module_name = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = homes.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # resolved once; later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
