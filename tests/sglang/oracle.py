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
    with wheels.environment({WHEEL_ENV: str(wheel)}):
        return locate_sources(dest)


USAGE = f"""usage: python -m tests.sglang.oracle fetch DEST.whl      SGLang {VERSION}'s wheel at DEST.whl unless
                                                   it exists, from the cache ($XDG_CACHE_HOME/multiwrite), else
                                                   downloaded
       python -m tests.sglang.oracle extract WHEEL DIR    copy {', '.join(MEMBERS)} into DIR"""

if __name__ == "__main__":
    wheels.oracle_main(sys.argv[1:], fetch_wheel, extract, USAGE, (SglangSourceError,))
