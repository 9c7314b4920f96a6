"""vLLM 0.33's own `BlockTables` as a test oracle, loaded at test time from vLLM's wheel (nothing of vLLM is kept here).

Only two files of vLLM are used: `vllm/v1/worker/gpu/block_table.py` and `buffer_utils.py`. They are found through

- `MULTIWRITE_VLLM_SRC`: a directory holding both files (for a machine without network), or
- `MULTIWRITE_VLLM_WHEEL`: the path of vLLM 0.33.0's wheel (`pip download vllm==0.33.0 --no-deps`); the two files are
  read out of it with `zipfile` into a temporary directory.

`tox -e vllm` fetches the wheel (`fetch_wheel`: downloaded once per machine, kept in `$XDG_CACHE_HOME/multiwrite`,
by default `~/.cache/multiwrite`) and sets the second. Without either the oracle tests skip, saying so.

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
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The one loader of vLLM's files, shared with the bench; re-exported for the tests.
from multiwrite.vllm.upstream import MEMBERS as MEMBERS
from multiwrite.vllm.upstream import PAD as PAD
from multiwrite.vllm.upstream import SKIP_REASON as SKIP_REASON
from multiwrite.vllm.upstream import SRC_ENV as SRC_ENV
from multiwrite.vllm.upstream import WHEEL_ENV as WHEEL_ENV
from multiwrite.vllm.upstream import OnceLogger as OnceLogger
from multiwrite.vllm.upstream import VllmSourceError as VllmSourceError
from multiwrite.vllm.upstream import configured as configured
from multiwrite.vllm.upstream import load_modules, locate_sources, modules_in_place
from tests.support import wheels


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
        return modules_in_place(self.modules)

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
    """vLLM's two modules loaded from `source` (`multiwrite.vllm.upstream.load_modules`), as an `Oracle`."""
    block_table, buffer_utils, mods = load_modules(source, device_type)
    return Oracle(block_table, buffer_utils, source, mods)


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


# -- tox -e vllm: fetch the wheel once per machine ----------------------------------------------------------------
VERSION = "0.33.0"
WHEEL_NAME = f"vllm-{VERSION}.whl"


cache_dir = wheels.cache_dir


def cached_wheel_problem(wheel: Path) -> str | None:
    """Why the cached `wheel` cannot be used (None when it can): `wheels.cached_wheel_problem` with the two
    files."""
    return wheels.cached_wheel_problem(wheel, MEMBERS.values())


def download_wheel(dest: Path) -> Path:
    """Download vLLM 0.33.0's wheel to `dest` (`tests.support.wheels.download_wheel`)."""
    return wheels.download_wheel(dest, "vllm", VERSION)


def fetch_wheel(dest: Path, cache: Path | None = None) -> Path:
    """vLLM 0.33.0's wheel at `dest`, from the cache or downloaded once (`tests.support.wheels.fetch_wheel`)."""
    return wheels.fetch_wheel(dest, "vllm", VERSION, MEMBERS.values(), cache)


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the two files out of `wheel` into `dest` (a directory for `MULTIWRITE_VLLM_SRC` on a machine without
    network); returns `dest`."""
    with wheels.environment({WHEEL_ENV: str(wheel), SRC_ENV: None}):
        return locate_sources(dest)


USAGE = """usage: python -m tests.vllm.oracle fetch DEST.whl      vLLM 0.33.0's wheel at DEST.whl unless it exists,
                                                 from the cache ($XDG_CACHE_HOME/multiwrite), else downloaded
       python -m tests.vllm.oracle extract WHEEL DIR    copy block_table.py and buffer_utils.py into DIR"""

if __name__ == "__main__":
    wheels.oracle_main(sys.argv[1:], fetch_wheel, extract, USAGE)
