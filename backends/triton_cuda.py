"""`triton-cuda`: every KV-cache group's staged writes in one Triton launch per dtype, on NVIDIA GPUs.

The kernel, the pinned ring and the descriptor cache live in `triton_kernel` (shared with `triton-rocm`),
imported on first use so that importing this plugin never needs Triton. With `TRITON_INTERPRET=1` the
backend also accepts CPU devices and runs the same kernel through Triton's interpreter (for tests), at
a negative priority so that it is never chosen over a native CPU backend.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, hookimpl
from multiwrite.staging import StagingBuffers

#: Oldest Triton whose APIs the kernel and launcher use (int64 -> pointer casts, atomic sem/scope, the
#: `CompiledKernel.run(grid..., stream, function, metadata, hooks..., *args)` launcher signature).
MIN_TRITON = (3, 2)
_CPU_INTERPRETER_PRIORITY = -10
_TRUE = ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """Whether the kernel runs (or, once imported, will run) through Triton's CPU interpreter."""
    import sys

    mod = sys.modules.get("multiwrite.backends.triton_kernel")
    if mod is not None:
        return bool(mod.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


_triton_checked: list[str] | None = None


def triton_reasons() -> list[str]:
    """[] when a recent enough Triton imports, else one reason naming the version or error found."""
    global _triton_checked
    if _triton_checked is None:
        try:
            import triton
        except Exception as exc:  # missing, or broken install
            _triton_checked = [f"triton is not importable ({type(exc).__name__}: {exc})"]
        else:
            version = getattr(triton, "__version__", "0")
            parts = tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:2])
            ok = parts >= MIN_TRITON
            _triton_checked = [] if ok else [f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}"]
    return list(_triton_checked)


_pinned_checked: list[str] | None = None


def pinned_memory_reasons() -> list[str]:
    """[] when torch can allocate pinned host memory, else the error (checked once)."""
    global _pinned_checked
    if _pinned_checked is None:
        try:
            torch.empty(8, dtype=torch.uint8, pin_memory=True)
            _pinned_checked = []
        except Exception as exc:
            _pinned_checked = [f"pinned host memory unavailable ({type(exc).__name__}: {exc})"]
    return list(_pinned_checked)


class _TritonBackend(Backend):
    """What `triton-cuda` and `triton-rocm` share: the reasons scaffolding, per-device writers, apply.

    Args:
        ring_depth: pinned ring slots per device (default `$MULTIWRITE_TRITON_RING_DEPTH` or 8).
        guard: `"kernel"` or `"event"` (default `$MULTIWRITE_TRITON_GUARD` or `"kernel"`).
        launcher: `"auto"`, `"run"` or `"jit"` (default `$MULTIWRITE_TRITON_LAUNCHER` or `"auto"`).

    See `triton_kernel.TritonWriter` for what each knob does.
    """

    PRIORITY = 100
    SUPPORTED_DEVICE_TYPES = frozenset({"cuda"})

    def __init__(self, ring_depth: int | None = None, guard: str | None = None, launcher: str | None = None):
        self.ring_depth = ring_depth
        self.guard = guard
        self.launcher = launcher
        self._writers: dict = {}
        self._lock = threading.Lock()

    # -- what subclasses differ in ------------------------------------------------------------------
    def _gpu_reasons(self, device: torch.device) -> list[str]:
        raise NotImplementedError

    def _launch_params(self, device: torch.device):
        raise NotImplementedError

    # -- Backend ----------------------------------------------------------------------------------
    def priority(self, device: torch.device) -> int:
        """`PRIORITY` on GPUs; negative on CPU (interpreter), below `torch-cpu`."""
        return _CPU_INTERPRETER_PRIORITY if device.type == "cpu" else self.PRIORITY

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """Base checks, then Triton and the device; each reason names the value found."""
        interp = interpreter_enabled()
        if device.type == "cpu" and interp:
            reasons = super().not_supported_reasons(torch.device("cuda"), dtypes)  # dtypes only
            return reasons + triton_reasons()
        reasons = super().not_supported_reasons(device, dtypes)
        if device.type == "cpu":
            if not triton_reasons():  # the hint only helps where Triton imports
                reasons[0] += " (TRITON_INTERPRET=1 runs this backend on CPU through Triton's interpreter)"
            return reasons
        reasons += triton_reasons()
        if device.type != "cuda":
            return reasons
        reasons += self._gpu_reasons(device)
        if interp:
            reasons.append("TRITON_INTERPRET=1 is set: the interpreter cannot write GPU memory")
        return reasons

    def writer(self, device: torch.device):
        """The `TritonWriter` (ring, descriptor cache, launcher) of `device`, created on first use."""
        w = self._writers.get(device)
        if w is None:
            with self._lock:
                w = self._writers.get(device)
                if w is None:
                    from multiwrite.backends.triton_kernel import TritonWriter

                    w = TritonWriter(device, self._launch_params(device), self.ring_depth, self.guard, self.launcher)
                    self._writers[device] = w
        return w

    @property
    def launch_path(self) -> str:
        """How the writers launch (`TritonWriter.launch_path`), per device; "" before the first apply."""
        return "; ".join(f"{d}: {w.launch_path}" for d, w in self._writers.items())

    def staging_buffers(self, device: torch.device, np_dtype: type[np.generic]) -> StagingBuffers | None:
        """A pinned ring per arena that the kernel reads in place (UVA); on CPU (interpreter), plain memory."""
        return self.writer(device).lend(np_dtype)

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """One launch per batch on the current stream of the tables' device; see `Backend.apply`."""
        if batches:
            self.writer(batches[0].tables[0].device).apply(batches)

    def graph_stage(self, tables: list[torch.Tensor], arena):
        """The graph mode of a `BlockTables` on this backend: a pinned header ring and the consume kernel
        (`multiwrite/backends/triton_graph.py`); attaches `arena` to a lent ring of the device's writer."""
        from multiwrite.backends.triton_graph import new_graph_stage

        return new_graph_stage(self.writer(tables[0].device), tables, arena)

    def prepare_inputs(self, batches: Sequence[WriteBatch], stage) -> None:
        """Apply, gather and slot mappings of every group in ONE launch (`triton_stage.launch_fused`);
        with nothing staged, the gather and slot-mapping launch alone. See `Backend.prepare_inputs`.

        A batch the fused kernel does not take (not exactly a `BlockTables`' tables, a row written more than
        `triton_stage.MAX_ROUNDS` times in one step) is applied first, then the stage runs in one more launch.
        """
        stage_module = _stage_module()
        if len(batches) == 1 and batches[0].values.shape[0]:  # (a BlockTables' batch: the common case)
            live = batches
        else:
            live = [b for b in batches if b.values.shape[0]]
            if not live:
                stage_module.launch_stage(stage)
                return
        if len(live) == 1 and stage_module.launch_fused(self.writer(live[0].tables[0].device), live[0], stage):
            return
        self.apply(batches)
        stage_module.launch_stage(stage)

    def bind_direct_stage(self, bt, epoch: int):
        """The direct path of `bt.prepare_inputs` on this backend (`multiwrite/backends/triton_direct.py`):
        a callable taking `prepare_inputs`' arguments that returns its result, or None having done nothing
        when the call is not the common eager decode case; None instead of the callable while `bt` is not ready
        for it yet (called again after a later general call). `epoch` is the index of the overlap epoch in
        `bt._context_view`. Holds no reference to `bt`."""
        from multiwrite.backends import triton_direct

        return triton_direct.bind(bt, self.writer(bt.device), epoch)


def _stage_module():
    """`multiwrite.backends.triton_stage`, imported on first use (it compiles nothing until then)."""
    global _STAGE_MODULE
    if _STAGE_MODULE is None:
        from multiwrite.backends import triton_stage

        _STAGE_MODULE = triton_stage
    return _STAGE_MODULE


_STAGE_MODULE = None


def _cuda_device_reasons(device: torch.device) -> list[str]:
    """CUDA availability and the device index (shared by both GPU backends)."""
    if not torch.cuda.is_available():
        return [f"CUDA unavailable (torch.cuda.is_available()=False, torch {torch.__version__})"]
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        return [f"device {device} does not exist ({count} visible)"]
    return []


class TritonCudaBackend(_TritonBackend):
    """One Triton launch per apply and dtype on NVIDIA GPUs (compute capability >= 7.0).

    Metadata and values travel through a pinned host ring read by the kernel over UVA; tables are found
    through a cached device descriptor table. See `triton_kernel` for the launch path and slot guard.
    """

    NAME = "triton-cuda"
    MIN_CAPABILITY = (7, 0)

    def _gpu_reasons(self, device: torch.device) -> list[str]:
        hip = getattr(torch.version, "hip", None)
        if hip:
            return [f"HIP build of torch (torch.version.hip={hip}); triton-rocm serves AMD GPUs"]
        reasons = _cuda_device_reasons(device)
        if reasons:
            return reasons
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < self.MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            reasons.append(f"compute capability {major}.{minor} ({name}) is below 7.0")
        return reasons + pinned_memory_reasons()

    def _launch_params(self, device: torch.device):
        from multiwrite.backends.triton_kernel import cuda_launch_params

        return cuda_launch_params()


_BACKEND = TritonCudaBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """The `triton-cuda` backend (a module-level singleton)."""
    return [_BACKEND]
