"""Refuse work on a CUDA stream that is being captured into a CUDA graph, and in forked CUDA children.

An eager apply launches a kernel that reads its batch from a host ring slot by address and hands the slot
back when it runs; captured into a graph, it would run at every replay and write whatever batch sits in that
slot then, and a capture never replayed would hold its slot forever. So `refuse_capture` is called first
thing by every eager apply (`FusedStagedWriter.apply`, so `BlockTables.apply_staged_writes` and every
backend) and by `BlockTables.clear_staged_writes`: it raises `GraphCaptureError` before anything is
recorded or changed. Capture is supported by the explicit graph mode, `BlockTables(..., cuda_graphs=True)`
(`multiwrite/backends/triton_graph.py`), which asks `is_capturing` instead.

Cost on the hot path: for CPU tables one dict lookup (about 0.1 us here; reading `device.type` costs
0.6 us); for CUDA tables that, one call of torch's C function behind
`torch.cuda.is_current_stream_capturing()` (cudaStreamIsCapturing on the current stream) and one of
`torch._C._cuda_getDevice`, plus a device switch only when the tables live on another device than the
current one. `scripts/issue8_costs.py` measures it.

In a process forked after its parent initialized CUDA, CUDA cannot work (the driver state is not
inherited); torch raises for its own calls, but a kernel launched through Triton's C launcher with the
parent's handles would fail obscurely. After such a fork the probe raises `ForkedCudaError` instead, at
no cost to processes that were not forked.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from multiwrite.errors import ForkedCudaError, GraphCaptureError

# torch's C functions themselves (no Python frame per call). CPU-only builds of torch lack or stub them;
# they are only called for CUDA tables, which such builds cannot have.
_is_capturing: Callable[[], bool] = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", lambda: 0)

_HOST, _UNSEEN = object(), object()
#: device -> its CUDA index (None: the current device), or _HOST for a device that is not CUDA (never captured)
_CUDA_INDEX: dict[torch.device, object] = {}

FORK_MESSAGE = (
    "this process was forked after its parent initialized CUDA, and CUDA cannot be used in such a child "
    "(torch: 'Cannot re-initialize CUDA in forked subprocess'); nothing was written. Start worker processes "
    "with the 'spawn' or 'forkserver' start method (multiprocessing.get_context('spawn')), or use tables on "
    "device='cpu' in the child"
)


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise `GraphCaptureError` if the current CUDA stream of `device` (or of the current device) is
    capturing a CUDA graph; return at once for non-CUDA devices.

    Args:
        device: the device of the tables about to be written (resolved: `cuda:N`, not bare `cuda`).
        what: the operation, for the message (e.g. `"FusedStagedWriter.apply"`).

    Raises:
        GraphCaptureError: a capture is underway; nothing was recorded and no state has changed.
        ForkedCudaError: this process was forked after its parent initialized CUDA.
    """
    index = _CUDA_INDEX.get(device, _UNSEEN)  # a dict lookup: cheaper than reading `device.type` every call
    if index is _HOST:
        return
    if index is _UNSEEN:
        index = _CUDA_INDEX[device] = device.index if device.type == "cuda" else _HOST
        if index is _HOST:
            return
    if _is_capturing():  # the current device's current stream (conservative when the tables live elsewhere)
        _raise(device, what)
    if index is not None and index != _get_device():
        with torch.cuda.device(index):
            if _is_capturing():
                _raise(device, what)


def is_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream (of the current device, and of `device` when it is another CUDA
    device) is capturing a CUDA graph; False for non-CUDA devices.

    Raises:
        ForkedCudaError: this process was forked after its parent initialized CUDA.
    """
    if device.type != "cuda":
        return False
    if _is_capturing():
        return True
    if device.index is not None and device.index != _get_device():
        with torch.cuda.device(device.index):
            return bool(_is_capturing())
    return False


def _raise(device: torch.device, what: str) -> None:
    raise GraphCaptureError(
        f"{what} on {device} during CUDA graph capture (the current stream is capturing): this call cannot be "
        "captured on tables without graph mode (their apply kernel reads a host ring slot that a replay would find "
        "holding another batch). Nothing was "
        "recorded or changed; the staged writes stay staged. To capture BlockTables.apply_staged_writes() or "
        "prepare_inputs() (or gather_block_tables(), compute_slot_mappings()), create the tables with "
        "BlockTables(..., cuda_graphs=True) and call commit_staged_writes() before each replay; otherwise call it "
        "outside torch.cuda.graph(...)."
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
