"""vLLM 0.33's own `BlockTables`, loaded to compare with: the oracle of `tests/vllm` and the `vllm-0.33` design of
`multiwrite bench --stage`. Nothing of vLLM is shipped here: its two files (`vllm/v1/worker/gpu/block_table.py` and
`buffer_utils.py`) are located at run time,

- `MULTIWRITE_VLLM_SRC`: a directory holding both files (for a machine without network), or
- `MULTIWRITE_VLLM_WHEEL`: the path of vLLM 0.33.0's wheel (`pip download vllm==0.33.0 --no-deps`); the two files are
  read out of it with `zipfile`,

and loaded under their vLLM module names with stand-ins for the few vLLM modules they import (`stand_in_modules`):
the real Triton, `PAD_SLOT_ID = -1`, a logger, no UVA (so vLLM's buffers fall back to explicit host-to-device copies:
its host times here are an upper bound of vLLM's own, whose UVA views need its compiled `_C` op), and
`current_platform.device_type`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

WHEEL_ENV = "MULTIWRITE_VLLM_WHEEL"
SRC_ENV = "MULTIWRITE_VLLM_SRC"
#: The two files, by their path inside vLLM's wheel.
MEMBERS = {
    "block_table.py": "vllm/v1/worker/gpu/block_table.py",
    "buffer_utils.py": "vllm/v1/worker/gpu/buffer_utils.py",
}
SKIP_REASON = (
    "vLLM's BlockTables oracle is not located: run `tox -e vllm` (downloads vLLM 0.33.0's wheel), or set "
    f"{WHEEL_ENV}=<path of vllm-0.33.0-*.whl> or {SRC_ENV}=<a directory holding block_table.py and buffer_utils.py "
    "from vllm/v1/worker/gpu/>"
)
PAD = -1


class VllmSourceError(RuntimeError):
    """`MULTIWRITE_VLLM_WHEEL` or `MULTIWRITE_VLLM_SRC` is set but does not point at the two files."""


def configured() -> bool:
    """Whether one of the two environment variables is set (then a missing file is an error, not a skip)."""
    return bool(os.environ.get(SRC_ENV) or os.environ.get(WHEEL_ENV))


def locate_sources(scratch: Path) -> Path:
    """The directory holding vLLM's `block_table.py` and `buffer_utils.py`, extracting them from the wheel into
    `scratch` when `MULTIWRITE_VLLM_WHEEL` names one. Raises `VllmSourceError` naming the variable and path."""
    src = os.environ.get(SRC_ENV)
    if src:
        root = Path(src)
        missing = [name for name in MEMBERS if not (root / name).is_file()]
        if missing:
            raise VllmSourceError(f"{SRC_ENV}={src}: no {', '.join(missing)} in that directory")
        return root
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        raise VllmSourceError(SKIP_REASON)
    if not Path(wheel).is_file():
        raise VllmSourceError(f"{WHEEL_ENV}={wheel}: no such file")
    try:
        with zipfile.ZipFile(wheel) as whl:
            names = set(whl.namelist())
            missing = [member for member in MEMBERS.values() if member not in names]
            if missing:
                raise VllmSourceError(f"{WHEEL_ENV}={wheel}: the wheel holds no {', '.join(missing)}")
            scratch.mkdir(parents=True, exist_ok=True)
            for name, member in MEMBERS.items():
                (scratch / name).write_bytes(whl.read(member))
    except zipfile.BadZipFile as e:
        raise VllmSourceError(f"{WHEEL_ENV}={wheel}: not a wheel ({e})") from None
    return scratch


# -- the stand-ins for vLLM's imports ------------------------------------------------------------------------------
_PACKAGES = (
    "vllm",
    "vllm.v1",
    "vllm.v1.attention",
    "vllm.v1.attention.backends",
    "vllm.v1.worker",
    "vllm.v1.worker.gpu",
    "vllm.utils",
)


class OnceLogger(logging.LoggerAdapter):
    """The `warning_once`/`info_once` of vLLM's logger, on a standard one."""

    _seen: set[tuple[str, str]] = set()

    def _once(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        key = (logging.getLevelName(level), msg % args if args else msg)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, msg, *args)


def _to_device(data: Any, device: Any = None, dtype: torch.dtype | None = None, out: torch.Tensor | None = None):
    if dtype is None and out is not None:
        dtype = out.dtype
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data, dtype=dtype)
    if out is not None:
        return out.copy_(t)
    return t.to(device=device, dtype=dtype)


def _no_uva_view(t: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the oracle's stand-in has no UVA: vLLM should have chosen its non-UVA buffers")


def stand_in_modules(device_type: str) -> dict[str, types.ModuleType]:
    """The stand-ins for the vLLM modules the two files import, by module name (not yet in `sys.modules`:
    `modules_in_place` puts them there): the real Triton, `PAD_SLOT_ID = -1`, a logger with `warning_once`, no UVA
    (`is_uva_available()` is False), host-to-device copies, and `current_platform.device_type = device_type`."""
    import triton
    import triton.language as tl

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so that the submodules below import
        m.__dict__.update(attrs)
        return m

    mods = {name: module(name) for name in _PACKAGES}
    mods["vllm.triton_utils"] = module("vllm.triton_utils", triton=triton, tl=tl)
    mods["vllm.v1.attention.backends.utils"] = module("vllm.v1.attention.backends.utils", PAD_SLOT_ID=PAD)
    mods["vllm.logger"] = module("vllm.logger", init_logger=lambda name: OnceLogger(logging.getLogger(name), {}))
    mods["vllm.utils.platform_utils"] = module("vllm.utils.platform_utils", is_uva_available=lambda: False)
    mods["vllm.utils.torch_utils"] = module(
        "vllm.utils.torch_utils", async_tensor_h2d=_to_device, get_accelerator_view_from_cpu_tensor=_no_uva_view
    )
    mods["vllm.platforms"] = module("vllm.platforms", current_platform=types.SimpleNamespace(device_type=device_type))
    return mods


@contextlib.contextmanager
def modules_in_place(mods: dict[str, types.ModuleType], also: tuple[str, ...] = ()) -> Iterator[None]:
    """`mods` in `sys.modules` for the duration; afterwards those names and `also` are as they were."""
    saved = {name: sys.modules.get(name) for name in (*mods, *also)}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def load_modules(source: Path, device_type: str) -> tuple[types.ModuleType, types.ModuleType, dict]:
    """Load `source`'s `buffer_utils.py` and `block_table.py` as `vllm.v1.worker.gpu.*` with the stand-ins in place;
    `sys.modules` is restored afterwards. Returns (block_table, buffer_utils, the modules vLLM's code needs in
    `sys.modules` while it runs: its buffers import `vllm.platforms` when they are built). Set `TRITON_INTERPRET=1`
    first where there is no GPU (Triton reads it when vLLM's kernels are decorated)."""
    mods = stand_in_modules(device_type)
    with modules_in_place(mods, also=("vllm.v1.worker.gpu.buffer_utils", "vllm.v1.worker.gpu.block_table")):
        loaded = {}
        for short in ("buffer_utils", "block_table"):
            name = f"vllm.v1.worker.gpu.{short}"
            spec = importlib.util.spec_from_file_location(name, source / f"{short}.py")
            assert spec is not None and spec.loader is not None
            m = importlib.util.module_from_spec(spec)
            sys.modules[name] = m
            spec.loader.exec_module(m)
            loaded[short] = mods[name] = m
    return loaded["block_table"], loaded["buffer_utils"], mods


def load_vllm_block_tables(device_type: str) -> type:
    """vLLM 0.33's `BlockTables` class for a process that keeps using it (the bench): an installed vLLM's, else the
    located files' (`locate_sources`), whose stand-ins then stay in `sys.modules` (only where vLLM is not installed).

    Raises:
        VllmSourceError: neither vLLM nor its files are available (the message says how to provide them).
    """
    try:
        return importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    except ImportError:
        pass
    block_table, _, mods = load_modules(locate_sources(Path(tempfile.mkdtemp(prefix="multiwrite-vllm-"))), device_type)
    sys.modules.update(mods)
    return block_table.BlockTables
