"""Fake installed distributions: a plugin module and its `*.dist-info`, in a directory of its own."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path


def backend_source(cls: str, name: str, priority: int = 5, device_types: Sequence[str] = ("cpu",)) -> str:
    """Python source of a `Backend` subclass `cls` named `name` that applies through the built-in torch-cpu (for a
    fake plugin module; add the `multiwrite_backends` hook yourself)."""
    return textwrap.dedent(
        f"""
        from multiwrite import Backend, hookimpl

        class {cls}(Backend):
            NAME = {name!r}
            PRIORITY = {priority}
            SUPPORTED_DEVICE_TYPES = frozenset({sorted(device_types)!r})

            def apply(self, batches):
                from multiwrite import select_backend
                select_backend("cpu", "torch-cpu").apply(batches)
        """
    )


def install_distribution(
    root: Path, dist: str, module: str, source: str, entry: str | None = None, version: str = "1.0"
) -> None:
    """A fake installed distribution `dist` in the directory `root` (put it on `sys.path` or `PYTHONPATH`): the module
    `module` with `source`, and a `*.dist-info` whose entry point `entry` (default: `dist`) in the `multiwrite` group
    names the module."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[multiwrite]\n{entry or dist} = {module}\n")
