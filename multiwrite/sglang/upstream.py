"""SGLang 0.5.23's own page-table writers, loaded to compare with: the oracle of `tests/sglang` and SGLang's side of
`multiwrite bench --sglang`. Nothing of SGLang is shipped here: three of its files are located at run time,

- `MULTIWRITE_SGLANG_SRC`: a directory holding `allocation.py`, `common.py` and `memory_pool.py` (for a machine
  without network), or
- `MULTIWRITE_SGLANG_WHEEL`: the path of SGLang 0.5.23's wheel (`pip download sglang==0.5.23 --no-deps`); the three
  files are read out of it with `zipfile`,

and run with stand-ins for what they import (`stand_in_modules`). `sglang/kernels/ops/memory/common.py` (the Triton
kernels) needs only torch and Triton and is loaded whole. `sglang/srt/mem_cache/allocation.py` is loaded whole as
`sglang.srt.mem_cache.allocation`, its SGLang imports replaced by small stand-ins (a settable attention backend,
page interleaving off, no eviction, not an NPU). Of the 259 KB `memory_pool.py` only the class `ReqToTokenPool` is
taken (found by name in its syntax tree), its two imports stood in for (no memory saver).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multiwrite._upstream import locate_files, modules_in_place

WHEEL_ENV = "MULTIWRITE_SGLANG_WHEEL"
SRC_ENV = "MULTIWRITE_SGLANG_SRC"
VERSION = "0.5.23"
#: The three files, by their path inside SGLang's wheel.
MEMBERS = {
    "allocation.py": "sglang/srt/mem_cache/allocation.py",
    "common.py": "sglang/kernels/ops/memory/common.py",
    "memory_pool.py": "sglang/srt/mem_cache/memory_pool.py",
}
ALLOCATION = "sglang.srt.mem_cache.allocation"
KERNELS = "sglang.kernels.ops.memory.common"
SKIP_REASON = (
    f"SGLang's writers are not located: run `tox -e sglang` (downloads SGLang {VERSION}'s wheel), or set "
    f"{WHEEL_ENV}=<path of sglang-{VERSION}-*.whl> or {SRC_ENV}=<a directory holding allocation.py, common.py and "
    "memory_pool.py from sglang/srt/mem_cache/ and sglang/kernels/ops/memory/>"
)


class SglangSourceError(RuntimeError):
    """`MULTIWRITE_SGLANG_WHEEL` or `MULTIWRITE_SGLANG_SRC` is unset, or set but not pointing at the three files."""


def configured() -> bool:
    """Whether one of the two environment variables is set (then a missing file is an error, not a skip)."""
    return bool(os.environ.get(SRC_ENV) or os.environ.get(WHEEL_ENV))


def locate_sources(scratch: Path) -> Path:
    """The directory holding SGLang's three files, extracting them from the wheel into `scratch` when
    `MULTIWRITE_SGLANG_WHEEL` names one. Raises `SglangSourceError` naming the variable and path."""
    return locate_files(
        MEMBERS, scratch, src_env=SRC_ENV, wheel_env=WHEEL_ENV, unset=SKIP_REASON, error=SglangSourceError
    )


@dataclass
class Settings:
    """What the stand-ins answer, changeable between calls: the `(prefill, decode)` attention backends
    (`"triton"`: SGLang's Triton writer; `"torch_native"`: its per-request fallback)."""

    attention_backends: tuple[str, str] = ("triton", "triton")


@dataclass
class Upstream:
    """SGLang's modules, loaded. `allocation` and `kernels` are SGLang's own code; `ReqToTokenPool` its class;
    `modules` every module name they need in `sys.modules` while they run (`active()` puts them there)."""

    allocation: types.ModuleType
    kernels: types.ModuleType
    ReqToTokenPool: type  # noqa: N815 (SGLang's name)
    source: Path
    settings: Settings
    modules: dict[str, types.ModuleType] = field(default_factory=dict)

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The stand-ins and SGLang's modules in `sys.modules` for the duration; afterwards as before."""
        return modules_in_place(self.modules)

    def pool(self, size: int, max_context_len: int, device: Any) -> Any:
        """SGLang's `ReqToTokenPool(size, max_context_len, device, enable_memory_saver=False)`: an int32
        `req_to_token` of `[size + 1, max_context_len]` zeros (row 0 the padding row)."""
        return self.ReqToTokenPool(size, max_context_len, str(device), False)


def _package(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so that submodules import
    m.__dict__.update(attrs)
    return m


def _npu_only(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("the stand-in is not an NPU: SGLang's DSV4-NPU hooks are never called here")


def stand_in_modules(settings: Settings) -> dict[str, types.ModuleType]:
    """The stand-ins for the SGLang modules `allocation.py` imports, by module name (not yet in `sys.modules`):
    `attention_backends()` answers `settings`, `support_triton` is SGLang's rule (not `torch_native` nor
    `intel_amx`), pinned memory where CUDA is, interleaving off, eviction a no-op, not a CPU, HIP, NPU or XPU
    build (so `allocation.py` imports no `sgl_kernel`), DCP off."""
    import torch

    class BasePrefixCache:  # only named in annotations and isinstance checks of paths not taken here
        pass

    class EvictParams:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    class HybridReqToTokenPool:  # no pool here is one (isinstance checks only)
        pass

    cuda = torch.cuda.is_available() and torch.version.hip is None
    names = ["sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.memory", "sglang.srt",
             "sglang.srt.hardware_backend", "sglang.srt.hardware_backend.npu", "sglang.srt.hardware_backend.npu.dsv4",
             "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator"]  # fmt: skip
    mods = {name: _package(name) for name in names}
    for name, attrs in {
        "sglang.srt.hardware_backend.npu.dsv4.dsv4_common_hooks": dict(
            maybe_write_dsv4_decode=_npu_only, maybe_write_dsv4_extend=_npu_only
        ),
        "sglang.srt.mem_cache.allocator.page_interleave": dict(page_interleave_shard_size=lambda allocator: 1),
        "sglang.srt.mem_cache.base_prefix_cache": dict(BasePrefixCache=BasePrefixCache, EvictParams=EvictParams),
        "sglang.srt.mem_cache.common": dict(
            available_and_evictable_str=lambda tree_cache: "(stand-in cache)",
            evict_from_tree_cache=lambda tree_cache, num_tokens: None,
        ),
        "sglang.srt.mem_cache.memory_pool": dict(HybridReqToTokenPool=HybridReqToTokenPool),
        "sglang.srt.runtime_context": dict(
            attention_backends=lambda: settings.attention_backends,
            get_parallel=lambda: types.SimpleNamespace(dcp_enabled=False),
        ),
        "sglang.srt.utils": dict(
            is_cpu=lambda: False,
            is_cuda=lambda: cuda,
            is_hip=lambda: False,
            is_npu=lambda: False,
            is_xpu=lambda: False,
            next_power_of_2=lambda n: 1 << (n - 1).bit_length() if n > 0 else 1,
            support_triton=lambda backend: backend not in ("torch_native", "intel_amx"),
        ),
        "sglang.srt.utils.common": dict(is_pin_memory_available=lambda device=None: torch.cuda.is_available()),
    }.items():
        mods[name] = _package(name, **attrs)
    return mods


def _load(name: str, path: Path, mods: dict[str, types.ModuleType]) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    mods[name] = sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, leaf = name.rpartition(".")
    setattr(mods[parent], leaf, module)
    return module


def req_to_token_pool_class(memory_pool_py: Path) -> type:
    """SGLang's `ReqToTokenPool`, taken by name out of `memory_pool.py`'s syntax tree and run with stand-ins for the
    two names its constructor imports (`TorchMemorySaverAdapter`: no memory saver; `GPU_MEMORY_TYPE_KV_CACHE`)."""
    import typing

    import torch

    tree = ast.parse(memory_pool_py.read_text(encoding="utf-8"), str(memory_pool_py))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ReqToTokenPool"]
    if not found:
        raise SglangSourceError(f"{memory_pool_py}: no class ReqToTokenPool")

    class TorchMemorySaverAdapter:
        @staticmethod
        def create(enable: bool) -> Any:
            return types.SimpleNamespace(region=lambda *args, **kwargs: contextlib.nullcontext())

    ns: dict[str, Any] = {"__name__": "sglang.srt.mem_cache.memory_pool", "torch": torch,
                          "TorchMemorySaverAdapter": TorchMemorySaverAdapter, "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache"}
    ns.update({name: getattr(typing, name) for name in ("Any", "Callable", "List", "Optional")})  # fmt: skip
    import __future__

    code = compile(ast.Module(body=found, type_ignores=[]), str(memory_pool_py), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # fmt: skip
    exec(code, ns)
    return ns["ReqToTokenPool"]


def load_upstream(source: Path, settings: Settings | None = None) -> Upstream:
    """Load SGLang's kernels and `allocation.py` from `source` as their SGLang modules, with the stand-ins in place;
    `sys.modules` is restored afterwards (`Upstream.active()` puts them back). Set `TRITON_INTERPRET=1` first where
    there is no GPU (Triton reads it when SGLang's kernels are decorated)."""
    settings = settings or Settings()
    mods = stand_in_modules(settings)
    with modules_in_place({**mods, KERNELS: types.ModuleType(KERNELS), ALLOCATION: types.ModuleType(ALLOCATION)}):
        kernels = _load(KERNELS, source / "common.py", mods)
        pool_cls = req_to_token_pool_class(source / "memory_pool.py")
        mods["sglang.srt.mem_cache.memory_pool"].ReqToTokenPool = pool_cls
        allocation = _load(ALLOCATION, source / "allocation.py", mods)
    return Upstream(allocation, kernels, pool_cls, source, settings, mods)


class Allocator:
    """The stand-in KV-slot allocator of SGLang's decode allocation: hands out the `slots` it is given and records
    what it was asked (`asked`: (method, args)); `freed` collects what was given back."""

    def __init__(self, slots: Any, page_size: int) -> None:
        self.slots, self.page_size = slots, page_size
        self.asked: list[tuple[str, tuple]] = []
        self.freed: list[Any] = []

    def alloc(self, num_tokens: int) -> Any:
        self.asked.append(("alloc", (num_tokens,)))
        return self.slots[:num_tokens]

    def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> Any:
        self.asked.append(("alloc_decode", (seq_lens.clone(), seq_lens_cpu.clone(), last_loc.clone())))
        return self.slots[: seq_lens.shape[0]]

    def free(self, slots: Any) -> None:
        self.freed.append(slots)


def decode_batch(pool: Any, rows: list[int], seq_lens: list[int], slots: Any, page_size: int = 1,
                 encoder_lens: list[int] | None = None) -> types.SimpleNamespace:  # fmt: skip
    """A stand-in for SGLang's `ScheduleBatch` with what its decode allocation reads: the pool, the requests' rows
    and lengths (device and CPU), a tree cache with `page_size` over an `Allocator` of `slots`, a model config
    (encoder-decoder when `encoder_lens` is given), and per-request KV counters."""
    import torch

    device = pool.req_to_token.device
    allocator = Allocator(slots, page_size)
    evicted: list[bool] = []
    return types.SimpleNamespace(
        device=device,
        req_to_token_pool=pool,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        req_pool_indices_cpu=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        encoder_lens=None if encoder_lens is None else torch.tensor(encoder_lens, dtype=torch.int64, device=device),
        model_config=types.SimpleNamespace(is_encoder_decoder=encoder_lens is not None),
        tree_cache=types.SimpleNamespace(page_size=page_size, token_to_kv_pool_allocator=allocator,
                                         pretty_print=lambda: None),  # fmt: skip
        reqs=[types.SimpleNamespace(kv=types.SimpleNamespace(kv_allocated_len=n, kv_committed_len=n))
              for n in seq_lens],  # fmt: skip
        maybe_evict_swa=lambda: evicted.append(True),
        evicted=evicted,
    )
