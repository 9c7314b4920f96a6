"""The sdist carries everything the tests need (issue 9: "packaging a user can pin").

Builds the source distribution with setuptools' own PEP 517 backend (no `build` package, no network) and
checks that every file of `tests/`, `examples/`, `docs/`, the tox config and the C helper's source are in
it, so that `tox -e cpu` runs from an unpacked sdist of a pinned version. Slow (a build): `tox -e plugin`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import multiwrite

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

NEEDED_DIRS = ("tests", "examples", "docs", "multiwrite", "backends")
NEEDED_FILES = ("tox.ini", "pyproject.toml", "setup.py", "README.md", "multiwrite/_cstaging.c", ".ci/run")


def _source_files(top: str) -> set[str]:
    skip = {"__pycache__", ".pytest_cache", ".hypothesis"}
    found = set()
    for path in (ROOT / top).rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not skip & set(rel.parts) and path.suffix not in (".pyc", ".so") and not any(
            part.endswith(".egg-info") or part == "build" for part in rel.parts
        ):
            found.add(rel.as_posix())
    return found


def test_the_sdist_holds_every_test_example_and_doc(tmp_path):
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("not run from a source tree")
    # A clean copy: an `*.egg-info` left by an editable install lists files of its own, which setuptools
    # would add to the sdist and so hide a gap in MANIFEST.in.
    ignore = shutil.ignore_patterns("*.egg-info", ".git", ".tox", "build", "dist", "__pycache__", "*.so", ".venv")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=ignore)
    out = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = proc.stdout.strip().splitlines()[-1]
    assert name == f"multiwrite-{multiwrite.__version__}.tar.gz"
    with tarfile.open(out / name) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    expected = set(NEEDED_FILES).union(*(_source_files(d) for d in NEEDED_DIRS))
    missing = sorted(expected - members)
    assert not missing, f"{len(missing)} files missing from the sdist, e.g. {missing[:10]}"
