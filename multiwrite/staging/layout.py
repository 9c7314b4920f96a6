"""What a staged write is: the metadata columns every backend receives, the dtypes, and the small checks and
descriptions every staging path shares."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from multiwrite.errors import BackendUnavailableError, StagedWriteError

# Columns of the per-write metadata rows (int32), the layout every backend receives.
META_TABLE = 0  #: index of the target table within the batch
META_ROW = 1  #: row of the table
META_START = 2  #: first column written
META_LENGTH = 3  #: number of values = cells written (kernel block ids are expanded when staged)
META_VALUE_OFFSET = 4  #: offset of the write's first value in the batch's value array
META_COLUMNS = 5

#: torch dtype -> numpy dtype of the staged values.
SUPPORTED_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
}
INT_LIMITS = {np.int32: (-(2**31), 2**31 - 1), np.int64: (-(2**63), 2**63 - 1)}
#: Rows, starts and lengths travel as int32 metadata.
INT32_MAX = 2**31 - 1


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.int32` -> `"int32"`."""
    return str(dtype).removeprefix("torch.")


def shape_text(shape: Sequence[int]) -> str:
    """`(4, 8)`, and `(5,)` for a 1-D shape."""
    return str(tuple(shape))


def describe_write(
    name: str, shape: Sequence[int], dtype: torch.dtype, row: Any, start: Any, length: Any = None
) -> str:
    """`name (shape (r, c), dtype): write at row R, start S[, length L]`: how every staging error names a write
    (only the values the caller gave)."""
    text = f"{name} (shape {shape_text(shape)}, {dtype_name(dtype)}): write at row {row!r}, start {start!r}"
    return text if length is None else f"{text}, length {length}"


def strict_index(x: Any) -> int:
    """`x` as a Python int for a row, start, size or count: anything `operator.index` takes but a bool
    (`True`, `numpy.bool_`, a one-element bool tensor or array), which would silently mean 1 or 0.

    Raises:
        TypeError: `x` is a bool or not an integer (callers turn it into their own error).
    """
    if x.__class__ is int:
        return x
    if isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", None) in (torch.bool, np.bool_):
        raise TypeError(f"a bool ({x!r}), not an integer")
    return operator.index(x)


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise `StagedWriteError` unless `dtype` is one multiwrite can stage (int32, int64, float32)."""
    if dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise StagedWriteError(f"{what}: dtype={dtype} (supported: {allowed})")


def device_unavailable_reason(device: torch.device) -> str | None:
    """Why torch cannot allocate on `device` at all (a CPU-only build asked for `"cuda"`, an index past the device
    count), or None. Checked before allocating, so that the error is `BackendUnavailableError`, not torch's."""
    module = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
    if module is None or not hasattr(module, "is_available"):
        return None
    if not module.is_available():
        return f"torch {torch.__version__} reports no {device.type} device on this machine"
    count = getattr(module, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        return f"{device} does not exist: torch reports {count()} {device.type} device(s)"
    return None


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`torch.device(device)` (CPU for None), with a bare `"cuda"` resolved to the current CUDA device."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device: torch.device | str, what: str) -> torch.device:
    """`resolve_device(device)`, or `BackendUnavailableError` naming `what` when torch cannot allocate there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BackendUnavailableError(f"{what}: device {device!r} is not a torch device ({exc})") from None
    reason = device_unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"{what}: cannot place tables on {device}: {reason}")
    return resolve_device(device)
