"""Is the current CUDA stream capturing a graph? Refuse work that cannot be captured, and work in forked CUDA
children; and a capture simulator for CPU tests of graph mode.

An eager apply launches a kernel that reads its batch from staging memory by address and hands the memory back
when it runs; captured into a graph, it would run at every replay and write whatever batch sits there then. So
every eager job calls `refuse_capture` first: it raises `GraphCaptureError` before anything is recorded or changed.
Graph mode (`BlockTables(..., cuda_graphs=True)`, docs/graph-mode.md) asks `is_capturing` instead and records.

Cost on the hot path: for CPU tables one dict lookup; for CUDA tables one call of torch's C function behind
`torch.cuda.is_current_stream_capturing()` and one of `torch._C._cuda_getDevice`, plus a device switch only when
the tables live on another device than the current one.

In a process forked after its parent initialized CUDA, CUDA cannot work (the driver state is not inherited); a
kernel launched through Triton's C launcher with the parent's handles would fail obscurely. After such a fork the
probe raises `ForkedCudaError` instead, at no cost to processes that were not forked.

`simulated_capture(device)` (tests, CPU tables on the Triton backends through Triton's interpreter): while it is
active on a thread, `is_capturing(cpu)` is true on that thread and the Triton backends record their launches into
it instead of running them; `SimulatedGraph.replay()` runs them, as a CUDA graph replay runs what it captured.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator

import torch

from multiwrite.errors import ForkedCudaError, GraphCaptureError

# torch's C functions themselves (no Python frame per call). CPU-only builds of torch lack or stub them; they are
# only called for CUDA tables, which such builds cannot have.
_is_capturing: Callable[[], bool] = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", lambda: 0)
_CUDA_BUILT = torch.backends.cuda.is_built()  # (else torch's stand-in of `_is_capturing` raises)

_HOST, _UNSEEN = object(), object()
#: device -> its CUDA index (None: the current device), or _HOST for a device that is not CUDA (never captured)
_CUDA_INDEX: dict[torch.device, object] = {}
_simulation = threading.local()
_simulations = 0  # simulated captures active on any thread (read first: one global read when none is)

FORK_MESSAGE = (
    "this process was forked after its parent initialized CUDA, and CUDA cannot be used in such a child "
    "(torch: 'Cannot re-initialize CUDA in forked subprocess'); nothing was written. Start worker processes "
    "with the 'spawn' or 'forkserver' start method (multiprocessing.get_context('spawn')), or use tables on "
    "device='cpu' in the child"
)


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise `GraphCaptureError` if the current CUDA stream of `device` (or of the current device) is capturing a
    CUDA graph; return at once for non-CUDA devices.

    Args:
        device: the device of the tables about to be written (resolved: `cuda:N`, not bare `cuda`).
        what: the operation, for the message (e.g. `"FusedStagedWriter.apply"`).

    Raises:
        GraphCaptureError: a capture is underway; nothing was recorded and no state has changed.
        ForkedCudaError: this process was forked after its parent initialized CUDA.
    """
    index = _CUDA_INDEX.get(device, _UNSEEN)  # a dict lookup: cheaper than reading `device.type` every call
    if index is _HOST:
        if _simulations and simulated_graph() is not None:
            _raise(device, what)
        return
    if index is _UNSEEN:
        index = _CUDA_INDEX[device] = device.index if device.type == "cuda" else _HOST
        if index is _HOST:
            return refuse_capture(device, what)
    if _is_capturing():  # the current device's current stream (conservative when the tables live elsewhere)
        _raise(device, what)
    if index is not None and index != _get_device():
        with torch.cuda.device(index):  # type: ignore[arg-type]
            if _is_capturing():
                _raise(device, what)


def current_stream_capturing() -> bool:
    """Whether the current CUDA stream (of the current device) is capturing a CUDA graph: torch's test, read through
    this module at each call (in a child forked after CUDA was initialized it raises `ForkedCudaError`, as every
    capture test here does); False where torch is built without CUDA."""
    return _is_capturing() if _CUDA_BUILT else False


def is_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream (of the current device, and of `device` when it is another CUDA device) is
    capturing a CUDA graph; for other devices, whether a `simulated_capture` is active on this thread.

    Raises:
        ForkedCudaError: this process was forked after its parent initialized CUDA.
    """
    if device.type != "cuda":
        return bool(_simulations) and simulated_graph() is not None
    if _is_capturing():
        return True
    if device.index is not None and device.index != _get_device():
        with torch.cuda.device(device.index):
            return bool(_is_capturing())
    return False


class SimulatedGraph:
    """The launches a `simulated_capture` recorded, in order; `replay()` runs them (what a CUDA graph replay runs)."""

    def __init__(self) -> None:
        self.launches: list[Callable[[], object]] = []

    def record(self, launch: Callable[[], object]) -> None:
        """Record one launch (a callable that runs it)."""
        self.launches.append(launch)

    def replay(self) -> None:
        """Run every recorded launch, in order."""
        for launch in self.launches:
            launch()


def simulated_graph() -> SimulatedGraph | None:
    """The `SimulatedGraph` being recorded on this thread, or None."""
    return getattr(_simulation, "graph", None)


@contextlib.contextmanager
def simulated_capture() -> Iterator[SimulatedGraph]:
    """Simulate a CUDA graph capture on this thread, for CPU tables (module docstring); yields the graph."""
    global _simulations
    if simulated_graph() is not None:
        raise RuntimeError("simulated captures do not nest")
    graph = _simulation.graph = SimulatedGraph()
    _simulations += 1
    try:
        yield graph
    finally:
        _simulation.graph = None
        _simulations -= 1


def capture_id(device: torch.device) -> object:
    """What names the capture under way on the current stream of `device`: equal for every call within one capture,
    different for another capture of the process (the driver's capture id on NVIDIA, the `SimulatedGraph` of a
    simulated capture on this thread), or None where none is under way or it cannot be had (ROCm; a driver
    without `cuStreamGetCaptureInfo`). A driver call: for work done once per capture, not per step."""
    if device.type != "cuda":
        return simulated_graph() if _simulations else None
    fn = _capture_info() if torch.version.hip is None else None
    if fn is None:
        return None
    status, ident = ctypes.c_int(0), ctypes.c_uint64(0)
    stream = torch.cuda.current_stream(device).cuda_stream
    if fn(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident)) != 0 or status.value != 1:
        return None  # (1: CU_STREAM_CAPTURE_STATUS_ACTIVE)
    return ident.value


def _driver_function(name: str, *argtypes: type) -> Callable[..., int] | None:
    """The CUDA driver's (libcuda) function `name`, taking `argtypes` and returning a `CUresult`, loaded at the first
    call; None where the driver or the function cannot be had."""
    if name not in _DRIVER:
        try:
            fn = getattr(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"), name)
            fn.argtypes = list(argtypes)
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _DRIVER[name] = fn
    return _DRIVER[name]


_DRIVER: dict[str, Callable[..., int] | None] = {}


def _capture_info() -> Callable[..., int] | None:
    """The driver's `cuStreamGetCaptureInfo` (its first signature, which the unversioned symbol keeps: stream,
    status, id), or None where it cannot be had."""
    return _driver_function(
        "cuStreamGetCaptureInfo", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)
    )


def _exchange_capture_mode() -> Callable[[ctypes.c_int], int] | None:
    """The driver's `cuThreadExchangeStreamCaptureMode` (libcuda), or None where it cannot be had."""
    return _driver_function("cuThreadExchangeStreamCaptureMode", ctypes.POINTER(ctypes.c_int))


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


@contextlib.contextmanager
def setup_calls(device: torch.device) -> Iterator[None]:
    """The calls of a setup on `device` (allocations of pinned memory, synchronizations, copies to the device, module
    loads) made in relaxed capture mode on this thread: in torch's default "global" capture mode, such a call while
    ANOTHER thread captures a CUDA graph would invalidate that capture. A no-op off NVIDIA GPUs (and where the driver
    call is missing). Never use it around work of a capture on this thread."""
    fn = _exchange_capture_mode() if device.type == "cuda" and torch.version.hip is None else None
    if fn is None:
        yield
        return
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    fn(ctypes.byref(mode))
    try:
        yield
    finally:
        fn(ctypes.byref(mode))  # the thread's mode as it was


def settle(device: torch.device) -> None:
    """Wait for the setup work this thread queued on `device`'s current stream (zero fills, copies of descriptors),
    so that launches on any stream find it complete. A stream synchronization in relaxed mode (`setup_calls`): unlike
    `torch.cuda.synchronize`, it never waits on, and so never invalidates, another thread's capture. A no-op off
    CUDA devices."""
    if device.type != "cuda":
        return
    with setup_calls(device):
        torch.cuda.current_stream(device).synchronize()


def _raise(device: torch.device, what: str) -> None:
    raise GraphCaptureError(
        f"{what} on {device} during CUDA graph capture (the current stream is capturing): this call cannot be "
        "captured on tables without graph mode (its kernel reads staging memory that a replay would find holding "
        "another batch). Nothing was recorded or changed; the staged writes stay staged. To capture the block-table "
        "stage, create the tables with BlockTables(..., cuda_graphs=True) and call commit_staged_writes() before each "
        "replay (docs/graph-mode.md); otherwise call it outside torch.cuda.graph(...)."
    )


def _refuse_forked() -> bool:
    raise ForkedCudaError(FORK_MESSAGE)


def _after_fork_in_child() -> None:
    """In a child forked after CUDA was initialized, make every CUDA probe raise `ForkedCudaError`."""
    global _is_capturing
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if in_bad_fork is not None and in_bad_fork():
        _is_capturing = _refuse_forked


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
