"""Upstream wheels the oracle rooms read at test time (tests/vllm, tests/sglang): downloaded once per machine with
pip (no dependencies), kept in `$XDG_CACHE_HOME/multiwrite` (by default `~/.cache/multiwrite`) with the sha256 of
the download beside each, and linked into a tox env's directory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from multiwrite._upstream import entries_in_place


def cache_dir() -> Path:
    """Where downloaded wheels are kept between runs and clones: `$XDG_CACHE_HOME/multiwrite`, by default
    `~/.cache/multiwrite`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiwrite"


def sha256(path: Path) -> str:
    """The file's sha256, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_wheel_problem(wheel: Path, members: Iterable[str]) -> str | None:
    """Why the cached `wheel` cannot be used (None when it can): it must match the sha256 recorded beside it
    (`<wheel>.sha256`, written when it was downloaded: a truncated or altered file fails) and hold `members`."""
    record = wheel.with_name(wheel.name + ".sha256")
    if not wheel.is_file() or not record.is_file():
        return "not cached"
    if sha256(wheel) != record.read_text().strip():
        return f"{wheel} does not match the sha256 in {record}"
    try:
        with zipfile.ZipFile(wheel) as whl:
            missing = [m for m in members if m not in whl.namelist()]
    except zipfile.BadZipFile as e:
        return f"{wheel} is not a wheel ({e})"
    return f"{wheel} holds no {', '.join(missing)}" if missing else None


def download_wheel(dest: Path, package: str, version: str) -> Path:
    """Download `package==version`'s wheel (no dependencies) with pip to `dest`, with its sha256 beside it; the file
    appears whole or not at all. Raises `subprocess.CalledProcessError` when pip fails (no network: a loud failure)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*cmd, "--dest", tmp], check=True)
        (wheel,) = Path(tmp).glob(f"{package}-{version}-*.whl")
        record = Path(tmp) / "sha256"
        record.write_text(sha256(wheel) + "\n")
        os.replace(wheel, dest)
        shutil.move(str(record), dest.with_name(dest.name + ".sha256"))
    return dest


def fetch_wheel(dest: Path, package: str, version: str, members: Iterable[str], cache: Path | None = None) -> Path:
    """`package==version`'s wheel at `dest`: kept when `dest` is already there (a tox env's second run), else taken
    from the cache (`cache_dir()` unless given) when it holds a good copy (`cached_wheel_problem`), else downloaded
    into the cache first; `dest` is then a hard link to the cached file (a copy across file systems). Returns
    `dest`."""
    if dest.is_file():
        return dest
    members = list(members)
    cached = (cache or cache_dir()) / f"{package}-{version}.whl"
    problem = cached_wheel_problem(cached, members)
    if problem is not None:
        if problem != "not cached":
            print(f"tests.support.wheels: {problem}: downloading it again", file=sys.stderr)
        download_wheel(cached, package, version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(cached, partial)
    except OSError:
        shutil.copyfile(cached, partial)
    os.replace(partial, dest)
    return dest


def environment(values: dict[str, str | None]) -> contextlib.AbstractContextManager[None]:
    """Set (a string) or unset (None) the environment variables of `values`, restored on exit."""
    return entries_in_place(os.environ, values)


def oracle_main(argv: list[str], fetch: Callable[[Path], Path], extract: Callable[[Path, Path], Path], usage: str,
                errors: tuple[type[Exception], ...] = ()) -> None:  # fmt: skip
    """The command line of an oracle module (`python -m tests.vllm.oracle ...`): `fetch DEST.whl` prints
    `fetch(DEST.whl)`, `extract WHEEL DIR` prints `extract(WHEEL, DIR)`; anything else exits with `usage`, and an
    exception of `errors` exits with its message."""
    try:
        if len(argv) == 2 and argv[0] == "fetch":
            print(fetch(Path(argv[1])))
        elif len(argv) == 3 and argv[0] == "extract":
            print(extract(Path(argv[1]), Path(argv[2])))
        else:
            sys.exit(usage)
    except errors as e:
        sys.exit(str(e))
