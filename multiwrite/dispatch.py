"""Deprecated (removed in 0.4.0): backend discovery and selection of 0.2.0, now `multiwrite.plugins.dispatch`."""

from multiwrite._deprecated import warn_moved

warn_moved("multiwrite.dispatch", "multiwrite.plugins.dispatch")

from multiwrite.plugins.dispatch import (  # noqa: E402
    BACKEND_ENV,
    ENTRY_POINT_GROUP,
    BackendNameCollisionWarning,
    BackendStatus,
    available_backends,
    get_plugin_manager,
    reload_plugins,
    select_backend,
)

__all__ = [
    "BACKEND_ENV",
    "ENTRY_POINT_GROUP",
    "BackendNameCollisionWarning",
    "BackendStatus",
    "available_backends",
    "get_plugin_manager",
    "reload_plugins",
    "select_backend",
]
