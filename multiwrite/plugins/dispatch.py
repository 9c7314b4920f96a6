"""Backend discovery and selection: pluggy entry points in, one `Backend` out.

The plugin host survives its plugins: whatever a plugin does at import or in its hook (raise anything
but `KeyboardInterrupt`, `sys.exit()`, return a bare backend, a non-backend, the same backend twice,
register no hook at all) becomes a reason listed by `available_backends` and `multiwrite info`, never an
exception in the host program. Selection is deterministic: it does not depend on the order in which the
filesystem lists the installed distributions. The contract is written down in `docs/backends.md`.
"""

from __future__ import annotations

import os
import threading
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy
import torch

from multiwrite.errors import BackendUnavailableError
from multiwrite.plugins import checked, hookspecs
from multiwrite.plugins.backend import Backend
from multiwrite.plugins.checked import BackendContractError
from multiwrite.staging.layout import resolve_device

#: Environment variable that forces a backend by name, like the `backend=` arguments.
BACKEND_ENV = "MULTIWRITE_BACKEND"
#: Entry-point group (and pluggy project name) of backend plugins.
ENTRY_POINT_GROUP = "multiwrite"
#: Priority given to plugins that provide no backend (they sort last).
_FAILED_PRIORITY = -(10**9)


class BackendNameCollisionWarning(UserWarning):
    """Two installed backends share a `NAME`; the message names both distributions and the owner."""


class PluginReentryError(RuntimeError):
    """Plugin code that the host is running for `available_backends` or `select_backend` (a `multiwrite_backends`
    hook, a backend's `priority` or `not_supported_reasons`) called one of them again. Refused: the host would run the
    same plugin code again, recursing. The message names the plugin and what it was running."""


@dataclass
class BackendStatus:
    """One registered backend (or one plugin that provides none) as the dispatcher sees it for a device.

    Attributes:
        name: the backend's `NAME`; for a plugin that failed, the plugin's name (its entry-point name).
        backend: the instance, or None when its plugin failed to load or returned nothing usable, or the backend is
            set aside (it broke the contract: `multiwrite.plugins.checked`; its reason says how).
        priority: `backend.priority(device)`; `-10**9` for a failed plugin or a backend set aside.
        reasons: why it cannot run on the device checked; empty when it can.
        taken_by: `module.Class` of the backend that owns this name when another backend does (this
            one is then listed, with that as its reason, and never selected).
        distribution, version: the installed distribution that declared the plugin's entry point
            (`"multiwrite"` for the built-ins), or None for a plugin registered by hand.
        traceback: the formatted traceback of a plugin that raised at load or in its hook, else None.
    """

    name: str
    backend: Backend | None
    priority: int
    reasons: list[str] = field(default_factory=list)
    taken_by: str | None = None
    distribution: str | None = None
    version: str | None = None
    traceback: str | None = None

    @property
    def available(self) -> bool:
        """True when the backend can run on the device it was checked for."""
        return self.backend is not None and not self.reasons


@dataclass
class _Failure:
    reasons: list[str]
    distribution: str | None = None
    version: str | None = None
    traceback: str | None = None


@dataclass
class _Entry:
    backend: Backend
    name: str  # NAME and PRIORITY, read and checked once (checked.declared)
    priority: int
    plugin: str
    distribution: str | None
    version: str | None

    @property
    def builtin(self) -> bool:
        return _is_builtin_module(type(self.backend).__module__)

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else f"plugin {self.plugin!r}"
        return f"{dist} ({_qualname(self.backend)})"


class _Host:
    """The plugin manager plus what pluggy does not keep: load failures and each plugin's distribution."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.failures: dict[str, _Failure] = {}
        self.dists: dict[str, tuple[str | None, str | None]] = {}
        self.warned: set[tuple[str, ...]] = set()

    def load_entry_points(self) -> None:
        eps = sorted(
            entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (not _is_builtin_module(ep.module), _dist_of(ep)[0] or "", ep.name, ep.value),
        )
        for ep in eps:
            dist, version = _dist_of(ep)
            name = ep.name
            if self.pm.has_plugin(name) or name in self.failures:
                name = f"{ep.name} ({dist or ep.value})"
                if self.pm.has_plugin(name) or name in self.failures:
                    continue  # the same entry point seen twice (a distribution on sys.path twice)
            where = f"plugin {ep.value!r} (entry point {ep.name!r}" + (f" of {dist} {version})" if dist else ")")
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: no plugin may stop the host program
                self.failures[name] = _Failure(
                    [f"{where} failed to load: {type(exc).__name__}: {exc}"], dist, version, traceback.format_exc()
                )
                continue
            if self.pm.is_registered(plugin):  # two entry points may name one module
                continue
            try:
                self.pm.register(plugin, name=name)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # pluggy's validation of the hook implementations
                self.failures[name] = _Failure(
                    [f"{where} was rejected: {type(exc).__name__}: {exc}"], dist, version, traceback.format_exc()
                )
                continue
            if not self.pm.get_hookcallers(plugin):
                self.pm.unregister(plugin)
                self.failures[name] = _Failure(
                    [
                        f"{where} registers no hook implementation: is its `multiwrite_backends` function "
                        "decorated with `@multiwrite.hookimpl`?"
                    ],
                    dist,
                    version,
                )
                continue
            self.dists[name] = (dist, version)


#: Held while the host is built. Re-entrant: a plugin that calls back into the host while it is being imported
#: (`get_plugin_manager().register(...)`, `available_backends()`) gets the host being built, with the plugins
#: loaded so far, instead of deadlocking; another thread waits until the host is complete.
_lock = threading.RLock()
_host: _Host | None = None
_building: _Host | None = None


def _dist_of(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return str(dist.metadata["Name"]), str(dist.version)
    except Exception:
        return None, None


def _get_host() -> _Host:
    global _host, _building
    host = _host
    if host is not None:
        return host
    with _lock:
        if _host is not None:
            return _host
        if _building is not None:  # a re-entrant call from a plugin being loaded, on this thread
            return _building
        host = _building = _Host()
        try:
            host.load_entry_points()
        finally:
            _building = None
        _host = host
        return host


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every plugin of the `multiwrite` entry-point group loaded.

    Entry points are loaded in a fixed order (the built-ins first, then by distribution name, entry-point
    name and target), each on its own, so that one plugin that fails is recorded instead of stopping
    the others or the host program: any exception but `KeyboardInterrupt` (`SystemExit` included) at
    import or at registration becomes its reason in `available_backends` and in dispatch errors, with
    its traceback kept for `multiwrite info -v`. A plugin that registers no hook implementation (a
    forgotten `@hookimpl`) is listed with that reason. A second entry point with a name already in use
    is registered as `"name (distribution)"`. Plugins registered later with `register()` are seen by
    the next `select_backend` call. A plugin may call it (and `available_backends`) while it is being imported:
    it then gets the manager being built, holding the plugins loaded before it.
    """
    return _get_host().pm


def reload_plugins() -> None:
    """Forget every loaded plugin; the next call loads the entry points again (after an install)."""
    global _host
    with _lock:
        _host = None
        checked.forget_set_aside()


def builtin_only() -> None:
    """Unregister every plugin not shipped with multiwrite and forget third-party load failures, so that only the
    built-in backends are listed and selected (tests of the built-ins in an environment with other plugins). The
    next `reload_plugins` undoes it."""
    host = _get_host()
    with _lock:
        for _, plugin in list(host.pm.list_name_plugin()):
            module = getattr(plugin, "__name__", None) or type(plugin).__module__
            if not _is_builtin_module(module):
                host.pm.unregister(plugin)
        host.failures = {n: f for n, f in host.failures.items() if f.distribution == "multiwrite"}


def _is_builtin_module(module: str) -> bool:
    return module == "multiwrite.backends" or module.startswith("multiwrite.backends.")


def _qualname(backend: Backend) -> str:
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def _safe_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__} with a failing __repr__>"
    return text if len(text) <= 80 else text[:77] + "..."


#: Per thread: what plugin code the host is running for `_statuses` (None: none), to refuse a re-entrant call.
_running = threading.local()


def _where(plugin: str, dist: str | None, version: str | None) -> str:
    return f"plugin {plugin!r}" + (f" of {dist} {version}" if dist else "")


def _set_aside(name: str, exc: BackendContractError, where: str, dist: str | None, version: str | None,
               tb: str | None = None) -> BackendStatus:  # fmt: skip
    return BackendStatus(name, None, _FAILED_PRIORITY, [f"set aside ({where}): {exc.reason}"], None, dist, version, tb)


def _registered() -> tuple[list[_Entry], dict[str, _Failure], list[BackendStatus]]:
    """Every valid backend the plugins provide (each instance once, in registration order); {plugin name: failure}
    for plugins that failed or returned something that is not a list of backends; and the statuses of the backends
    set aside (a declaration that is invalid or raises, or an earlier result of the wrong type: `checked`), each under
    its NAME (a backend without a valid NAME is one more reason of its plugin instead)."""
    host = _get_host()
    entries: list[_Entry] = []
    aside: list[BackendStatus] = []
    seen: dict[int, tuple[str, str]] = {}  # id -> (plugin, how the backend is named in a reason)
    failures = {n: _Failure(list(f.reasons), f.distribution, f.version, f.traceback) for n, f in host.failures.items()}
    for impl in host.pm.hook.multiwrite_backends.get_hookimpls():
        plugin = impl.plugin_name
        dist, version = host.dists.get(plugin, (None, None))
        where = _where(plugin, dist, version)
        reasons: list[str] = []
        tb = None
        try:
            _running.what = f"the multiwrite_backends hook of {where}"
            provided: Any = impl.function()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            failures[plugin] = _Failure(
                [f"multiwrite_backends() raised {type(exc).__name__}: {exc}"], dist, version, traceback.format_exc()
            )
            continue
        if isinstance(provided, Backend):
            reasons.append(
                f"multiwrite_backends() returned a bare backend {_safe_repr(provided)}, not a list: return [backend]"
            )
            provided = ()
        elif not isinstance(provided, (list, tuple)):
            reasons.append(f"multiwrite_backends() returned {_safe_repr(provided)}, not a list of Backend instances")
            provided = ()
        for item in provided:
            if not isinstance(item, Backend):
                what = "a class, not an instance" if isinstance(item, type) else f"a {type(item).__name__}"
                reasons.append(f"multiwrite_backends() returned {_safe_repr(item)} ({what}), not a Backend instance")
                continue
            if id(item) in seen:
                owner, label = seen[id(item)]
                again = "twice" if owner == plugin else f"already provided by plugin {owner!r}"
                reasons.append(f"multiwrite_backends() returned {label} {again}")
                continue
            try:
                _running.what = f"{checked.describe(item)} of {where}"
                name, priority = checked.declared(item)
            except BackendContractError as exc:
                seen[id(item)] = (plugin, checked.describe(item))
                if exc.name is None:  # nothing to list it under but its plugin
                    reasons.append(f"set aside: {exc.reason}")
                    tb = tb or (traceback.format_exc() if exc.__cause__ is not None else None)
                else:
                    tbs = traceback.format_exc() if exc.__cause__ is not None else None
                    aside.append(_set_aside(exc.name, exc, where, dist, version, tbs))
                continue
            seen[id(item)] = (plugin, f"backend {name!r}")
            entries.append(_Entry(item, name, priority, plugin, dist, version))
        if reasons:
            failures[plugin] = _Failure(reasons, dist, version, tb)
    return entries, failures, aside


def _resolve_names(entries: list[_Entry]) -> tuple[dict[str, _Entry], dict[str, list[_Entry]]]:
    """({name: owning entry}, {name: every entry of an ambiguous third-party name}).

    A built-in backend keeps its name; among third-party backends of one name the owner is the first by
    (-PRIORITY, distribution, module.Class), so the outcome never depends on installation order. Every
    collision warns once per process (`BackendNameCollisionWarning`), naming the distributions.
    """
    by_name: dict[str, list[_Entry]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    owners: dict[str, _Entry] = {}
    ambiguous: dict[str, list[_Entry]] = {}
    host = _get_host()
    for name, group in by_name.items():
        group = sorted(group, key=lambda e: (not e.builtin, -e.priority, e.distribution or "", _qualname(e.backend)))
        owners[name] = group[0]
        if len(group) == 1:
            continue
        if not group[0].builtin:
            ambiguous[name] = group
        key = (name, *(e.describe() for e in group))
        if key not in host.warned:
            host.warned.add(key)
            rest = " and ".join(e.describe() for e in group[1:])
            warnings.warn(
                f"multiwrite: backend name {name!r} is provided by {group[0].describe()} and by {rest}; "
                f"{name!r} means the one from {group[0].describe()}"
                + ("" if group[0].builtin else ", and forcing it by name is refused as ambiguous"),
                BackendNameCollisionWarning,
                stacklevel=3,
            )
    return owners, ambiguous


def _device_status(e: _Entry, device: torch.device, dtypes: tuple[torch.dtype, ...],
                   device_writes: frozenset[str] = frozenset()) -> BackendStatus:  # fmt: skip
    """The status of the owner of a name for `device`: its reasons and priority there, each read and checked once
    (and, when `device_writes` names source kinds, its `DEVICE_WRITE_SOURCES`)."""
    b = e.backend
    where = _where(e.plugin, e.distribution, e.version)
    _running.what = f"{checked.describe(b)} of {where}"
    for method in ("not_supported_reasons", "priority"):
        try:
            if method == "not_supported_reasons":
                reasons = checked.device_reasons(b, device, dtypes)
                if device_writes:
                    reasons += checked.device_write_reasons(b, device_writes)
            else:
                prio = checked.device_priority(b, device)
        except BackendContractError as exc:
            return _set_aside(e.name, exc, where, e.distribution, e.version)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            reason = f"{method}({device}) raised {type(exc).__name__}: {exc}"
            return BackendStatus(e.name, b, _FAILED_PRIORITY, [reason], None, e.distribution, e.version,
                                 traceback.format_exc())  # fmt: skip
    return BackendStatus(e.name, b, prio, reasons, None, e.distribution, e.version)


def _statuses(
    device: torch.device, dtypes: tuple[torch.dtype, ...], api: str, device_writes: frozenset[str] = frozenset()
) -> tuple[list[BackendStatus], dict[str, list[_Entry]]]:
    _get_host()  # first: a plugin may call back into the host while it is imported (it gets the host being built)
    running = getattr(_running, "what", None)
    if running is not None:
        raise PluginReentryError(
            f"{api} was called from inside {running}, which the plugin host is running for an earlier call: the host "
            "does not re-enter (it would run the same plugin code again, recursing). Call it from Backend.apply or "
            "at import, not from multiwrite_backends, priority or not_supported_reasons"
        )
    try:
        entries, failures, out = _registered()
        owners, ambiguous = _resolve_names(entries)
        for e in entries:
            owner = owners[e.name]
            if owner is e:
                out.append(_device_status(e, device, dtypes, device_writes))
                continue
            taken_by = _qualname(owner.backend)
            reason = f"backend name {e.name!r} is already taken by {taken_by}"
            if owner.distribution and owner.distribution != e.distribution:
                reason += f" (distribution {owner.distribution})"
            out.append(BackendStatus(e.name, e.backend, e.priority, [reason], taken_by, e.distribution, e.version))
    finally:
        _running.what = None
    for name, f in failures.items():
        out.append(BackendStatus(name, None, _FAILED_PRIORITY, f.reasons, None, f.distribution, f.version, f.traceback))
    out.sort(key=lambda s: (not s.available, -s.priority, s.name, s.distribution or ""))
    return out, ambiguous


def available_backends(
    device: torch.device | str | None = None, dtypes: Iterable[torch.dtype] = (), *, device_writes: Iterable[str] = ()
) -> list[BackendStatus]:
    """Every registered backend with the reasons it cannot run on `device` (empty: it can).

    Sorted best first: available before unavailable, then by priority (higher first), then by name,
    then by distribution name, so the order never depends on installation order. Plugins that failed
    to load or returned something other than a list of `Backend` instances are listed under the
    plugin's name with the reason. Names are unique among the backends that can be selected: a
    built-in keeps its name; among third-party backends of one name the highest `PRIORITY` keeps it
    (then distribution name, then `module.Class`); any other is listed as unavailable, with `taken_by`
    set and the reason "backend name 'X' is already taken by module.Class". A collision warns once
    (`BackendNameCollisionWarning`) naming both distributions. `device_writes`: source kinds of device-sourced
    writes (`Backend.DEVICE_WRITE_SOURCES`) each backend must read, or it is unavailable with that reason.
    """
    kinds = frozenset(device_writes)
    return _statuses(resolve_device(device), tuple(dtypes), "available_backends()", kinds)[0]


def _listing(statuses: list[BackendStatus]) -> str:
    return "\n".join(f"  - {s.name}: " + ("available" if s.available else "; ".join(s.reasons)) for s in statuses)


def select_backend(
    device: torch.device | str | None = None,
    name: str | None = None,
    dtypes: Iterable[torch.dtype] = (),
    *,
    device_writes: Iterable[str] = (),
) -> Backend:
    """The backend that applies writes to tables of `dtypes` on `device`.

    Args:
        device: the tables' device (default CPU).
        name: force this backend; if None, `$MULTIWRITE_BACKEND` forces one when set and non-empty.
        dtypes: the table dtypes it must support.
        device_writes: the source kinds of device-sourced writes it must read (`Backend.DEVICE_WRITE_SOURCES`).

    With nothing forced, the first backend of `available_backends` that can run wins (highest priority,
    then name, then distribution). A name always means the backend that owns it (see
    `available_backends`), never another backend registered under it.

    Raises:
        BackendUnavailableError: an unknown name (the message lists the registered names); a name two
            third-party distributions both provide (the message lists them); a forced backend that
            cannot run (with its reasons); no backend that can run (every backend with its reasons).
    """
    device = resolve_device(device)
    dtypes = tuple(dtypes)
    forced = name or os.environ.get(BACKEND_ENV) or None
    statuses, ambiguous = _statuses(device, dtypes, "select_backend()", frozenset(device_writes))
    what = f"device={device}" + (f", dtypes={[str(d).removeprefix('torch.') for d in dtypes]}" if dtypes else "")
    if device_writes:
        what += f", device writes from {', '.join(sorted(set(device_writes)))}"
    if forced:
        source = "backend=" if name else f"${BACKEND_ENV}="
        if forced in ambiguous:
            listed = "; ".join(e.describe() for e in ambiguous[forced])
            raise BackendUnavailableError(
                f"backend {source}{forced!r} is ambiguous: {len(ambiguous[forced])} installed distributions "
                f"provide it: {listed}. Uninstall all but one, or pass the backend instance itself"
            )
        match = [s for s in statuses if s.name == forced and s.taken_by is None]
        if not match:
            names = ", ".join(sorted({s.name for s in statuses})) or "none"
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
