"""The plugin host survives its plugins: each fault runs in a fresh subprocess, so a crash of the host
program (what a faulty plugin did before) shows as a failure here, not as a dead test session.

The faulty plugins are fake distributions (a module and a `*.dist-info` with an entry point in the
`multiwrite` group) in a temporary directory on `PYTHONPATH`. All of them are installed together (as
they may be in a user's environment) and one program that imports multiwrite and uses it with
`backend="torch-cpu"` runs once for the module; each test checks one fault in its result. Name
collisions and `multiwrite info` run programs of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BACKEND_CLASS = """
from multiwrite import Backend, hookimpl

class {cls}(Backend):
    NAME = {name!r}
    PRIORITY = {priority}
    SUPPORTED_DEVICE_TYPES = frozenset({{"cpu"}})

    def apply(self, batches):
        from multiwrite import select_backend
        select_backend("cpu", "torch-cpu").apply(batches)
"""

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
    forced = sys.argv[1] if len(sys.argv) > 1 else None
    selected = error = None
    try:
        selected = type(multiwrite.select_backend("cpu", forced)).__module__
    except multiwrite.BackendUnavailableError as exc:
        error = str(exc)
print("RESULT " + json.dumps(dict(statuses=statuses, selected=selected, error=error,
                                  warnings=[str(w.message) for w in caught])))
"""


def install(root: Path, dist: str, module: str, source: str, entry: str | None = None, version: str = "1.0") -> None:
    """A fake installed distribution `dist` whose entry point `entry` (default: dist) names `module`."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[multiwrite]\n{entry or dist} = {module}\n")


def run(root: Path, *args: str, program: str = PROGRAM) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.pop("MULTIWRITE_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", program, *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the host program died (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def status(result: dict, name: str) -> dict:
    matches = [s for s in result["statuses"] if s["name"] == name]
    assert len(matches) == 1, f"{name}: {matches}"
    return matches[0]


RETURNS = {
    "bare-backend": ("_B", "returned a bare backend <Bare 'bare-bare-backend'>, not a list: return [backend]"),
    "non-backend": ("[_B, 'torch-cpu']", "returned 'torch-cpu' (a str), not a Backend instance"),
    "class": ("[Bare]", "(a class, not an instance), not a Backend instance"),
    "duplicate": ("[_B, _B]", "returned backend 'bare-duplicate' twice"),
    "none": ("None", "returned None, not a list of Backend instances"),
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict:
    """Every faulty plugin below installed at once; the host program's view of them."""
    root = tmp_path_factory.mktemp("faulty")
    install(root, "exiting-plugin", "exiting_plugin", "import sys\nsys.exit('no device here')\n")
    install(root, "hook-exit", "hook_exit", "from multiwrite import hookimpl\n\n@hookimpl\n"
            "def multiwrite_backends():\n    raise SystemExit(3)\n")  # fmt: skip
    for key, (returned, _) in RETURNS.items():
        source = BACKEND_CLASS.format(cls="Bare", name=f"bare-{key}", priority=5) + (
            f"\n_B = Bare()\n\n@hookimpl\ndef multiwrite_backends():\n    return {returned}\n"
        )
        install(root, f"returns-{key}", f"returns_{key.replace('-', '_')}", source)
    source = BACKEND_CLASS.format(cls="Quiet", name="quiet", priority=5) + (
        "\ndef multiwrite_backends():  # no @hookimpl\n    return [Quiet()]\n"
    )
    install(root, "quiet-plugin", "quiet_plugin", source)
    return run(root)


def test_plugin_calling_sys_exit_at_import_is_a_reason(faulty):
    s = status(faulty, "exiting-plugin")
    assert not s["available"] and s["distribution"] == "exiting-plugin" and s["version"] == "1.0"
    assert "failed to load: SystemExit: no device here" in s["reasons"][0]
    assert "sys.exit('no device here')" in s["traceback"]
    assert faulty["selected"].startswith("multiwrite.backends.")


def test_plugin_raising_system_exit_in_its_hook_is_a_reason(faulty):
    assert status(faulty, "hook-exit")["reasons"] == ["multiwrite_backends() raised SystemExit: 3"]


@pytest.mark.parametrize("key", sorted(RETURNS))
def test_hook_return_values_are_validated(faulty, key):
    s = status(faulty, f"returns-{key}")
    assert not s["available"] and RETURNS[key][1] in s["reasons"][0]
    valid = [x for x in faulty["statuses"] if x["name"] == f"bare-{key}"]
    assert [x["available"] for x in valid] == ([True] if key in ("non-backend", "duplicate") else [])


def test_plugin_with_a_forgotten_hookimpl_is_listed(faulty):
    s = status(faulty, "quiet-plugin")
    assert "registers no hook implementation" in s["reasons"][0] and "@multiwrite.hookimpl" in s["reasons"][0]
    assert s["distribution"] == "quiet-plugin"


@pytest.mark.parametrize("order", ["a-first", "b-first"])
def test_name_collision_is_deterministic_warns_and_forcing_is_ambiguous(tmp_path, order):
    """Two distributions provide `twin`; whichever sys.path lists first, `beta-plugin`'s (priority 7)
    owns the name, a warning names both distributions, and forcing `twin` is an error listing both."""
    roots = {d: tmp_path / d for d in ("a", "b")}
    for root in roots.values():
        root.mkdir()
    install(roots["a"], "alpha-plugin", "alpha_twin", BACKEND_CLASS.format(cls="AlphaTwin", name="twin", priority=3)
            + "\n@hookimpl\ndef multiwrite_backends():\n    return [AlphaTwin()]\n", entry="twin")  # fmt: skip
    install(roots["b"], "beta-plugin", "beta_twin", BACKEND_CLASS.format(cls="BetaTwin", name="twin", priority=7)
            + "\n@hookimpl\ndef multiwrite_backends():\n    return [BetaTwin()]\n", entry="twin")  # fmt: skip
    first, second = (roots["a"], roots["b"]) if order == "a-first" else (roots["b"], roots["a"])
    program = f"import sys; sys.path[:0] = [{str(first)!r}, {str(second)!r}]\n" + PROGRAM
    result = run(tmp_path, "twin", program=program)
    twins = [s for s in result["statuses"] if s["name"] == "twin"]
    assert [(s["distribution"], s["available"]) for s in twins] == [("beta-plugin", True), ("alpha-plugin", False)]
    assert twins[1]["taken_by"] == "beta_twin.BetaTwin"
    assert any("alpha-plugin" in w and "beta-plugin" in w and "'twin'" in w for w in result["warnings"])
    assert result["selected"] is None
    assert "'twin' is ambiguous" in result["error"]
    assert "beta-plugin 1.0 (beta_twin.BetaTwin)" in result["error"]
    assert "alpha-plugin 1.0 (alpha_twin.AlphaTwin)" in result["error"]


def test_info_shows_distributions_and_verbose_shows_a_traceback(tmp_path):
    source = "def _load():\n    raise ImportError('needs libfoo')\n\n_load()\n"
    install(tmp_path, "exploding-plugin", "exploding_plugin", source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("MULTIWRITE_BACKEND", None)
    cmd = [sys.executable, "-m", "multiwrite.cli", "info"]
    plain = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    verbose = subprocess.run([*cmd, "-v"], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and verbose.returncode == 0, plain.stderr + verbose.stderr
    line = next(x for x in plain.stdout.splitlines() if x.strip().startswith("exploding-plugin"))
    assert "exploding-plugin 1.0" in line and "ImportError: needs libfoo" in line
    assert "multiwrite 0." in next(x for x in plain.stdout.splitlines() if x.strip().startswith("torch-cpu"))
    assert "Traceback" not in plain.stdout
    assert "Traceback (most recent call last)" in verbose.stdout and "in _load" in verbose.stdout
