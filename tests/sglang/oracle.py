"""SGLang 0.5.23's own writers as a test oracle, loaded at test time from SGLang's wheel (nothing of SGLang is kept
here): `multiwrite.sglang.upstream` locates and loads them (and builds the stand-in batch SGLang's decode allocation
reads, `decode_batch`); this module fetches the wheel for `tox -e sglang` (`tests.support.wheels`: downloaded once per
machine into `$XDG_CACHE_HOME/multiwrite`, sha256-checked).
"""

from __future__ import annotations

import sys
from pathlib import Path

from multiwrite.sglang.upstream import MEMBERS, VERSION, SglangSourceError, locate_sources
from multiwrite.sglang.upstream import WHEEL_ENV as WHEEL_ENV
from multiwrite.sglang.upstream import decode_batch as decode_batch
from tests.support import wheels


def fetch_wheel(dest: Path, cache: Path | None = None) -> Path:
    """SGLang 0.5.23's wheel at `dest`, from the cache or downloaded once (`tests.support.wheels.fetch_wheel`)."""
    return wheels.fetch_wheel(dest, "sglang", VERSION, MEMBERS.values(), cache)


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the three files out of `wheel` into `dest` (for `MULTIWRITE_SGLANG_SRC` on a machine without network)."""
    import os

    old = os.environ.get(WHEEL_ENV)
    os.environ[WHEEL_ENV] = str(wheel)
    try:
        return locate_sources(dest)
    finally:
        if old is None:
            os.environ.pop(WHEEL_ENV, None)
        else:
            os.environ[WHEEL_ENV] = old


USAGE = f"""usage: python -m tests.sglang.oracle fetch DEST.whl      SGLang {VERSION}'s wheel at DEST.whl unless
                                                   it exists, from the cache ($XDG_CACHE_HOME/multiwrite), else
                                                   downloaded
       python -m tests.sglang.oracle extract WHEEL DIR    copy {', '.join(MEMBERS)} into DIR"""

if __name__ == "__main__":
    args = sys.argv[1:]
    try:
        if len(args) == 2 and args[0] == "fetch":
            print(fetch_wheel(Path(args[1])))
        elif len(args) == 3 and args[0] == "extract":
            print(extract(Path(args[1]), Path(args[2])))
        else:
            sys.exit(USAGE)
    except SglangSourceError as e:
        sys.exit(str(e))
