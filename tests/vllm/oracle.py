"""vLLM 0.33's own `BlockTables` as a test oracle, loaded at test time from vLLM's wheel (nothing of vLLM is kept here).

Only two files of vLLM are used: `vllm/v1/worker/gpu/block_table.py` and `buffer_utils.py`. They are found through

- `MULTIWRITE_VLLM_SRC`: a directory holding both files (for a machine without network), or
- `MULTIWRITE_VLLM_WHEEL`: the path of vLLM 0.33.0's wheel (`pip download vllm==0.33.0 --no-deps`); the two files are
  read out of it with `zipfile` into a temporary directory.

`tox -e vllm` downloads the wheel and sets the second. Without either the oracle tests skip, saying so.

The two files import a handful of vLLM names. `vllm_stubs()` puts stand-ins for them in `sys.modules` (and takes them
out again afterwards, restoring whatever was there): the real Triton, `PAD_SLOT_ID = -1`, a logger, no UVA (so vLLM's
buffers fall back to explicit host-to-device copies), `current_platform.device_type`. `load_oracle()` loads the two
files under their vLLM module names with the stand-ins in place and returns an `Oracle`.

`interpreter_bool_masks()` works around Triton 3.9's interpreter refusing vLLM's slot-mapping kernel when
`cp_size > 1` ("mask has unsupported dtype"): there a comparison on a value loaded from a bool pointer keeps an int8
tag, so the mask of a masked load ends up as an int8 numpy array, which 3.9 no longer accepts (3.8 took nonzero as
true). The context manager turns such masks into bool ones before the load or store. Their values are 0 and 1, so
this is exact, and it changes nothing on a GPU (the interpreter is not used there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
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


class OracleConfigError(RuntimeError):
    """`MULTIWRITE_VLLM_WHEEL` or `MULTIWRITE_VLLM_SRC` is set but does not point at the two files."""


def configured() -> bool:
    """Whether one of the two environment variables is set (then a missing file is an error, not a skip)."""
    return bool(os.environ.get(SRC_ENV) or os.environ.get(WHEEL_ENV))


def locate_sources(scratch: Path) -> Path:
    """The directory holding vLLM's `block_table.py` and `buffer_utils.py`, extracting them from the wheel into
    `scratch` when `MULTIWRITE_VLLM_WHEEL` names one. Raises `OracleConfigError` naming the variable and path."""
    src = os.environ.get(SRC_ENV)
    if src:
        root = Path(src)
        missing = [name for name in MEMBERS if not (root / name).is_file()]
        if missing:
            raise OracleConfigError(f"{SRC_ENV}={src}: no {', '.join(missing)} in that directory")
        return root
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        raise OracleConfigError(SKIP_REASON)
    if not Path(wheel).is_file():
        raise OracleConfigError(f"{WHEEL_ENV}={wheel}: no such file")
    try:
        with zipfile.ZipFile(wheel) as whl:
            names = set(whl.namelist())
            missing = [member for member in MEMBERS.values() if member not in names]
            if missing:
                raise OracleConfigError(f"{WHEEL_ENV}={wheel}: the wheel holds no {', '.join(missing)}")
            scratch.mkdir(parents=True, exist_ok=True)
            for name, member in MEMBERS.items():
                (scratch / name).write_bytes(whl.read(member))
    except zipfile.BadZipFile as e:
        raise OracleConfigError(f"{WHEEL_ENV}={wheel}: not a wheel ({e})") from None
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


class _OnceLogger(logging.LoggerAdapter):
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


def _stub_modules(device_type: str) -> dict[str, types.ModuleType]:
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
    mods["vllm.logger"] = module("vllm.logger", init_logger=lambda name: _OnceLogger(logging.getLogger(name), {}))
    mods["vllm.utils.platform_utils"] = module("vllm.utils.platform_utils", is_uva_available=lambda: False)
    mods["vllm.utils.torch_utils"] = module(
        "vllm.utils.torch_utils", async_tensor_h2d=_to_device, get_accelerator_view_from_cpu_tensor=_no_uva_view
    )
    mods["vllm.platforms"] = module("vllm.platforms", current_platform=types.SimpleNamespace(device_type=device_type))
    return mods


@contextlib.contextmanager
def _modules_in_place(mods: dict[str, types.ModuleType], also: tuple[str, ...] = ()) -> Iterator[None]:
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


@dataclass
class Oracle:
    """vLLM's two modules, loaded, and the stand-ins they import (`active()` puts them back in `sys.modules`: vLLM's
    buffers import `vllm.platforms` when they are built)."""

    block_table: types.ModuleType
    buffer_utils: types.ModuleType
    source: Path
    modules: dict[str, types.ModuleType]

    @property
    def BlockTables(self) -> type:  # noqa: N802 (vLLM's name)
        """vLLM's class."""
        return self.block_table.BlockTables

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The stand-ins and vLLM's two modules in `sys.modules` for the duration, as they were at load time."""
        return _modules_in_place(self.modules)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """`active()` and `interpreter_bool_masks()`: what a call into vLLM's code needs."""
        with self.active(), interpreter_bool_masks():
            yield

    def make(self, *args: Any, **kwargs: Any) -> OracleTables:
        """vLLM's `BlockTables(*args, **kwargs)`, each of whose method calls runs under `running()`."""
        with self.running():
            return OracleTables(self, self.BlockTables(*args, **kwargs))


class OracleTables:
    """An instance of vLLM's class whose methods run under `Oracle.running()`; attributes pass through (reads and
    writes), `.inner` is the instance itself."""

    def __init__(self, oracle: Oracle, inner: Any) -> None:
        object.__setattr__(self, "_oracle", oracle)
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or isinstance(value, type):
            return value
        oracle = self._oracle

        def call(*args: Any, **kwargs: Any) -> Any:
            with oracle.running():
                return value(*args, **kwargs)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


def load_oracle(source: Path, device_type: str) -> Oracle:
    """Load `source`'s `buffer_utils.py` and `block_table.py` as `vllm.v1.worker.gpu.*` with the stand-ins in place;
    `sys.modules` is restored afterwards. Set `TRITON_INTERPRET=1` first where there is no GPU (Triton reads it when
    vLLM's kernels are decorated)."""
    mods = _stub_modules(device_type)
    with _modules_in_place(mods, also=("vllm.v1.worker.gpu.buffer_utils", "vllm.v1.worker.gpu.block_table")):
        loaded = {}
        for short in ("buffer_utils", "block_table"):
            name = f"vllm.v1.worker.gpu.{short}"
            spec = importlib.util.spec_from_file_location(name, source / f"{short}.py")
            assert spec is not None and spec.loader is not None
            m = importlib.util.module_from_spec(spec)
            sys.modules[name] = m
            spec.loader.exec_module(m)
            loaded[short] = mods[name] = m
    return Oracle(loaded["block_table"], loaded["buffer_utils"], source, mods)


# -- Triton 3.9's interpreter and int8 masks -----------------------------------------------------------------------
@contextlib.contextmanager
def interpreter_bool_masks() -> Iterator[None]:
    """While active, a mask handed to the Triton interpreter's masked load or store whose data is not bool is
    converted to bool (tagged `int1`). A no-op where the interpreter lacks those methods."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - Triton is a test dependency
        yield
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    names = ("create_masked_load", "create_masked_store")
    if builder is None or handle is None or not all(hasattr(builder, n) for n in names):
        yield
        return

    def as_bool(mask: Any) -> Any:
        data = getattr(mask, "data", None)
        if isinstance(data, np.ndarray) and data.dtype != np.bool_:
            return handle(data.astype(np.bool_), tl.int1)
        return mask

    original = {n: builder.__dict__[n] for n in names}
    load, store = original["create_masked_load"], original["create_masked_store"]

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    try:
        yield
    finally:
        for n, f in original.items():
            setattr(builder, n, f)


# -- tox -e vllm: fetch the wheel once ---------------------------------------------------------------------------
VERSION = "0.33.0"


def fetch_wheel(dest: Path) -> Path:
    """Download vLLM 0.33.0's wheel (no dependencies) to `dest` unless it is already there; returns `dest`."""
    import shutil
    import subprocess
    import tempfile

    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*cmd, "--dest", tmp], check=True)
        (wheel,) = Path(tmp).glob(f"vllm-{VERSION}-*.whl")
        shutil.move(str(wheel), dest)
    return dest


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the two files out of `wheel` into `dest` (a directory for `MULTIWRITE_VLLM_SRC` on a machine without
    network); returns `dest`."""
    old = os.environ.get(WHEEL_ENV), os.environ.get(SRC_ENV)
    os.environ[WHEEL_ENV] = str(wheel)
    os.environ.pop(SRC_ENV, None)
    try:
        return locate_sources(dest)
    finally:
        for name, value in zip((WHEEL_ENV, SRC_ENV), old):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


USAGE = """usage: python -m tests.vllm.oracle fetch DEST.whl      download vLLM 0.33.0's wheel unless DEST.whl exists
       python -m tests.vllm.oracle extract WHEEL DIR    copy block_table.py and buffer_utils.py into DIR"""

if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "fetch":
        print(fetch_wheel(Path(args[1])))
    elif len(args) == 3 and args[0] == "extract":
        print(extract(Path(args[1]), Path(args[2])))
    else:
        sys.exit(USAGE)
