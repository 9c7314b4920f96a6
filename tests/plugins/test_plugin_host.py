"""The plugin host survives its plugins, found through real entry points: each host program runs in a fresh process,
so a crash of the host (what a faulty plugin would cause) shows as a failure here, not as a dead test session.

Plugins are fake distributions (a module and a `*.dist-info` declaring an entry point in the `multiwrite` group) in a
temporary directory on `PYTHONPATH`. Every faulty plugin is installed at once (as they may be in a user's environment)
and one host program, which imports multiwrite and uses it with a built-in backend, runs once for all of them; each
test checks one fault in its report. Name collisions, an interrupt and a plugin that calls back into the host while it
is imported run programs of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import BUILTIN, CPU_DEFAULT
from tests.support.distributions import backend_source, install_distribution
from tests.support.processes import subprocess_env

# Uses the library as a host program would, with a forced built-in, then reports what dispatch sees.
PROGRAM = """
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import multiwrite
    from multiwrite import BlockTables
    bt = BlockTables([16], 2, [4], "cpu", backend="torch-cpu")
    bt.append_block_ids(1, ([3, 4],), overwrite=True)
    bt.apply_staged_writes()
    assert bt[0].tensor[1].tolist() == [3, 4, 0, 0]
    statuses = [
        dict(name=s.name, available=s.available, reasons=s.reasons, distribution=s.distribution,
             version=s.version, taken_by=s.taken_by, module=type(s.backend).__module__ if s.backend else None,
             traceback=s.traceback)
        for s in multiwrite.available_backends("cpu")
    ]
    plugins = {name: getattr(p, "__name__", type(p).__name__)
               for name, p in multiwrite.get_plugin_manager().list_name_plugin()}
    forced = {}
    for name in sys.argv[1:]:
        try:
            forced[name] = ["selected", type(multiwrite.select_backend("cpu", name)).__module__]
        except multiwrite.BackendUnavailableError as exc:
            forced[name] = ["refused", str(exc)]
    auto = type(multiwrite.select_backend("cpu")).__module__
    from multiwrite.plugins.dispatch import builtin_only, reload_plugins
    builtin_only()
    only = sorted((s.name, s.distribution) for s in multiwrite.available_backends("cpu"))
    reload_plugins()
    reloaded = len(multiwrite.available_backends("cpu"))
print("RESULT " + json.dumps(dict(statuses=statuses, plugins=plugins, forced=forced, auto=auto, only=only,
                                  reloaded=reloaded, warnings=[str(w.message) for w in caught])))
"""


def run(*roots: Path, forced: tuple[str, ...] = (), program: str = PROGRAM) -> dict:
    """Run `program` with the distributions of `roots` installed; its RESULT line, decoded."""
    proc = subprocess.run([sys.executable, "-c", program, *forced], env=subprocess_env(*roots), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, f"the host program died (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def status(result: dict, name: str) -> dict:
    matches = [s for s in result["statuses"] if s["name"] == name]
    assert len(matches) == 1, f"{name}: {matches}"
    return matches[0]


def _hook(returned: str) -> str:
    return f"\n@hookimpl\ndef multiwrite_backends():\n    return {returned}\n"


#: plugin -> (what its hook returns, the reason it is listed with)
RETURNS = {
    "bare-backend": ("_B", "returned a bare backend <Bare 'bare-bare-backend'>, not a list: return [backend]"),
    "non-backend": ("[_B, 'torch-cpu']", "returned 'torch-cpu' (a str), not a Backend instance"),
    "class": ("[Bare]", "returned <class 'returns_class.Bare'> (a class, not an instance), not a Backend instance"),
    "duplicate": ("[_B, _B]", "returned backend 'bare-duplicate' twice"),
    "none": ("None", "returned None, not a list of Backend instances"),
}
#: plugin -> (the module's source, the reason it is listed with)
FAILS_AT_IMPORT = {
    "exiting-plugin": ("import sys\nsys.exit('no device here')\n", "failed to load: SystemExit: no device here"),
    "importing-plugin": ("def _load():\n    raise ImportError('needs libfoo.so')\n\n_load()\n",
                         "failed to load: ImportError: needs libfoo.so"),
}  # fmt: skip
#: plugin -> (the exception its hook raises, the reason it is listed with)
HOOK_RAISES = {
    "hook-runtime-error": ("RuntimeError('driver exploded')",
                           "multiwrite_backends() raised RuntimeError: driver exploded"),
    "hook-system-exit": ("SystemExit(3)", "multiwrite_backends() raised SystemExit: 3"),
}  # fmt: skip


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict:
    """Every faulty plugin below, and an impostor of a built-in's name, installed at once; the host program's view."""
    root = tmp_path_factory.mktemp("faulty")
    for dist, (source, _) in FAILS_AT_IMPORT.items():
        install_distribution(root, dist, dist.replace("-", "_"), source)
    for dist, (exc, _) in HOOK_RAISES.items():
        source = f"from multiwrite import hookimpl\n\n@hookimpl\ndef multiwrite_backends():\n    raise {exc}\n"
        install_distribution(root, dist, dist.replace("-", "_"), source)
    for key, (returned, _) in RETURNS.items():
        source = backend_source("Bare", f"bare-{key}") + "\n_B = Bare()\n" + _hook(returned)
        install_distribution(root, f"returns-{key}", f"returns_{key.replace('-', '_')}", source)
    install_distribution(root, "quiet-plugin", "quiet_plugin", backend_source("Quiet", "quiet")
                         + "\ndef multiwrite_backends():  # no @hookimpl\n    return [Quiet()]\n")  # fmt: skip
    # pluggy rejects a hook implementation whose arguments the specification does not have
    install_distribution(root, "rejected-plugin", "rejected_plugin", backend_source("Rejected", "rejected")
                         + "\n@hookimpl\ndef multiwrite_backends(device):\n    return [Rejected()]\n")  # fmt: skip
    # a third-party entry point named like a built-in, with a backend of the built-in's name and a higher priority
    install_distribution(root, "impostor-plugin", "impostor_plugin",
                         backend_source("Impostor", "torch-cpu", priority=1000) + _hook("[Impostor()]"),
                         entry="torch-cpu")  # fmt: skip
    return run(root, forced=("exiting-plugin", "importing-plugin", "torch-cpu"))


@pytest.mark.parametrize("plugin", sorted(FAILS_AT_IMPORT))
def test_a_plugin_failing_at_import_is_a_reason_with_its_distribution_and_traceback(faulty, plugin):
    s = status(faulty, plugin)
    assert not s["available"] and (s["distribution"], s["version"]) == (plugin, "1.0")
    assert s["reasons"] == [f"plugin {plugin.replace('-', '_')!r} (entry point {plugin!r} of {plugin} 1.0) "
                            + FAILS_AT_IMPORT[plugin][1]]  # fmt: skip
    assert "Traceback (most recent call last)" in s["traceback"]
    assert FAILS_AT_IMPORT[plugin][1].split(": ")[-1] in s["traceback"]
    verdict, message = faulty["forced"][plugin]
    assert verdict == "refused" and f"{plugin!r} was forced but cannot run" in message
    assert FAILS_AT_IMPORT[plugin][1] in message


@pytest.mark.parametrize("plugin", sorted(HOOK_RAISES))
def test_a_hook_that_raises_is_a_reason(faulty, plugin):
    s = status(faulty, plugin)
    assert s["reasons"] == [HOOK_RAISES[plugin][1]] and not s["available"]
    assert s["distribution"] == plugin and "Traceback" in s["traceback"]


@pytest.mark.parametrize("key", sorted(RETURNS))
def test_hook_return_values_are_validated(faulty, key):
    s = status(faulty, f"returns-{key}")
    assert not s["available"] and s["reasons"] == ["multiwrite_backends() " + RETURNS[key][1]]
    # the valid backends of a list stay available; nothing of a bare backend, a class or None is used
    valid = [x["available"] for x in faulty["statuses"] if x["name"] == f"bare-{key}"]
    assert valid == ([True] if key in ("non-backend", "duplicate") else [])


def test_a_plugin_with_a_forgotten_hookimpl_is_listed(faulty):
    s = status(faulty, "quiet-plugin")
    assert s["reasons"] == [
        "plugin 'quiet_plugin' (entry point 'quiet-plugin' of quiet-plugin 1.0) registers no hook implementation: is "
        "its `multiwrite_backends` function decorated with `@multiwrite.hookimpl`?"
    ]
    assert s["distribution"] == "quiet-plugin" and not any(x["name"] == "quiet" for x in faulty["statuses"])


def test_a_hook_that_pluggy_rejects_at_registration_is_a_reason(faulty):
    s = status(faulty, "rejected-plugin")
    assert s["reasons"][0].startswith("plugin 'rejected_plugin' (entry point 'rejected-plugin' of rejected-plugin 1.0)"
                                      " was rejected: PluginValidationError")  # fmt: skip
    assert "device" in s["reasons"][0] and not any(x["name"] == "rejected" for x in faulty["statuses"])


def test_the_host_program_survives_every_fault_and_selects_a_builtin(faulty):
    assert faulty["auto"].startswith("multiwrite.backends.")
    listed = {s["name"] for s in faulty["statuses"]}
    assert {*FAILS_AT_IMPORT, *HOOK_RAISES, *(f"returns-{k}" for k in RETURNS), "quiet-plugin", "rejected-plugin"} <= (
        listed
    )


def test_builtin_only_leaves_the_builtins_and_a_reload_brings_the_plugins_back(faulty):
    assert faulty["only"] == [[name, "multiwrite"] for name in sorted(BUILTIN)]
    assert faulty["reloaded"] == len(faulty["statuses"])


def test_an_entry_point_reusing_a_builtin_name_never_replaces_the_builtin(faulty):
    assert faulty["plugins"]["torch-cpu"] == "multiwrite.backends.torch_cpu"
    assert faulty["plugins"]["torch-cpu (impostor-plugin)"] == "impostor_plugin"
    assert faulty["forced"]["torch-cpu"] == ["selected", "multiwrite.backends.torch_cpu"]
    impostor = [s for s in faulty["statuses"] if s["module"] == "impostor_plugin"]
    assert [(s["name"], s["available"], s["taken_by"]) for s in impostor] == [
        ("torch-cpu", False, "multiwrite.backends.torch_cpu.TorchCpuBackend")
    ]
    assert impostor[0]["reasons"] == [
        "backend name 'torch-cpu' is already taken by multiwrite.backends.torch_cpu.TorchCpuBackend (distribution "
        "multiwrite)"
    ]
    assert any("'torch-cpu' is provided by multiwrite" in w and "impostor-plugin 1.0" in w for w in faulty["warnings"])


# One program, two sys.path orders: the host is reloaded between them (`reload_plugins`).
COLLISION_PROGRAM = """
import json, sys, warnings
import multiwrite
from multiwrite.plugins.dispatch import reload_plugins
first, second = sys.argv[1:3]
out = []
for order in ([first, second], [second, first]):
    sys.path[:0] = order
    reload_plugins()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twins = [(s.distribution, s.available, s.taken_by) for s in multiwrite.available_backends("cpu")
                 if s.name == "twin"]
        auto = type(multiwrite.select_backend("cpu")).__name__
        try:
            multiwrite.select_backend("cpu", "twin")
            forced = None
        except multiwrite.BackendUnavailableError as exc:
            forced = str(exc)
    out.append(dict(twins=twins, auto=auto, forced=forced, warnings=[str(w.message) for w in caught],
                    categories=[w.category.__name__ for w in caught]))
    del sys.path[:2]
print("RESULT " + json.dumps(out))
"""


def test_a_shared_name_is_owned_by_priority_whatever_the_order_warns_and_forcing_it_is_ambiguous(tmp_path):
    """Two distributions provide `twin`: `beta-plugin`'s (priority 70) owns it in both sys.path orders, it wins the
    auto-selection over `alpha-plugin`'s (priority 60), a warning names both distributions, and forcing `twin` is
    refused as ambiguous, listing both."""
    a, b = tmp_path / "a", tmp_path / "b"
    install_distribution(a, "alpha-plugin", "alpha_twin", backend_source("AlphaTwin", "twin", 60)
                         + _hook("[AlphaTwin()]"), entry="twin")  # fmt: skip
    install_distribution(b, "beta-plugin", "beta_twin", backend_source("BetaTwin", "twin", 70)
                         + _hook("[BetaTwin()]"), entry="twin")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", COLLISION_PROGRAM, str(a), str(b)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    for r in results:
        assert r["twins"] == [["beta-plugin", True, None], ["alpha-plugin", False, "beta_twin.BetaTwin"]]
        assert r["auto"] == "BetaTwin"
        assert r["categories"] == ["BackendNameCollisionWarning"]
        assert "'twin' is provided by beta-plugin 1.0 (beta_twin.BetaTwin) and by alpha-plugin 1.0" in r["warnings"][0]
        assert r["forced"].startswith("backend backend='twin' is ambiguous: 2 installed distributions provide it: ")
        assert "beta-plugin 1.0 (beta_twin.BetaTwin)" in r["forced"]
        assert "alpha-plugin 1.0 (alpha_twin.AlphaTwin)" in r["forced"]


INTERRUPT_PROGRAM = """
import multiwrite
try:
    multiwrite.available_backends("cpu")
except KeyboardInterrupt as exc:
    print("INTERRUPTED", exc)
else:
    print("NOT INTERRUPTED")
"""


@pytest.mark.parametrize("where", ["import", "hook"])
def test_a_keyboard_interrupt_in_a_plugin_reaches_the_host_program(tmp_path, where):
    """Ctrl-C while a plugin imports or runs its hook is the user's: it propagates as KeyboardInterrupt."""
    source = (
        "raise KeyboardInterrupt('at import')\n"
        if where == "import"
        else "from multiwrite import hookimpl\n\n@hookimpl\ndef multiwrite_backends():\n"
        "    raise KeyboardInterrupt('in the hook')\n"
    )
    install_distribution(tmp_path, "interrupted-plugin", "interrupted_plugin", source)
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_PROGRAM], env=subprocess_env(tmp_path), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"INTERRUPTED {'at import' if where == 'import' else 'in the hook'}"


# A plugin that, while the host imports it, registers another plugin and lists the backends (on its own thread), and
# starts a thread that lists them too; the host program imports multiwrite in a thread joined with a timeout, so that
# a deadlock fails this test instead of hanging it.
REENTRANT_PLUGIN = backend_source("Reentrant", "reentrant", 5) + textwrap.dedent(
    """
    import threading

    import multiwrite

    class Extra(Reentrant):
        NAME = "reentrant-extra"

    class ExtraPlugin:
        @hookimpl
        def multiwrite_backends(self):
            return [Extra()]

    SEEN = {}
    try:
        multiwrite.get_plugin_manager().register(ExtraPlugin(), name="reentrant-extra-plugin")
        SEEN["during import"] = sorted(s.name for s in multiwrite.available_backends("cpu") if s.available)
    except Exception as exc:  # a clear error is acceptable: recorded, and the test says which
        SEEN["error"] = f"{type(exc).__name__}: {exc}"

    def _other_thread():
        SEEN["other thread"] = sorted(s.name for s in multiwrite.available_backends("cpu") if s.available)

    OTHER = threading.Thread(target=_other_thread, daemon=True)
    OTHER.start()

    @hookimpl
    def multiwrite_backends():
        return [Reentrant()]
    """
)
REENTRANT_PROGRAM = """
import json, os, sys, threading
done = {}

def host():
    import multiwrite
    done["statuses"] = sorted(s.name for s in multiwrite.available_backends("cpu") if s.available)
    done["selected"] = multiwrite.select_backend("cpu", "reentrant-extra").NAME

t = threading.Thread(target=host, daemon=True)
t.start()
t.join(60)
if t.is_alive():
    print("RESULT " + json.dumps({"deadlock": True}), flush=True)
    os._exit(0)
import reentrant_plugin
reentrant_plugin.OTHER.join(60)
print("RESULT " + json.dumps({"deadlock": reentrant_plugin.OTHER.is_alive(), "seen": reentrant_plugin.SEEN, **done}))
"""


def test_a_plugin_calling_back_into_the_host_while_it_is_imported_does_not_deadlock(tmp_path):
    install_distribution(tmp_path, "reentrant-plugin", "reentrant_plugin", REENTRANT_PLUGIN)
    proc = subprocess.run([sys.executable, "-c", REENTRANT_PROGRAM], env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert not result["deadlock"], "the host deadlocked while a plugin called back into it"
    seen = result["seen"]
    assert "error" not in seen, seen["error"]
    # on the importing thread: the host being built, the built-ins (loaded first) and the plugin registered just now
    assert {"torch-cpu", "compiled-cpu", "torch-generic", "reentrant-extra"} <= set(seen["during import"])
    assert "reentrant" not in seen["during import"]  # its own hook is registered after its import
    # another thread waits for the complete host; so does the host program
    for names in (seen["other thread"], result["statuses"]):
        assert {"torch-cpu", "reentrant", "reentrant-extra"} <= set(names)
    assert result["selected"] == "reentrant-extra"


def _info(*roots: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multiwrite", "info"], env=subprocess_env(*roots),
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def _line(out: str, name: str, device: str = "cpu") -> str:
    lines = out.splitlines()
    start = lines.index(f"backends for {device}:")
    return next(x for x in lines[start + 1 :] if x.startswith(f"  {name} "))


CALLING_PLUGIN = backend_source("Calling", "calling") + """
import multiwrite

@hookimpl
def multiwrite_backends():
    multiwrite.available_backends("cpu")
    return [Calling()]
"""
# The first thing the program asks: nothing has imported Triton yet.
FIRST_LISTING_PROGRAM = """
import json, multiwrite
print("RESULT " + json.dumps({str(d): {s.name: s.reasons for s in multiwrite.available_backends(d)}
                              for d in ("cpu", "cuda")}))
"""


def test_a_hook_calling_back_into_the_host_is_its_own_reason_and_never_another_backends(tmp_path):
    """The hook of `calling-plugin` calls `available_backends()`: refused (no recursion), named as that plugin's
    reason; Triton's reasons are those of a process without the plugin (the recursion once cached "triton is not
    importable (RecursionError ...)" for the whole process)."""
    install_distribution(tmp_path, "calling-plugin", "calling_plugin", CALLING_PLUGIN)
    calling = run(tmp_path, program=FIRST_LISTING_PROGRAM)
    clean = run(program=FIRST_LISTING_PROGRAM)
    assert calling["cpu"]["calling-plugin"] == [
        "multiwrite_backends() raised PluginReentryError: available_backends() was called from inside the "
        "multiwrite_backends hook of plugin 'calling-plugin' of calling-plugin 1.0, which the plugin host is running "
        "for an earlier call: the host does not re-enter (it would run the same plugin code again, recursing). Call it "
        "from Backend.apply or at import, not from multiwrite_backends, priority or not_supported_reasons"
    ]
    for device in ("cpu", "cuda"):
        for name in ("triton-cuda", "triton-rocm"):
            assert calling[device][name] == clean[device][name]
    assert "Recursion" not in json.dumps(calling)


def test_info_exits_0_and_lists_a_backend_set_aside_with_its_reason(tmp_path):
    """`multiwrite info` with a backend whose PRIORITY `int()` rejects (it exited 3, naming no plugin) and the plugin
    calling back into the host installed: exit 0, both listed with their reasons, the built-in selected."""
    install_distribution(tmp_path, "bad-priority-plugin", "bad_priority_plugin",
                         backend_source("BadPriority", "bad-priority").replace("PRIORITY = 5", "PRIORITY = 'high'")
                         + _hook("[BadPriority()]"))  # fmt: skip
    install_distribution(tmp_path, "calling-plugin", "calling_plugin", CALLING_PLUGIN)
    bad = _info(tmp_path)
    assert bad.returncode == 0, bad.stderr
    assert "priority    -  unavailable: set aside (plugin 'bad-priority-plugin' of bad-priority-plugin 1.0): backend " \
           "'bad-priority' (bad_priority_plugin.BadPriority): PRIORITY='high' (a str) is not an int (allowed: an int" \
           in _line(bad.stdout, "bad-priority")  # fmt: skip
    assert "unavailable: multiwrite_backends() raised PluginReentryError: available_backends() was called from " \
           "inside the multiwrite_backends hook of plugin 'calling-plugin' of calling-plugin 1.0" \
           in _line(bad.stdout, "calling-plugin")  # fmt: skip
    assert "<- selected" in _line(bad.stdout, CPU_DEFAULT)
