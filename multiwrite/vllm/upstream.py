"""vLLM 0.33's own `BlockTables`, loaded to compare with (the `vllm-0.33` design of `multiwrite bench --stage`).

From an installed vLLM when there is one; otherwise from its two source files (`vllm/v1/worker/gpu/block_table.py`
and `buffer_utils.py`, taken out of the 0.33.0 wheel by the caller: nothing of vLLM is shipped here), with the few
vLLM modules they import stood in for by stubs registered under `vllm.*` in `sys.modules` (so only in a process
without vLLM installed). The stubs make vLLM's buffers its non-UVA fallback (`NonUvaBuffer`: host copies, not the
zero-copy UVA views its compiled `_C` op gives), so its measured host time is an upper bound of vLLM's own.

Environment: `MULTIWRITE_VLLM_SRC` (a directory holding the two files) or `MULTIWRITE_VLLM_WHEEL` (the wheel).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
import zipfile
from typing import Any

SOURCE_ENV, WHEEL_ENV = "MULTIWRITE_VLLM_SRC", "MULTIWRITE_VLLM_WHEEL"
#: The two files, as they sit in the wheel.
FILES = ("vllm/v1/worker/gpu/buffer_utils.py", "vllm/v1/worker/gpu/block_table.py")


def load_vllm_block_tables(device_type: str) -> type:
    """vLLM 0.33's `BlockTables` class (module docstring); `device_type`: what the stubbed platform reports.

    Raises:
        LookupError: neither vLLM nor its files are available (the message says how to provide them).
    """
    try:
        return importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    except ImportError:
        pass
    directory = os.environ.get(SOURCE_ENV)
    wheel = os.environ.get(WHEEL_ENV)
    if not directory and wheel:
        directory = tempfile.mkdtemp(prefix="multiwrite-vllm-")
        with zipfile.ZipFile(wheel) as z:
            for name in FILES:
                with open(os.path.join(directory, os.path.basename(name)), "wb") as f:
                    f.write(z.read(name))
    if not directory:
        raise LookupError(
            f"vLLM is not installed and neither {SOURCE_ENV} (a directory holding block_table.py and buffer_utils.py "
            f"of vLLM 0.33.0) nor {WHEEL_ENV} (its wheel: pip download vllm==0.33.0 --no-deps) is set"
        )
    _stub_modules(device_type)
    _load("vllm.v1.worker.gpu.buffer_utils", os.path.join(directory, "buffer_utils.py"))
    return _load("vllm.v1.worker.gpu.block_table", os.path.join(directory, "block_table.py")).BlockTables


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = sys.modules.get(name)
    if m is None:
        m = sys.modules[name] = types.ModuleType(name)
        m.__path__ = []  # (a package: the next stub imports below it)
    m.__dict__.update(attrs)
    return m


def _stub_modules(device_type: str) -> None:
    import torch
    import triton
    import triton.language as tl

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.worker",
                 "vllm.v1.worker.gpu", "vllm.utils"):  # fmt: skip
        _module(name)
    _module("vllm.triton_utils", triton=triton, tl=tl)
    _module("vllm.v1.attention.backends.utils", PAD_SLOT_ID=-1)

    class Logger(logging.LoggerAdapter):
        said: set = set()

        def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
            if msg not in self.said:
                self.said.add(msg)
                self.warning(msg, *args)

        info_once = warning_once

    _module("vllm.logger", init_logger=lambda name: Logger(logging.getLogger(name), {}))
    _module("vllm.utils.platform_utils", is_uva_available=lambda: False)

    def async_tensor_h2d(data, device=None, dtype=None, out=None):
        t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data, dtype=dtype or out.dtype)
        return out.copy_(t, non_blocking=True) if out is not None else t.to(device=device, dtype=dtype)

    def no_uva_view(t):
        raise RuntimeError("multiwrite's stand-in for vLLM has no UVA views (is_uva_available() is False)")

    _module("vllm.utils.torch_utils", async_tensor_h2d=async_tensor_h2d,
            get_accelerator_view_from_cpu_tensor=no_uva_view)  # fmt: skip
    _module("vllm.platforms", current_platform=types.SimpleNamespace(device_type=device_type))


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
