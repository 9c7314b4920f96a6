"""The example plugin package, installed into a fresh environment, against the conformance kit.

Slow (a venv and two editable installs, then the kit four times): marked `slow`, run by `tox -e plugin` (part of CI),
skipped by `tox -e cpu`. No network: the new venv sees this interpreter's packages (torch, multiwrite, pytest,
hypothesis) through a `.pth` file, and pip installs with `--no-deps --no-build-isolation --no-index`.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _run(args, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MULTIWRITE_BACKEND", None)
    env.pop("PYTHONPATH", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> tuple[Path, Path]:
    """(python of a fresh venv with both example packages installed, the copied examples directory)."""
    if not EXAMPLES.is_dir():
        pytest.skip("not run from a source tree")
    root = tmp_path_factory.mktemp("plugin-env")
    examples = root / "examples"
    shutil.copytree(EXAMPLES, examples, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    venv = root / "venv"
    # No pip of its own: pip, setuptools and the rest come from this interpreter's environment.
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # The parent environment's packages (this may itself be a venv, which --system-site-packages skips).
    parents = [p for p in site.getsitepackages() if os.path.isdir(p)]
    Path(purelib, "zz_parent_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    for name in ("multiwrite-numpy-plugin", "multiwrite-numpy-plugin-broken"):
        pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        done = _run([*pip, "-e", str(examples / name)])
        assert done.returncode == 0, done.stdout + done.stderr
    return python, examples


def test_the_example_plugin_passes_the_kit_shows_in_info_and_changes_no_auto_selection(plugin_env):
    python, examples = plugin_env
    done = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=examples / "multiwrite-numpy-plugin")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    info = _run([str(python), "-m", "multiwrite", "info"])
    line = next(x for x in info.stdout.splitlines() if x.strip().startswith("numpy-cpu "))
    assert "multiwrite-numpy-plugin 0.1.0" in line and "available" in line
    selected = next(x for x in info.stdout.splitlines() if "<- selected" in x)
    assert "numpy-cpu" not in selected  # priority -50: installing it changes no auto-selection


def test_the_broken_copy_fails_exactly_the_overlap_properties_of_the_kit(plugin_env):
    python, examples = plugin_env
    broken = examples / "multiwrite-numpy-plugin-broken"
    done = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=broken)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    failed = {line.split("::")[1].split("[")[0].split(" ")[0] for line in done.stdout.splitlines()
              if line.startswith("FAILED")}  # fmt: skip
    assert {
        "test_overlapping_empty_and_full_width_writes",
        "test_overlapping_writes_later_wins_across_applies_and_rows",
        "test_block_tables_restaged_row_in_one_step",
        "test_replay_with_overlapping_writes_matches_reference",
    } <= failed
    assert "test_kernel_block_expansion" not in failed  # no overlaps there: it only gets overlaps wrong
    assert "test_mixed_dtypes_in_one_apply" not in failed


def test_check_backend_passes_the_builtins_and_fails_the_broken_plugin(plugin_env):
    python, _ = plugin_env
    cli = [str(python), "-m", "multiwrite", "check-backend"]
    bad = _run([*cli, "numpy-cpu-broken", "--examples", "20"])
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL  test_overlapping_empty_and_full_width_writes" in bad.stdout
    assert "PASS  test_kernel_block_expansion " in bad.stdout
    assert bad.stdout.strip().splitlines()[-1].startswith("result: numpy-cpu-broken: FAILED")
    for name in ("torch-cpu", "compiled-cpu", "torch-generic"):
        good = _run([*cli, name, "--device", "cpu", "--examples", "20"])
        assert good.returncode == 0, good.stdout + good.stderr
        lines = good.stdout.strip().splitlines()
        assert len(lines) >= 17 and all(x.startswith("PASS") for x in lines[:-1])
        assert lines[-1] == f"result: {name} on cpu: OK, every property holds"
