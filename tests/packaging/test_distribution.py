"""What the distribution carries: every package of the source tree is installed, every data file is package data, the
entry points name modules that exist, and the sdist holds every file the tests need (so that a user who pins a version
runs `tox -e cpu` from its unpacked sdist).

The sdist is built with setuptools' own PEP 517 backend (no `build` package, no network): slow, run by `tox -e plugin`.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import multiwrite

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
NEEDED_DIRS = (TESTS.relative_to(REPO).as_posix(), "examples", "docs", "scripts", "multiwrite", "backends")
NEEDED_FILES = ("tox.ini", "pyproject.toml", "setup.py", "README.md", "BENCHMARKS.md", "CHANGELOG.md",
                "multiwrite/staging/_cstaging.c", ".ci/run")  # fmt: skip


def _pyproject() -> dict:
    path = REPO / "pyproject.toml"
    if not path.exists():
        pytest.skip("not run from a source tree")
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_every_package_of_the_source_tree_is_installed():
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, root in (("multiwrite", REPO / "multiwrite"), ("multiwrite.backends", REPO / "backends")):
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join([package, *parts]))
    assert "multiwrite.backends.triton.kernels" in found
    assert sorted(found - listed) == [], "packages missing from pyproject.toml"
    assert sorted(listed - found) == [], "pyproject.toml lists packages the tree does not have"
    assert setuptools["package-dir"] == {"multiwrite.backends": "backends"}


def test_every_data_file_is_package_data():
    patterns = _pyproject()["tool"]["setuptools"]["package-data"]["multiwrite"]
    data = [p.relative_to(REPO / "multiwrite").as_posix() for p in (REPO / "multiwrite" / "data").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]  # fmt: skip
    assert data, "multiwrite/data is empty"
    assert [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []
    assert (REPO / "multiwrite" / "py.typed").is_file() and "py.typed" in patterns


def test_the_entry_points_name_modules_of_the_source_tree():
    project = _pyproject()["project"]
    targets = [*project["entry-points"]["multiwrite"].values(), *project["entry-points"]["pytest11"].values(),
               project["scripts"]["multiwrite"].split(":")[0]]  # fmt: skip
    for target in targets:
        parts = target.split(".")
        root = REPO / "backends" if parts[:2] == ["multiwrite", "backends"] else REPO / "multiwrite"
        rel = parts[2:] if parts[:2] == ["multiwrite", "backends"] else parts[1:]
        path = root.joinpath(*rel)
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), target


def _source_files(top: str) -> set[str]:
    skip = {"__pycache__", ".pytest_cache", ".hypothesis"}
    found = set()
    for path in (REPO / top).rglob("*"):
        rel = path.relative_to(REPO)
        if (
            path.is_file()
            and not skip & set(rel.parts)
            and path.suffix not in (".pyc", ".so")
            and not any(part.endswith(".egg-info") or part == "build" for part in rel.parts)
        ):
            found.add(rel.as_posix())
    return found


@pytest.mark.slow
def test_the_sdist_holds_every_test_example_doc_and_source(tmp_path):
    _pyproject()
    # A clean copy: an `*.egg-info` left by an editable install lists files of its own, which setuptools would add to
    # the sdist and so hide a gap in MANIFEST.in.
    ignore = shutil.ignore_patterns("*.egg-info", ".git", ".tox", "build", "dist", "__pycache__", "*.so", ".venv")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=ignore)
    out = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = proc.stdout.strip().splitlines()[-1]
    assert name == f"multiwrite-{multiwrite.__version__}.tar.gz"
    with tarfile.open(out / name) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    expected = set(NEEDED_FILES).union(*(_source_files(d) for d in NEEDED_DIRS))
    missing = sorted(expected - members)
    assert not missing, f"{len(missing)} files missing from the sdist, e.g. {missing[:10]}"
