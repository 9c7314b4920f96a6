"""What a run happened on: versions and device names, for summaries and CSV rows."""

from __future__ import annotations

import platform
import sys
from functools import lru_cache

import numpy as np
import torch

from multiwrite.version import __version__


@lru_cache(maxsize=1)
def triton_version() -> str | None:
    """Installed Triton version, or None when Triton cannot be imported."""
    try:
        import triton
    except Exception:
        return None
    return str(triton.__version__)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """Human name of a device: the GPU's name for CUDA/ROCm devices, the CPU model otherwise."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_name()


def environment(device: torch.device) -> dict[str, str]:
    """Versions and device name, as strings: multiwrite, torch, triton, numpy, python, device, device_name."""
    return {
        "multiwrite": __version__,
        "torch": torch.__version__,
        "triton": triton_version() or "not installed",
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "device": str(device),
        "device_name": device_name(device),
        "torch_threads": str(torch.get_num_threads()),
    }


class DeviceError(ValueError):
    """A device string that cannot be parsed, or names a CUDA (or ROCm) device this machine lacks."""


def _torch_build() -> str:
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"torch {torch.__version__} built with ROCm/HIP {hip}"
    if torch.version.cuda:
        return f"torch {torch.__version__} built with CUDA {torch.version.cuda}"
    return f"torch {torch.__version__} built without CUDA"


def resolve_device(device: str) -> torch.device:
    """`"auto"` -> the current CUDA (or ROCm) device when there is one, else CPU; other names as given.

    Raises:
        DeviceError: `device` is not a device string torch understands, or names a CUDA device (ROCm
            devices are CUDA devices to torch) that is not there, saying what torch build this is.
    """
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"cannot parse device {device!r}: {exc} (expected auto, cpu, cuda or cuda:N)") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = _torch_build()
            why = "" if build.endswith("without CUDA") else ", no device visible"
            raise DeviceError(f"device {device} requested but CUDA is not available ({build}{why})")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise DeviceError(f"device {device} requested but only {count} CUDA device(s) are visible")
    return resolved


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on `device` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
