"""`triton-cuda` and `triton-rocm`: every job of a `BlockTables` in one Triton launch, on NVIDIA and AMD GPUs.

The two backends run the same kernels (`kernels/`) with the same host side (`device.py`, `plan.py`, `ring.py`);
they differ in the launch settings and in what they check about the device. Triton is imported on first use, so
importing this plugin never needs it: a missing Triton is a reason in `multiwrite info`. With `TRITON_INTERPRET=1`
both also accept CPU devices and run the kernels through Triton's interpreter (for tests), at a negative priority,
so that they are never chosen over a native CPU backend.

What is verified for `triton-rocm`: its kernels compile to AMD machine code for gfx90a (MI200), gfx942 (MI300) and
gfx1100 (RDNA3), and run through Triton's interpreter in CI, against the reference. It has never run on AMD
hardware: the reads of pinned host memory, the completion words in host memory and the launch path are verified on
NVIDIA only.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from multiwrite.errors import BackendUnavailableError
from multiwrite.plugins.backend import PRIORITY_BUILTIN_GPU, Backend, WriteBatch
from multiwrite.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from multiwrite.backends.triton.device import LaunchParams, TritonDevice
    from multiwrite.backends.triton.device_writes import DeviceWritesRunner
    from multiwrite.backends.triton.plan import TritonPlan
    from multiwrite.stage.layout import TablesLayout
    from multiwrite.staging.arena import StagingArena, StagingBuffers

#: Oldest Triton whose APIs the kernels and launchers use (int64 -> pointer casts, atomics with sem/scope, the
#: `CompiledKernel.run(grid..., stream, function, metadata, hooks..., *args)` launcher signature).
MIN_TRITON = (3, 2)
_CPU_INTERPRETER_PRIORITY = -10
_TRUE = ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """Whether the kernels run (or, once imported, will run) through Triton's CPU interpreter."""
    mod = sys.modules.get("multiwrite.backends.triton.kernels.apply")
    if mod is not None:
        return not isinstance(mod.apply_kernel, _jit_function_type())
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _jit_function_type() -> type:
    import triton

    return triton.runtime.JITFunction


def _checked_once(check):
    """Run `check()` once; later calls return a copy of its reasons."""
    result: list[list[str]] = []

    def reasons() -> list[str]:
        if not result:
            result.append(check())
        return list(result[0])

    return reasons


@_checked_once
def triton_reasons() -> list[str]:
    """[] when a recent enough Triton imports, else one reason naming the version or error found."""
    try:
        import triton
    except Exception as exc:  # missing, or a broken install
        return [f"triton is not importable ({type(exc).__name__}: {exc})"]
    version = getattr(triton, "__version__", "0")
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:2])
    return [] if parts >= MIN_TRITON else [f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}"]


@_checked_once
def pinned_memory_reasons() -> list[str]:
    """[] when torch can allocate pinned host memory, else the error."""
    try:
        torch.empty(8, dtype=torch.uint8, pin_memory=True)
        return []
    except Exception as exc:
        return [f"pinned host memory unavailable ({type(exc).__name__}: {exc})"]


def cuda_device_reasons(device: torch.device) -> list[str]:
    """CUDA availability and the device index."""
    if not torch.cuda.is_available():
        return [f"CUDA unavailable (torch.cuda.is_available()=False, torch {torch.__version__})"]
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        return [f"device {device} does not exist ({count} visible)"]
    return []


class TritonBackend(Backend):
    """What `triton-cuda` and `triton-rocm` share: the checks, one `TritonDevice` per device, the jobs.

    Args:
        ring_depth: pinned staging slots per ring (default `$MULTIWRITE_TRITON_RING_DEPTH` or 8).
        launcher: `"auto"`, `"run"` or `"jit"` (default `$MULTIWRITE_TRITON_LAUNCHER` or `"auto"`; see
            `TritonDevice`).
    """

    PRIORITY = PRIORITY_BUILTIN_GPU
    SUPPORTED_DEVICE_TYPES = frozenset({"cuda"})
    DEVICE_WRITE_SOURCES = frozenset({"values", "tensors", "addresses"})

    def __init__(self, ring_depth: int | None = None, launcher: str | None = None):
        self.ring_depth = ring_depth
        self.launcher = launcher
        self._devices: dict[torch.device, TritonDevice] = {}
        self._device_writes: dict[torch.device, DeviceWritesRunner] = {}
        self._lock = threading.Lock()

    # -- what the two backends differ in ---------------------------------------------------------------------------
    def device_reasons(self, device: torch.device) -> list[str]:
        """Why this backend cannot run on the GPU `device` (the torch build, the device)."""
        raise NotImplementedError

    def launch_params(self, device: torch.device) -> LaunchParams:
        """The launch parameters for `device`."""
        raise NotImplementedError

    # -- Backend ---------------------------------------------------------------------------------------------------
    def priority(self, device: torch.device) -> int:
        """`PRIORITY` on GPUs; negative on CPU (the interpreter), below `torch-cpu`."""
        return _CPU_INTERPRETER_PRIORITY if device.type == "cpu" else self.PRIORITY

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> list[str]:
        """The base checks, then Triton and the device; each reason names the value found."""
        interp = interpreter_enabled()
        if device.type == "cpu" and interp:
            return super().not_supported_reasons(torch.device("cuda"), dtypes) + triton_reasons()  # dtypes only
        reasons = super().not_supported_reasons(device, dtypes)
        if device.type == "cpu":
            if not triton_reasons():  # the hint only helps where Triton imports
                reasons[0] += " (TRITON_INTERPRET=1 runs this backend on CPU through Triton's interpreter)"
            return reasons
        reasons += triton_reasons()
        if device.type != "cuda":
            return reasons
        reasons += self.device_reasons(device)
        if interp:
            reasons.append("TRITON_INTERPRET=1 is set: the interpreter cannot write GPU memory")
        return reasons

    def device_state(self, device: torch.device) -> TritonDevice:
        """The `TritonDevice` (rings, descriptors, launchers) of `device`, created on first use."""
        state = self._devices.get(device)
        if state is None:
            with self._lock:
                state = self._devices.get(device)
                if state is None:
                    from multiwrite.backends.triton.device import TritonDevice

                    state = TritonDevice(device, self.launch_params(device), self.ring_depth, self.launcher)
                    self._devices[device] = state
        return state

    def launch_paths(self) -> str:
        """How each device's kernels launch (`Launcher.path`), for `multiwrite info`; "" before the first launch."""
        return "; ".join(
            f"{d}: apply {s.apply_launcher.path}, stage {s.stage_launcher.path}" for d, s in self._devices.items()
        )

    def staging_buffers(self, device: torch.device, np_dtype: type[np.generic]) -> StagingBuffers | None:
        """A ring of pinned slots per arena that the kernels read in place; on CPU (interpreter), plain memory."""
        return self.device_state(device).lend(np_dtype)

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        """One launch per batch on the current stream of the tables' device; see `Backend.apply`."""
        if batches:
            self.device_state(batches[0].tables[0].device).apply(batches, self.NAME)

    def apply_device_writes(self, table, writes, *, ordered, faults) -> None:
        """Every set in one launch of the device-writes kernel (`multiwrite/backends/triton/device_writes.py`), on the
        current stream, no host synchronization; capturable in a CUDA graph. See `Backend.apply_device_writes`."""
        self.device_writes_runner(table.device).apply(table, writes, ordered, faults)

    def device_writes_runner(self, device: torch.device) -> DeviceWritesRunner:
        """The `DeviceWritesRunner` (ring, scan states, launcher of device-sourced writes) of `device`."""
        runner = self._device_writes.get(device)
        if runner is None:
            from multiwrite.backends.triton.device_writes import DeviceWritesRunner

            state = self.device_state(device)
            with self._lock:
                runner = self._device_writes.get(device) or self._device_writes.setdefault(device,
                                                                                            DeviceWritesRunner(state))
        return runner

    def plan(self, layout: TablesLayout, arena: StagingArena) -> TritonPlan:
        """Every job of a `BlockTables` in one launch (`multiwrite/backends/triton/plan.py`)."""
        from multiwrite.backends.triton.plan import TritonPlan

        return TritonPlan(self, self.device_state(layout.device), layout, arena, graph=False)

    def graph_plan(self, layout: TablesLayout, arena: StagingArena) -> TritonPlan:
        """The same plan, with the consume kernel of graph mode (docs/graph-mode.md).

        Raises:
            BackendUnavailableError: the compiled staging helper (graph mode's publish) is not built.
        """
        from multiwrite.backends.triton.plan import TritonPlan
        from multiwrite.staging.fields import COMPILED

        if not COMPILED:
            raise BackendUnavailableError(
                "BlockTables(cuda_graphs=True) needs the compiled helper multiwrite.staging._cstaging (graph mode's "
                "publish), which was not built: install multiwrite where a C compiler and the Python headers exist"
            )
        return TritonPlan(self, self.device_state(layout.device), layout, arena, graph=True)


class TritonCudaBackend(TritonBackend):
    """Every job of a `BlockTables` in one Triton launch on NVIDIA GPUs (compute capability >= 7.0): 4 warps of 32
    lanes, tiles of 16 writes x 64 cells (a decode step of up to 128 writes is one program)."""

    NAME = "triton-cuda"
    MIN_CAPABILITY = (7, 0)

    def device_reasons(self, device: torch.device) -> list[str]:
        """A CUDA build of torch, the device, compute capability 7.0, pinned memory."""
        hip = getattr(torch.version, "hip", None)
        if hip:
            return [f"HIP build of torch (torch.version.hip={hip}); triton-rocm serves AMD GPUs"]
        reasons = cuda_device_reasons(device)
        if reasons:
            return reasons
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < self.MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            reasons.append(f"compute capability {major}.{minor} ({name}) is below 7.0")
        return reasons + pinned_memory_reasons()

    def launch_params(self, device: torch.device) -> LaunchParams:
        """NVIDIA: 4 warps of 32 lanes, tiles of 16 writes x 64 cells, up to 64 column splits."""
        from multiwrite.backends.triton.device import LaunchParams

        return LaunchParams(num_warps=4, warp_size=32, block_w=16, block_l=64, max_splits=64)


class TritonRocmBackend(TritonBackend):
    """The same kernels on AMD GPUs through a ROCm (HIP) build of torch (where the device type is still `cuda`): 256
    lanes per program whatever the wavefront (4 wavefronts of 64 on CDNA, 8 of 32 on RDNA), tiles of 16 writes x 64
    cells (each row one whole 64-lane run). Compiled for AMD targets and interpreted in CI; never run on AMD
    hardware (module docstring)."""

    NAME = "triton-rocm"

    def device_reasons(self, device: torch.device) -> list[str]:
        """A HIP build of torch, the device, pinned memory."""
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return [f"not a HIP build of torch (torch.version.hip={hip})"]
        return cuda_device_reasons(device) + pinned_memory_reasons()

    def launch_params(self, device: torch.device) -> LaunchParams:
        """AMD: `256 // wavefront` wavefronts per program (the device's wavefront size; 64 under the interpreter).

        Raises:
            ValueError: a wavefront size other than 32 or 64.
        """
        from multiwrite.backends.triton.device import LaunchParams

        warp = 64 if device.type == "cpu" else int(getattr(torch.cuda.get_device_properties(device), "warp_size", 64))
        if warp not in (32, 64):
            raise ValueError(f"wavefront size {warp} (supported: 32, 64)")
        return LaunchParams(num_warps=256 // warp, warp_size=warp, block_w=16, block_l=64, max_splits=64)


CUDA = TritonCudaBackend()
ROCM = TritonRocmBackend()


@hookimpl
def multiwrite_backends() -> list[Any]:
    """The `triton-cuda` and `triton-rocm` backends (module-level singletons)."""
    return [CUDA, ROCM]
