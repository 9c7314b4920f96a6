"""Backend discovery and selection: pluggy entry points in, one `Backend` out."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy
import torch

from multiwrite import hookspecs
from multiwrite.backend import Backend
from multiwrite.errors import BackendUnavailableError

#: Environment variable that forces a backend by name, like the `backend=` arguments.
BACKEND_ENV = "MULTIWRITE_BACKEND"

_lock = threading.Lock()
_plugin_manager: pluggy.PluginManager | None = None
_load_errors: dict[str, str] = {}


@dataclass
class BackendStatus:
    """One registered backend as the dispatcher sees it for a device.

    `backend` is None when its plugin failed to load; `reasons` is empty when it can run. `taken_by` is
    set (to the `module.Class` of the backend that owns the name) when another backend already has this
    backend's name: such a backend is listed, with that as its reason, but never selected.
    """

    name: str
    backend: Backend | None
    priority: int
    reasons: list[str] = field(default_factory=list)
    taken_by: str | None = None

    @property
    def available(self) -> bool:
        """True when the backend can run on the device it was checked for."""
        return self.backend is not None and not self.reasons


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every plugin of the `multiwrite` entry-point group loaded.

    Each entry point is loaded and registered with pluggy on its own, so that one plugin that fails to
    import is recorded (its exception becomes its reason in `available_backends` and in dispatch errors)
    instead of stopping the others or the host program. The built-in plugins load first and keep their
    entry-point names as plugin names; another entry point with a name already in use is registered as
    `"name (target)"` (its target: `module` or `module:attr`) rather than skipped. Plugins registered
    later with `register()` are seen by the next `select_backend` call.
    """
    global _plugin_manager
    with _lock:
        if _plugin_manager is None:
            pm = pluggy.PluginManager("multiwrite")
            pm.add_hookspecs(hookspecs)
            eps = sorted(entry_points(group="multiwrite"), key=lambda ep: not _is_builtin_module(ep.module))
            for ep in eps:
                name = ep.name
                if pm.has_plugin(name) or name in _load_errors:
                    name = f"{ep.name} ({ep.value})"
                try:
                    plugin = ep.load()
                    if not pm.is_registered(plugin):  # two entry points may name one module
                        pm.register(plugin, name=name)
                except Exception as exc:  # a broken plugin must never crash the host program
                    _load_errors[name] = f"plugin {ep.value!r} failed to load: {type(exc).__name__}: {exc}"
            _plugin_manager = pm
        return _plugin_manager


def _is_builtin_module(module: str) -> bool:
    return module == "multiwrite.backends" or module.startswith("multiwrite.backends.")


def _qualname(backend: Backend) -> str:
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def _registered() -> tuple[list[Backend], dict[str, str]]:
    """All backends the plugins provide (each instance once, in registration order), and
    {name: reason} for plugins that failed."""
    pm = get_plugin_manager()
    backends: list[Backend] = []
    seen: set[int] = set()
    failures = dict(_load_errors)
    for impl in pm.hook.multiwrite_backends.get_hookimpls():
        try:
            provided: Any = impl.function()
        except Exception as exc:
            failures[impl.plugin_name] = f"multiwrite_backends() raised {type(exc).__name__}: {exc}"
            continue
        for backend in provided or ():
            if not isinstance(backend, Backend) or not backend.NAME:
                failures[impl.plugin_name] = f"multiwrite_backends() returned {backend!r}, not a named Backend"
                continue
            if id(backend) not in seen:
                seen.add(id(backend))
                backends.append(backend)
    return backends, failures


def _name_owners(backends: list[Backend]) -> dict[str, Backend]:
    """{name: the backend that owns it}: a built-in backend (class defined under `multiwrite.backends`)
    keeps its name; otherwise the first backend seen with a name owns it."""
    owners: dict[str, Backend] = {}
    for b in backends:
        if _is_builtin_module(type(b).__module__):
            owners.setdefault(b.NAME, b)
    for b in backends:
        owners.setdefault(b.NAME, b)
    return owners


def _device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available_backends(
    device: torch.device | str | None = None, dtypes: Iterable[torch.dtype] = ()
) -> list[BackendStatus]:
    """Every registered backend with the reasons it cannot run on `device` (empty: it can).

    Sorted best first: available before unavailable, then by priority. Plugins that failed to load are
    listed with their exception as the reason. Names are unique among the backends that can be
    selected: a backend whose name another already owns (see `_name_owners`) is listed as unavailable,
    with `taken_by` set and the reason "backend name 'X' is already taken by module.Class".
    """
    device = _device(device)
    dtypes = tuple(dtypes)
    backends, failures = _registered()
    owners = _name_owners(backends)
    out = []
    for b in backends:
        owner = owners[b.NAME]
        if owner is not b:
            taken_by = _qualname(owner)
            reason = f"backend name {b.NAME!r} is already taken by {taken_by}"
            out.append(BackendStatus(b.NAME, b, b.PRIORITY, [reason], taken_by))
            continue
        try:
            reasons = b.not_supported_reasons(device, dtypes)
            prio = b.priority(device)
        except Exception as exc:
            reasons, prio = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"], b.PRIORITY
        out.append(BackendStatus(b.NAME, b, prio, list(reasons)))
    out.extend(BackendStatus(name, None, -(10**9), [reason]) for name, reason in failures.items())
    out.sort(key=lambda s: (not s.available, -s.priority, s.name))
    return out


def _listing(statuses: list[BackendStatus]) -> str:
    return "\n".join(f"  - {s.name}: " + ("available" if s.available else "; ".join(s.reasons)) for s in statuses)


def select_backend(
    device: torch.device | str | None = None,
    name: str | None = None,
    dtypes: Iterable[torch.dtype] = (),
) -> Backend:
    """The backend that applies writes to tables of `dtypes` on `device`.

    Args:
        device: the tables' device (default CPU).
        name: force this backend; if None, `$MULTIWRITE_BACKEND` forces one when set and non-empty.
        dtypes: the table dtypes it must support.

    With nothing forced, the highest-priority backend with no reasons wins. A name always means the
    backend that owns it (see `available_backends`), never another backend registered under it.

    Raises:
        BackendUnavailableError: an unknown name (the message lists the registered names); a forced
            backend that cannot run (with its reasons); no backend that can run (every backend with
            its reasons).
    """
    device = _device(device)
    dtypes = tuple(dtypes)
    forced = name or os.environ.get(BACKEND_ENV) or None
    statuses = available_backends(device, dtypes)
    what = f"device={device}" + (f", dtypes={[str(d).removeprefix('torch.') for d in dtypes]}" if dtypes else "")
    if forced:
        match = [s for s in statuses if s.name == forced and s.taken_by is None]
        if not match:
            names = ", ".join(sorted({s.name for s in statuses})) or "none"
            source = "backend=" if name else f"${BACKEND_ENV}="
            raise BackendUnavailableError(f"unknown backend {source}{forced!r}; registered backends: {names}")
        status = match[0]
        if not status.available:
            raise BackendUnavailableError(
                f"backend {forced!r} was forced but cannot run for {what}: " + "; ".join(status.reasons)
            )
        assert status.backend is not None
        return status.backend
    for s in statuses:
        if s.available:
            assert s.backend is not None
            return s.backend
    raise BackendUnavailableError(f"no multiwrite backend can run for {what}:\n{_listing(statuses)}")
