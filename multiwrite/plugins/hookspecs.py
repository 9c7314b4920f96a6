"""Hook specifications of the `multiwrite` plugin system (pluggy project name `"multiwrite"`).

A plugin is a module or object with `@hookimpl` functions, registered in the `multiwrite` entry-point
group of its package metadata::

    [project.entry-points.multiwrite]
    my-device = "my_package.multiwrite_plugin"

The built-in backends register exactly this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from multiwrite.plugins.backend import Backend

hookspec = pluggy.HookspecMarker("multiwrite")
hookimpl = pluggy.HookimplMarker("multiwrite")


# -------------------------------------------------------------------------------------------------
# backends
# -------------------------------------------------------------------------------------------------
@hookspec
def multiwrite_backends() -> list[Backend]:
    """Return the backends this plugin provides, as `Backend` instances.

    Return the same instances on every call (module-level singletons): backends keep caches such as
    device descriptors and pinned ring buffers. Import heavy or optional dependencies (Triton, a vendor
    SDK) lazily inside the backend, so that a missing dependency becomes one of its
    `not_supported_reasons` instead of an import error. An exception raised here is caught and reported
    as the plugin's reason; it never reaches the host program. Do not call `available_backends` or
    `select_backend` from here (`PluginReentryError`); each backend's declarations are checked
    (docs/backends.md, "What the host checks").

    Give each backend a `NAME` of its own: names are unique. A built-in backend (defined under
    `multiwrite.backends`) keeps its name; among third-party backends sharing one, the highest `PRIORITY`
    keeps it (then the distribution name, then `module.Class` decide); any other backend with that name is
    listed by `available_backends` as unavailable ("backend name 'X' is already taken by module.Class") and
    is never selected, not even when forced by name (docs/backends.md).
    """
    raise NotImplementedError  # a specification: plugins implement it
