"""Deprecated (removed in 0.4.0): the hook specifications of 0.2.0, now `multiwrite.plugins.hookspecs`."""

from multiwrite._deprecated import warn_moved

warn_moved("multiwrite.hookspecs", "multiwrite.plugins.hookspecs")

from multiwrite.plugins.hookspecs import hookimpl, hookspec, multiwrite_backends  # noqa: E402

__all__ = ["hookimpl", "hookspec", "multiwrite_backends"]
