"""vLLM 0.33's own `BlockTables`, loaded to compare with: the oracle of `tests/vllm` and the `vllm-0.33` design of
`multiwrite bench --stage`. Nothing of vLLM is shipped here: its two files (`vllm/v1/worker/gpu/block_table.py` and
`buffer_utils.py`) are located at run time,

- `MULTIWRITE_VLLM_SRC`: a directory holding both files (for a machine without network), or
- `MULTIWRITE_VLLM_WHEEL`: the path of vLLM 0.33.0's wheel (`pip download vllm==0.33.0 --no-deps`); the two files are
  read out of it with `zipfile`,

and loaded under their vLLM module names with stand-ins for the few vLLM modules they import (`stand_in_modules`):
the real Triton, `PAD_SLOT_ID = -1`, a logger, `current_platform.device_type`, and vLLM's buffers on one of its two
paths:

- `uva` (what vLLM runs on CUDA and ROCm): pinned host buffers that its kernels read in place through a device view.
  vLLM makes the view with a compiled op of its own (`torch.ops._C.get_cuda_view_from_cpu_tensor`), which is not
  here; `cuda_view_of_pinned` stands in for it. The bench's anchor takes this path where `uva_path` finds it works;
- `fallback` (vLLM's `NonUvaBuffer`: explicit host-to-device copies): on a CPU, and for the test oracle.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from multiwrite._upstream import locate_files, modules_in_place

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
    return locate_files(
        MEMBERS, scratch, src_env=SRC_ENV, wheel_env=WHEEL_ENV, unset=SKIP_REASON, error=VllmSourceError
    )


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


def _to_device(
    data: Any,
    device: Any = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    *,
    pin: bool = False,
):
    """vLLM's `async_tensor_h2d`: `data` (a list, array or CPU tensor) on `device` or copied into `out`; with `pin`
    (where vLLM has pinned memory) staged in pinned memory and copied without blocking, as vLLM's does."""
    if dtype is None and out is not None:
        dtype = out.dtype
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data, dtype=dtype)
    if pin and not t.is_pinned():
        t = t.pin_memory()
    if out is not None:
        return out.copy_(t, non_blocking=pin)
    return t.to(device=device, dtype=dtype, non_blocking=pin)


def _no_uva_view(t: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the oracle's stand-in has no UVA: vLLM should have chosen its non-UVA buffers")


class _PinnedHostMemory:
    """A pinned CPU tensor's memory described by `__cuda_array_interface__` (version 3) at its host address; it holds
    the tensor, so the memory lives as long as a view made from it."""

    def __init__(self, cpu: torch.Tensor):
        self.cpu = cpu
        size = cpu.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(cpu.shape),
            "strides": tuple(s * size for s in cpu.stride()),
            "typestr": torch.empty(0, dtype=cpu.dtype).numpy().dtype.str,
            "data": (cpu.data_ptr(), False),
            "version": 3,
        }


def cuda_view_of_pinned(cpu: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over `cpu`'s own memory (same shape, strides, dtype): kernels that read it read the host memory
    and their writes land there. The stand-in for vLLM's compiled `get_cuda_view_from_cpu_tensor`.

    It relies on unified virtual addressing, under which pinned host memory has the same address on the device as on
    the host (the address multiwrite's own Triton kernels are handed for their pinned staging memory); `uva_path`
    checks that it holds on the machine before the anchor takes this path. torch builds the view from the memory's
    `__cuda_array_interface__` (it asks the CUDA runtime which device the memory belongs to, and refuses memory that
    is not registered with CUDA), so no CUDA library is looked up by name here.

    Raises:
        ValueError: `cpu` is not a pinned CPU tensor (a pageable one has no device address).
    """
    if cpu.device.type != "cpu" or not cpu.is_pinned():
        raise ValueError(f"a CUDA view needs a pinned CPU tensor; got one on {cpu.device}, pinned: {cpu.is_pinned()}")
    if cpu.numel() == 0:
        return torch.empty(cpu.shape, dtype=cpu.dtype, device="cuda")
    return torch.as_tensor(_PinnedHostMemory(cpu))


@functools.cache
def uva_path(device_type: str) -> tuple[bool, str]:
    """(True, "") where vLLM's UVA path can run on `device_type` here, else (False, why): a CUDA (or ROCm) device,
    pinned memory, and a view from `cuda_view_of_pinned` that reads what the host wrote and whose device writes the
    host then reads. Checked once per process."""
    if device_type != "cuda":
        return False, f"vLLM's UVA buffers are for CUDA and ROCm devices, not {device_type}"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        host.copy_(torch.tensor([3, 1, 4, 1], dtype=torch.int32))
        view = cuda_view_of_pinned(host)
        read = view.clone().cpu().tolist()
        view.add_(10)
        torch.cuda.synchronize()
        written = host.tolist()
    except Exception as exc:  # no pinned memory, or torch refused the view: vLLM's fallback then
        return False, f"no CUDA view of pinned memory here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    if view.device.type != "cuda" or read != [3, 1, 4, 1] or written != [13, 11, 14, 11]:
        return False, f"a CUDA view of pinned memory does not alias it here (read {read}, host after a write {written})"
    return True, ""


def stand_in_modules(device_type: str, uva: bool = False) -> dict[str, types.ModuleType]:
    """The stand-ins for the vLLM modules the two files import, by module name (not yet in `sys.modules`:
    `modules_in_place` puts them there): the real Triton, `PAD_SLOT_ID = -1`, a logger with `warning_once`,
    `current_platform.device_type = device_type`, and with `uva` vLLM's UVA path (`is_uva_available()` True, views by
    `cuda_view_of_pinned`, host-to-device copies staged in pinned memory), else its fallback (False, plain copies)."""
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
    mods["vllm.utils.platform_utils"] = module("vllm.utils.platform_utils", is_uva_available=lambda: uva)
    mods["vllm.utils.torch_utils"] = module(
        "vllm.utils.torch_utils",
        async_tensor_h2d=functools.partial(_to_device, pin=uva),
        get_accelerator_view_from_cpu_tensor=cuda_view_of_pinned if uva else _no_uva_view,
    )
    mods["vllm.platforms"] = module("vllm.platforms", current_platform=types.SimpleNamespace(device_type=device_type))
    return mods


def load_modules(source: Path, device_type: str, uva: bool = False) -> tuple[types.ModuleType, types.ModuleType, dict]:
    """Load `source`'s `buffer_utils.py` and `block_table.py` as `vllm.v1.worker.gpu.*` with the stand-ins in place
    (`uva`: vLLM's UVA path, `stand_in_modules`);
    `sys.modules` is restored afterwards. Returns (block_table, buffer_utils, the modules vLLM's code needs in
    `sys.modules` while it runs: its buffers import `vllm.platforms` when they are built). Set `TRITON_INTERPRET=1`
    first where there is no GPU (Triton reads it when vLLM's kernels are decorated)."""
    mods = stand_in_modules(device_type, uva)
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


class VllmAnchor(NamedTuple):
    """vLLM 0.33's `BlockTables` class as `load_vllm_anchor` found it, and the path its buffers take: `path` is
    "uva" (pinned host buffers its kernels read in place, as vLLM runs on CUDA) or "fallback" (explicit
    host-to-device copies); `why` says why the fallback ("" on the UVA path)."""

    cls: type
    path: str
    why: str


def load_vllm_anchor(device_type: str) -> VllmAnchor:
    """vLLM 0.33's `BlockTables` for a process that keeps using it (the bench), on vLLM's UVA path where `uva_path`
    finds it works on `device_type`, else on its fallback: an installed vLLM's class (whose own `is_uva_available`
    then decides), else the located files' (`locate_sources`), whose stand-ins then stay in `sys.modules` (only where
    vLLM is not installed).

    Raises:
        VllmSourceError: neither vLLM nor its files are available (the message says how to provide them).
    """
    try:
        cls = importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    except ImportError:
        pass
    else:
        installed = importlib.import_module("vllm.utils.platform_utils").is_uva_available()
        return VllmAnchor(cls, "uva" if installed else "fallback", "" if installed else "the installed vLLM has no UVA")
    uva, why = uva_path(device_type)
    source = locate_sources(Path(tempfile.mkdtemp(prefix="multiwrite-vllm-")))
    block_table, _, mods = load_modules(source, device_type, uva)
    sys.modules.update(mods)
    return VllmAnchor(block_table.BlockTables, "uva" if uva else "fallback", why)


def load_vllm_block_tables(device_type: str) -> type:
    """`load_vllm_anchor(device_type).cls`: vLLM 0.33's `BlockTables` class (on the path `load_vllm_anchor` chose).

    Raises:
        VllmSourceError: neither vLLM nor its files are available (the message says how to provide them).
    """
    return load_vllm_anchor(device_type).cls
