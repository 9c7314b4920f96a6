"""Deprecated (removed in 0.4.0): the plugin contract of 0.2.0, now `multiwrite.plugins.backend`."""

from multiwrite._deprecated import warn_moved

warn_moved("multiwrite.backend", "multiwrite.plugins.backend")

from multiwrite.plugins import backend as _new  # noqa: E402

#: The names of 0.2.0's module (the new module has more).
__all__ = ("META_COLUMNS META_LENGTH META_ROW META_START META_TABLE META_VALUE_OFFSET PRIORITY_BUILTIN_CPU "
           "PRIORITY_BUILTIN_GPU PRIORITY_FALLBACK Backend WriteBatch").split()  # fmt: skip
globals().update({name: getattr(_new, name) for name in __all__})
