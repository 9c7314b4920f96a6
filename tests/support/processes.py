"""Fresh processes: the `multiwrite` command, a child's environment, its one-line error report."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

#: The small trace of the command-line tests: 6 requests (`tests/data/small_trace.csv`).
SMALL_TRACE = str(Path(__file__).resolve().parent.parent / "data" / "small_trace.csv")


def subprocess_env(*paths: Path | str, unbuffered: bool | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child: `paths` first on `PYTHONPATH`, no `MULTIWRITE_BACKEND` (the child
    chooses as a user's program would), `PYTHONUNBUFFERED` set (True), removed (False) or as it is (None), and `extra`.
    """
    env = dict(os.environ, **extra)
    env.pop("MULTIWRITE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    if unbuffered is True:
        env["PYTHONUNBUFFERED"] = "1"
    elif unbuffered is False:
        env.pop("PYTHONUNBUFFERED", None)
    return env


def multiwrite_command() -> list[str]:
    """The installed `multiwrite` console script beside this interpreter (else on PATH), else `python -m multiwrite`."""
    script = Path(sys.executable).with_name("multiwrite")
    if script.exists():
        return [str(script)]
    found = shutil.which("multiwrite")
    return [found] if found else [sys.executable, "-m", "multiwrite"]


def one_line_error(stderr: str) -> str:
    """The single line of an error report on stderr (asserts one line and no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]
