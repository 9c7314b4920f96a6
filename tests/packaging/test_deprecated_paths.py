"""The import paths of 0.2.0 that moved in 0.3.0 still work until 0.4.0: importing each warns (`DeprecationWarning`
naming the new path and the release that removes it) and gives the very objects of the new path; a plugin written
exactly as 0.2.0's example (`tests/data/numpy_plugin_0.2.0.py.txt`, that release's
`examples/multiwrite-numpy-plugin/src/multiwrite_numpy/plugin.py`) imports, registers and writes.

Each program runs in a fresh process: a module warns when it is first imported, once per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.distributions import install_distribution
from tests.support.processes import subprocess_env

DATA = Path(__file__).resolve().parents[1] / "data"

#: old module -> (its new home, the names 0.2.0 exported there); a module of its own: importing it warns
MODULES = {
    "multiwrite.backend": ("multiwrite.plugins.backend", [
        "META_COLUMNS", "META_LENGTH", "META_ROW", "META_START", "META_TABLE", "META_VALUE_OFFSET",
        "PRIORITY_BUILTIN_CPU", "PRIORITY_BUILTIN_GPU", "PRIORITY_FALLBACK", "Backend", "WriteBatch"]),
    "multiwrite.dispatch": ("multiwrite.plugins.dispatch", [
        "BACKEND_ENV", "ENTRY_POINT_GROUP", "BackendNameCollisionWarning", "BackendStatus", "available_backends",
        "get_plugin_manager", "reload_plugins", "select_backend"]),
    "multiwrite.hookspecs": ("multiwrite.plugins.hookspecs", ["hookimpl", "hookspec", "multiwrite_backends"]),
    "multiwrite.block_tables": ("multiwrite.tables.block_tables", ["BlockTables"]),
}  # fmt: skip
#: (package, name) -> the new home: 0.2.0's module of that path is a package now; the name warns when first read
NAMES = {
    **{("multiwrite.staging", n): "multiwrite.staging.layout" for n in (
        "META_TABLE", "META_ROW", "META_START", "META_LENGTH", "META_VALUE_OFFSET", "META_COLUMNS", "SUPPORTED_DTYPES",
        "dtype_name", "shape_text", "strict_index", "check_dtype", "check_device", "device_unavailable_reason")},
    ("multiwrite.staging", "StagedWriteTensor"): "multiwrite.staging.table",
    ("multiwrite.staging", "expand_kernel_blocks"): "multiwrite.staging.values",
    ("multiwrite.stage", "PAD_SLOT_ID"): "multiwrite.stage.layout",
    ("multiwrite.stage", "StageInputError"): "multiwrite.errors",
}  # fmt: skip

PROGRAM = """
import importlib, json, sys, warnings
modules, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for old, (new, exported) in modules.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    home = importlib.import_module(new)
    out[old] = dict(warnings=[(w.category.__name__, str(w.message), w.filename) for w in caught],
                    same=[n for n in exported if getattr(mod, n) is getattr(home, n)], all=sorted(mod.__all__))
for package, name, new in names:
    pkg = importlib.import_module(package)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from {package} import {name} as value", globals())
        again = getattr(pkg, name)
    out[f"{package}.{name}"] = dict(warnings=[(w.category.__name__, str(w.message), w.filename) for w in caught],
                                    same=value is again is getattr(importlib.import_module(new), name))
print("RESULT " + json.dumps(out))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])


@pytest.fixture(scope="module")
def aliases() -> dict:
    names = [[p, n, new] for (p, n), new in NAMES.items()]
    return _result(subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(MODULES), json.dumps(names)],
                                  env=subprocess_env(), capture_output=True, text=True, timeout=120))  # fmt: skip


@pytest.mark.parametrize("old", sorted(MODULES))
def test_an_old_module_warns_once_naming_its_new_home_and_gives_the_same_objects(aliases, old):
    new, exported = MODULES[old]
    r = aliases[old]
    assert r["warnings"] == [["DeprecationWarning", f"{old} is deprecated: import from {new} instead ({old} is "
                              "removed in 0.4.0)", "<string>"]]  # fmt: skip
    assert r["same"] == exported and r["all"] == sorted(exported)


@pytest.mark.parametrize(("package", "name"), sorted(NAMES))
def test_an_old_name_of_a_module_now_a_package_warns_once_and_is_the_same_object(aliases, package, name):
    r = aliases[f"{package}.{name}"]
    home = NAMES[package, name]
    message = f"{package}.{name} is deprecated: import it from {home} instead (the alias is removed in 0.4.0)"
    assert r["warnings"] == [["DeprecationWarning", message, "<string>"]]
    assert r["same"]


def test_the_new_paths_do_not_warn():
    code = ("import warnings\nwarnings.simplefilter('error')\nimport multiwrite.plugins.backend, "
            "multiwrite.plugins.dispatch, multiwrite.staging.table, multiwrite.stage.layout\n"
            "import multiwrite.staging, multiwrite.stage\nfrom multiwrite import BlockTables, Backend, hookimpl\n")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


EXAMPLE_PROGRAM = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import multiwrite
    status = next(s for s in multiwrite.available_backends("cpu") if s.name == "numpy-cpu")
    bt = multiwrite.BlockTables([16], 2, [4], "cpu", backend="numpy-cpu")
    bt.append_block_ids(1, ([3, 4],), overwrite=True)
    bt.apply_staged_writes()
print("RESULT " + json.dumps(dict(available=status.available, reasons=status.reasons, dist=status.distribution,
                                  module=type(bt.backend).__module__, row=bt[0].tensor[1].tolist(),
                                  warnings=[(w.category.__name__, str(w.message)) for w in caught])))
"""


def test_a_plugin_written_as_the_0_2_0_example_imports_registers_and_writes(tmp_path):
    source = (DATA / "numpy_plugin_0.2.0.py.txt").read_text()
    assert "from multiwrite.backend import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET" in source
    install_distribution(tmp_path, "multiwrite-numpy-plugin", "multiwrite_numpy_020", source, entry="numpy-cpu")
    r = _result(subprocess.run([sys.executable, "-c", EXAMPLE_PROGRAM], env=subprocess_env(tmp_path),
                               capture_output=True, text=True, timeout=120))  # fmt: skip
    assert (r["available"], r["reasons"], r["dist"]) == (True, [], "multiwrite-numpy-plugin")
    assert r["module"] == "multiwrite_numpy_020" and r["row"] == [3, 4, 0, 0]
    message = (
        "multiwrite.backend is deprecated: import from multiwrite.plugins.backend instead (multiwrite.backend is "
        "removed in 0.4.0)"
    )
    assert r["warnings"] == [["DeprecationWarning", message]]
