"""The on/off environment variables of multiwrite: its plugin entry points' (`MULTIWRITE_VLLM`, `MULTIWRITE_SGLANG`)
and `BlockTables`' address check at every call (`MULTIWRITE_CHECK_ADDRESSES`)."""

from __future__ import annotations

from collections.abc import Mapping

#: The values (compared case-insensitively, surrounding blanks ignored).
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")


def env_switch(environ: Mapping[str, str], name: str, why_refused: str) -> bool:
    """Whether variable `name` of `environ` is on (`ON`); unset or `OFF`: no.

    Raises:
        ValueError: a value that is neither, named in the message with the accepted words and `why_refused`.
    """
    raw = environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(
        f"{name}={raw!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF[:-1])} or empty), case-insensitive; "
        + why_refused
    )
