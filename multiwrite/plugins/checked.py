"""The host's checks of every value it reads from a backend: one function per value, called where it is read.

A declaration (`NAME`, `PRIORITY`, `SUPPORTED_DEVICE_TYPES`, `SUPPORTED_DTYPES`) that is of the wrong type or
raises when read, or a method result of the wrong type (`priority`, `not_supported_reasons`, `staging_buffers`; `plan`
and `graph_plan` in `multiwrite.plugins.backend`, `plan_of` and `graph_plan_of`), is a `BackendContractError` naming
the backend, the attribute and the value found, with what is accepted; the backend is then set aside for the process
(`set_aside_reason`): dispatch lists it as unavailable with that reason and never selects it again (until
`reload_plugins`). What a method raises is not checked here: it reaches the caller (dispatch lists it as a reason).
The contract is docs/backends.md.
"""

from __future__ import annotations

import operator
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from multiwrite.errors import BackendUnavailableError
from multiwrite.staging.arena import StagingBuffers
from multiwrite.staging.layout import SUPPORTED_DTYPES, dtype_name

if TYPE_CHECKING:
    from collections.abc import Iterable

#: What a plugin gave as a backend (a `multiwrite.Backend`, as far as it has said): nothing of it is trusted before
#: the checks here (and the annotation names no class of `multiwrite.plugins.backend`, which calls these checks).
Backend = Any

_COLLECTIONS = (set, frozenset, list, tuple)
_DTYPES = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)


class BackendContractError(BackendUnavailableError):
    """A backend broke the plugin contract: an attribute of the wrong type or one that raises when read, or a method
    that returned the wrong type. The message names the backend (`NAME`, `module.Class`), the attribute, the value
    found and what is accepted; the backend is set aside for the process (never selected again).

    Attributes:
        reason: the message without the note on setting aside (what dispatch lists).
        name: the backend's `NAME` where that is a valid name, else None.
    """

    def __init__(self, reason: str, name: str | None):
        super().__init__(
            f"{reason}. The backend is set aside for this process: it is listed as unavailable with this reason and "
            "never selected (docs/backends.md, 'What the host checks')"
        )
        self.reason = reason
        self.name = name


_lock = threading.Lock()
_set_aside: dict[int, tuple[Backend, str, str | None]] = {}  # id -> (the backend, kept alive; reason; NAME)


def _valid_name(backend: Backend) -> str | None:
    try:
        name = backend.NAME
    except Exception:
        return None
    return name if isinstance(name, str) and name else None


def describe(backend: Backend) -> str:
    """`backend 'NAME' (module.Class)`, or `backend module.Class` where the NAME is not a valid name; never raises."""
    cls = type(backend)
    name = _valid_name(backend)
    where = f"{cls.__module__}.{cls.__qualname__}"
    return f"backend {name!r} ({where})" if name else f"backend {where}"


def shown(value: Any) -> str:
    """`repr(value)` (at most 80 characters) and its type: `'high' (a str)`; never raises."""
    try:
        text = repr(value)
    except Exception:
        text = "<a failing __repr__>"
    text = text if len(text) <= 80 else text[:77] + "..."
    kind = type(value).__name__
    return f"{text} ({'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind})"


def broken(backend: Backend, what: str) -> BackendContractError:
    """Set `backend` aside with the reason `what` (`ATTRIBUTE=VALUE ...`; its first reason stays) and return the
    `BackendContractError` to raise."""
    name = _valid_name(backend)
    reason = f"{describe(backend)}: {what}"
    with _lock:
        _set_aside.setdefault(id(backend), (backend, reason, name))
    return BackendContractError(reason, name)


def set_aside_reason(backend: Backend) -> str | None:
    """Why `backend` was set aside in this process, or None when it was not."""
    entry = _set_aside.get(id(backend))
    return entry[1] if entry is not None and entry[0] is backend else None


def forget_set_aside() -> None:
    """Forget every backend set aside (`reload_plugins`: the plugins may have been reinstalled)."""
    with _lock:
        _set_aside.clear()


def _refuse_set_aside(backend: Backend) -> None:
    entry = _set_aside.get(id(backend))
    if entry is not None and entry[0] is backend:
        raise BackendContractError(entry[1], entry[2])


def _read(backend: Backend, attr: str) -> Any:
    try:
        return getattr(backend, attr)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: no plugin stops the host program
        raise broken(backend, f"reading {attr} raised {type(exc).__name__}: {exc}") from exc


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except Exception:
        return None


def declared(backend: Backend) -> tuple[str, int]:
    """(`NAME`, `PRIORITY`) of `backend`, its four declarations checked: `NAME` a non-empty str, `PRIORITY` an int
    (not a bool), `SUPPORTED_DEVICE_TYPES` a set (or list/tuple) of device type names, `SUPPORTED_DTYPES` one of
    torch dtypes.

    Raises:
        BackendContractError: a declaration of the wrong type, one that raises when read, or a backend set aside.
    """
    _refuse_set_aside(backend)
    name = _read(backend, "NAME")
    if not isinstance(name, str) or not name:
        raise broken(backend, f"NAME={shown(name)} is not a name (allowed: a non-empty str, e.g. 'numpy-cpu')")
    priority = _read(backend, "PRIORITY")
    if _integer(priority) is None:
        raise broken(backend, f"PRIORITY={shown(priority)} is not an int (allowed: an int, e.g. 50 to 90 for a "
                               "device no built-in serves, above 100 to override a built-in)")  # fmt: skip
    types = _read(backend, "SUPPORTED_DEVICE_TYPES")
    bad = _first_bad(types, lambda t: isinstance(t, str) and bool(t))
    if bad is not None:
        raise broken(backend, f"SUPPORTED_DEVICE_TYPES={shown(types)}{bad} (allowed: a frozenset of torch device "
                               "type names, e.g. frozenset({'cpu'}))")  # fmt: skip
    dtypes = _read(backend, "SUPPORTED_DTYPES")
    bad = _first_bad(dtypes, lambda d: isinstance(d, torch.dtype))
    if bad is not None:
        raise broken(backend, f"SUPPORTED_DTYPES={shown(dtypes)}{bad} (allowed: a frozenset of torch dtypes, of "
                               f"{_DTYPES})")  # fmt: skip
    return name, operator.index(priority)


def _first_bad(items: Any, ok: Any) -> str | None:
    """None when `items` is a set, frozenset, list or tuple of items `ok` accepts; else what is wrong, as text."""
    if not isinstance(items, _COLLECTIONS):
        return " is not a set"
    for item in items:
        if not ok(item):
            return f" holds {shown(item)}"
    return None


def device_priority(backend: Backend, device: torch.device) -> int:
    """`backend.priority(device)`, checked to be an int (not a bool).

    Raises:
        BackendContractError: it returned anything else (what it raises propagates as it is).
    """
    value = backend.priority(device)
    if _integer(value) is None:
        raise broken(backend, f"priority({device}) returned {shown(value)}, not an int")
    return operator.index(value)


def device_reasons(backend: Backend, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
    """`backend.not_supported_reasons(device, dtypes)` as a new list, checked to be a list (or tuple) of str.

    A single str is refused, not split into characters nor taken as one reason: `[]` means "can run", and a str
    (empty or not) says neither.

    Raises:
        BackendContractError: it returned anything else (what it raises propagates as it is).
    """
    value = backend.not_supported_reasons(device, tuple(dtypes))
    if isinstance(value, str):
        raise broken(backend, f"not_supported_reasons({device}) returned {shown(value)}, not a list of str: return "
                               f"[{value!r}] (or [] when it can run)")  # fmt: skip
    if not isinstance(value, (list, tuple)):
        raise broken(backend, f"not_supported_reasons({device}) returned {shown(value)}, not a list of str")
    for item in value:
        if not isinstance(item, str):
            raise broken(backend, f"not_supported_reasons({device}) returned a list holding {shown(item)}, not a "
                                   "list of str")  # fmt: skip
    return list(value)


def refuse_unsupported(backend: Backend, device: torch.device) -> Backend:
    """`backend` (an instance passed by hand) when its declarations are valid and it reports no reason against
    `device`; else `BackendUnavailableError` with its reasons (`BackendContractError` for a broken contract)."""
    name, _ = declared(backend)
    reasons = device_reasons(backend, device)
    if reasons:
        raise BackendUnavailableError(f"backend {name!r} cannot run on {device}: {'; '.join(reasons)}")
    return backend


def lender(backend: Backend, device: torch.device, np_dtype: type[np.generic]) -> StagingBuffers | None:
    """`backend.staging_buffers(device, np_dtype)`, checked to be a `StagingBuffers` or None.

    Raises:
        BackendContractError: it returned anything else (what it raises propagates as it is).
    """
    value = backend.staging_buffers(device, np_dtype)
    if value is not None and not isinstance(value, StagingBuffers):
        raise broken(backend, f"staging_buffers({device}, {np.dtype(np_dtype).name}) returned {shown(value)}, not "
                               "a StagingBuffers or None")  # fmt: skip
    return value


#: The source kinds of device-sourced writes (`Backend.DEVICE_WRITE_SOURCES`, docs/device-writes.md).
DEVICE_WRITE_KINDS = frozenset({"values", "tensors", "addresses"})


def device_write_sources(backend: Backend) -> frozenset[str]:
    """`backend.DEVICE_WRITE_SOURCES`, checked to be a set (or list/tuple) of `DEVICE_WRITE_KINDS`.

    Raises:
        BackendContractError: anything else, or an attribute that raises when read; the backend is set aside.
    """
    _refuse_set_aside(backend)
    kinds = _read(backend, "DEVICE_WRITE_SOURCES")
    bad = _first_bad(kinds, lambda k: k in DEVICE_WRITE_KINDS)
    if bad is not None:
        raise broken(backend, f"DEVICE_WRITE_SOURCES={shown(kinds)}{bad} (allowed: a frozenset of "
                               f"{', '.join(sorted(DEVICE_WRITE_KINDS))})")  # fmt: skip
    return frozenset(kinds)


def device_write_reasons(backend: Backend, needed: Iterable[str]) -> list[str]:
    """Why `backend` cannot apply device-sourced writes of the source kinds `needed`: one reason naming the kinds it
    lacks, or none (`device_write_sources` checks its declaration)."""
    declared = device_write_sources(backend)
    missing = sorted(set(needed) - declared)
    if not missing:
        return []
    have = ", ".join(sorted(declared)) or "none"
    return [f"device-sourced writes from {', '.join(missing)} (DEVICE_WRITE_SOURCES: {have})"]
