"""Triton here: whether it imports, and skipping what needs its interpreter where it is off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def triton_importable() -> bool:
    """Whether Triton imports here (the Triton rooms' tests are not collected without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return True


def skip_off_interpreter(items: list, selected: Callable[[Path], bool], reason: str) -> None:
    """Skip the collected `items` whose file `selected` picks when Triton's interpreter is off (a GPU machine):
    they run the Triton kernels on CPU tables."""
    from multiwrite.backends.triton.backend import interpreter_enabled

    if not triton_importable() or interpreter_enabled():
        return
    import pytest

    skip = pytest.mark.skip(reason=f"Triton's interpreter is off (a GPU machine): {reason}")
    for item in items:
        if selected(Path(str(item.path)).resolve()):
            item.add_marker(skip)
