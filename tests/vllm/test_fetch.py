"""`python -m tests.vllm.oracle fetch` (`tox -e vllm`'s first step): the wheel is downloaded once into the cache and
reused by later runs and clones; a cached copy that fails its check is downloaded again; a failed download fails
loudly. pip is replaced by a stand-in that writes a small wheel and counts its calls (no network)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.vllm import oracle


@pytest.fixture
def pip(monkeypatch):
    """The stand-in for `pip download`: writes a wheel holding the two files into `--dest`; `calls` counts the
    downloads, `fail = True` makes the next one fail as pip does without network."""

    class Pip:
        calls = 0
        fail = False

        def run(self, cmd, check):
            assert cmd[1:4] == ["-m", "pip", "download"] and f"vllm=={oracle.VERSION}" in cmd and check
            self.calls += 1
            if self.fail:
                raise subprocess.CalledProcessError(1, cmd)
            dest = Path(cmd[cmd.index("--dest") + 1])
            with zipfile.ZipFile(dest / f"vllm-{oracle.VERSION}-cp38-abi3-manylinux_2_31_x86_64.whl", "w") as whl:
                for member in oracle.MEMBERS.values():
                    whl.writestr(member, f"# {member} number {self.calls}\n")

    stand_in = Pip()
    monkeypatch.setattr(subprocess, "run", stand_in.run)
    return stand_in


def test_the_wheel_is_downloaded_once_and_reused_by_later_runs_and_clones(tmp_path, pip, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert oracle.cache_dir() == tmp_path / "xdg" / "multiwrite"
    first = oracle.fetch_wheel(tmp_path / "clone1" / ".tox" / "vllm" / "vllm-0.33.0.whl")
    assert pip.calls == 1
    again = oracle.fetch_wheel(first)  # the same env dir again
    other = oracle.fetch_wheel(tmp_path / "clone2" / "vllm-0.33.0.whl")  # a fresh clone
    assert pip.calls == 1
    cached = tmp_path / "xdg" / "multiwrite" / "vllm-0.33.0.whl"
    assert oracle.cached_wheel_problem(cached) is None
    for path in (first, again, other):
        assert path.read_bytes() == cached.read_bytes()
        with zipfile.ZipFile(path) as whl:
            assert whl.read(oracle.MEMBERS["block_table.py"]) == b"# vllm/v1/worker/gpu/block_table.py number 1\n"


def test_without_xdg_cache_home_the_cache_is_under_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert oracle.cache_dir() == tmp_path / ".cache" / "multiwrite"


@pytest.mark.parametrize("damage", ["truncated", "altered", "no record"])
def test_a_cached_wheel_that_fails_its_check_is_downloaded_again(tmp_path, pip, capsys, damage):
    cache = tmp_path / "cache"
    oracle.fetch_wheel(tmp_path / "a.whl", cache)
    cached = cache / "vllm-0.33.0.whl"
    data = cached.read_bytes()
    (tmp_path / "a.whl").unlink()  # (a hard link: writing the cached file would change it too)
    if damage == "truncated":
        cached.write_bytes(data[: len(data) // 2])
    elif damage == "altered":
        cached.write_bytes(data.replace(b"number 1", b"number 9"))
    else:
        (cache / "vllm-0.33.0.whl.sha256").unlink()
    assert oracle.cached_wheel_problem(cached) is not None
    dest = oracle.fetch_wheel(tmp_path / "b.whl", cache)
    assert pip.calls == 2 and oracle.cached_wheel_problem(cached) is None
    with zipfile.ZipFile(dest) as whl:
        assert whl.read(oracle.MEMBERS["buffer_utils.py"]) == b"# vllm/v1/worker/gpu/buffer_utils.py number 2\n"
    if damage != "no record":
        assert "does not match the sha256" in capsys.readouterr().err


def test_a_failed_download_fails_loudly_and_leaves_no_cached_wheel(tmp_path, pip):
    pip.fail = True
    with pytest.raises(subprocess.CalledProcessError):
        oracle.fetch_wheel(tmp_path / "a.whl", tmp_path / "cache")
    assert not (tmp_path / "a.whl").exists() and list((tmp_path / "cache").iterdir()) == []
