"""What the loaders of upstream code (`multiwrite.vllm.upstream`, `multiwrite.sglang.upstream`) share: the upstream
files, located at run time in a directory that one environment variable names or read out of the wheel that another
names (`locate_files`), and the stand-in modules they run with, put in `sys.modules` for a while
(`modules_in_place`)."""

from __future__ import annotations

import contextlib
import os
import sys
import types
import zipfile
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any


def locate_files(
    members: Mapping[str, str], scratch: Path, *, src_env: str, wheel_env: str, unset: str, error: type[Exception]
) -> Path:
    """The directory holding the files `members` names (file name -> its path inside the wheel): the directory in
    `$src_env` when that is set, else `scratch`, into which the files are extracted from the wheel in `$wheel_env`.

    Raises:
        error: neither variable is set (the message is `unset`), or the one set names a directory without every
            file, no file, a file that is not a wheel, or a wheel without every member (each naming the variable,
            its value and what is missing).
    """
    src = os.environ.get(src_env)
    if src:
        root = Path(src)
        missing = [name for name in members if not (root / name).is_file()]
        if missing:
            raise error(f"{src_env}={src}: no {', '.join(missing)} in that directory")
        return root
    wheel = os.environ.get(wheel_env)
    if not wheel:
        raise error(unset)
    if not Path(wheel).is_file():
        raise error(f"{wheel_env}={wheel}: no such file")
    try:
        with zipfile.ZipFile(wheel) as whl:
            names = set(whl.namelist())
            missing = [member for member in members.values() if member not in names]
            if missing:
                raise error(f"{wheel_env}={wheel}: the wheel holds no {', '.join(missing)}")
            scratch.mkdir(parents=True, exist_ok=True)
            for name, member in members.items():
                (scratch / name).write_bytes(whl.read(member))
    except zipfile.BadZipFile as e:
        raise error(f"{wheel_env}={wheel}: not a wheel ({e})") from None
    return scratch


def _put(target: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value


@contextlib.contextmanager
def entries_in_place(target: MutableMapping[str, Any], values: Mapping[str, Any], also: tuple[str, ...] = ()
                     ) -> Iterator[None]:  # fmt: skip
    """`values` in `target` for the duration (a value of None: the entry removed); afterwards those names and `also`
    are as they were."""
    saved = {name: target.get(name) for name in (*values, *also)}
    _put(target, values)
    try:
        yield
    finally:
        _put(target, saved)


def modules_in_place(mods: dict[str, types.ModuleType], also: tuple[str, ...] = ()
                     ) -> contextlib.AbstractContextManager[None]:  # fmt: skip
    """`mods` in `sys.modules` for the duration; afterwards those names and `also` are as they were."""
    return entries_in_place(sys.modules, mods, also)
