"""Checks of staged values against a table's dtype, and the kernel block expansion (`b` -> `b*k .. b*k+k-1`)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from multiwrite.errors import StagedWriteError
from multiwrite.staging.layout import INT_LIMITS, dtype_name

_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: Tensor dtypes staged values may come in.
TENSOR_VALUE_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float64,
}


def checked_values(values: Any, np_dtype: type[np.generic], describe: Any) -> tuple[Any, int]:
    """Validate staged values against the table dtype; return (something numpy assigns from, length).

    `describe(length)` builds the "which table, row, start, length, shape" part of an error message.
    """
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool:
            raise StagedWriteError(f"{describe(values.numel())}: values of dtype torch.bool: stage numbers, not bools")
        if values.device.type != "cpu":
            raise StagedWriteError(
                f"{describe(values.numel())}: values are on {values.device}; stage host values "
                "(a list, a numpy array or a CPU tensor)"
            )
        if values.dtype not in TENSOR_VALUE_DTYPES:
            allowed = ", ".join(sorted(dtype_name(d) for d in TENSOR_VALUE_DTYPES))
            raise StagedWriteError(f"{describe(values.numel())}: values of dtype {values.dtype} (supported: {allowed})")
        values = values.detach().numpy()
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise StagedWriteError(
            f"{describe(len(values))}: values must be numbers, got a {type(values).__name__} ({values!r:.40})"
        )
    if isinstance(values, (set, frozenset, dict)):
        raise StagedWriteError(
            f"{describe(len(values))}: values must be an ordered sequence, got a {type(values).__name__}"
        )
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise StagedWriteError(f"{describe(values.size)}: values must be 1-D, got shape {values.shape}")
        n = values.shape[0]
        kind = values.dtype.kind
        if kind == "b":
            raise StagedWriteError(f"{describe(n)}: values of dtype bool: stage numbers, not bools")
        if np_dtype is np.float32:
            if kind not in "biuf":
                raise StagedWriteError(f"{describe(n)}: values of dtype {values.dtype} into a float32 table")
            if kind == "f" and values.dtype.itemsize > 4 and n:
                _check_float32_range(values, describe)
            return values, n
        if kind not in "biu":
            raise StagedWriteError(
                f"{describe(n)}: values of dtype {values.dtype} cannot go into an integer table "
                f"({np.dtype(np_dtype).name})"
            )
        if n and not np.can_cast(values.dtype, np_dtype):
            lo, hi = INT_LIMITS[np_dtype]
            vmin, vmax = int(values.min()), int(values.max())
            if vmin < lo or vmax > hi:
                bad = vmin if vmin < lo else vmax
                raise StagedWriteError(
                    f"{describe(n)}: value {bad} does not fit {np.dtype(np_dtype).name} [{lo}, {hi}]"
                )
        return values, n
    if not isinstance(values, (list, tuple)):
        if not isinstance(values, Iterable):
            raise StagedWriteError(f"{describe(1)}: values must be a sequence, got {type(values).__name__}")
        values = list(values)
    n = len(values)
    if not n:
        return values, 0
    if bool in map(type, values) or np.bool_ in map(type, values):
        raise StagedWriteError(f"{describe(n)}: a bool value: stage numbers, not bools")
    if np_dtype is np.float32:
        try:
            arr = np.asarray(values)
            if arr.dtype.kind == "O" and all(isinstance(v, numbers.Real) for v in values):
                arr = arr.astype(np.float64)  # Python ints past int64: as floats (or OverflowError)
            if arr.dtype.kind not in "iuf" or arr.ndim != 1:
                raise TypeError(f"got {', '.join(sorted({type(v).__name__ for v in values}))}")
            arr = arr.astype(np.float64, copy=False)
        except (TypeError, ValueError, OverflowError) as exc:
            raise StagedWriteError(f"{describe(n)}: values are not numbers ({exc})") from None
        _check_float32_range(arr, describe)
        return arr, n
    try:
        total = sum(values)
        lo_v = min(values)
        hi_v = max(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StagedWriteError(f"{describe(n)}: values are not integers ({exc})") from None
    if not isinstance(total, (int, np.integer)):
        raise StagedWriteError(
            f"{describe(n)}: a {type(total).__name__} value cannot go into an integer table ({np.dtype(np_dtype).name})"
        )
    lo, hi = INT_LIMITS[np_dtype]
    if lo_v < lo or hi_v > hi:
        bad = lo_v if lo_v < lo else hi_v
        raise StagedWriteError(f"{describe(n)}: value {bad} does not fit {np.dtype(np_dtype).name} [{lo}, {hi}]")
    return values, n


def _check_float32_range(arr: np.ndarray, describe: Any) -> None:
    finite = arr[np.isfinite(arr)]
    if finite.size and float(np.abs(finite).max()) > _FLOAT32_MAX:
        raise StagedWriteError(f"{describe(arr.size)}: value {float(np.abs(finite).max())} overflows float32")


def expand_kernel_blocks(ids: np.ndarray, k: int) -> np.ndarray:
    """Manager block ids `[n]` -> kernel block ids `[n * k]`: each `b` becomes `b*k, b*k+1, ..., b*k+k-1`."""
    return (ids[:, None] * k + np.arange(k, dtype=ids.dtype)).reshape(-1)


def check_expanded_range(values: Any, k: int, np_dtype: type[np.generic], describe: Any) -> None:
    """Expanded ids `v * k + j` must fit the dtype too."""
    if np_dtype is np.float32:
        return
    lo, hi = INT_LIMITS[np_dtype]
    # Python ints: a numpy scalar times k would wrap around in its own dtype and pass the check.
    vmin, vmax = (
        (int(values.min()), int(values.max()))
        if isinstance(values, np.ndarray)
        else (operator.index(min(values)), operator.index(max(values)))
    )
    if vmin * k < lo or vmax * k + k - 1 > hi:
        bad = vmin if vmin * k < lo else vmax
        raise StagedWriteError(
            f"{describe()}: value {bad} expanded to {k} kernel blocks ({bad * k}..{bad * k + k - 1}) "
            f"does not fit {np.dtype(np_dtype).name}"
        )
