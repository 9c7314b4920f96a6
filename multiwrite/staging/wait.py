"""The one wait of staging: for memory a launched kernel still reads, or for a graph replay to consume a batch."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from multiwrite.capture import is_capturing
from multiwrite.errors import RingStallError, RingWaitWarning

#: Seconds after which a wait warns (`RingWaitWarning`), and after which it gives up.
WAIT_WARN_S = 1.0
WAIT_TIMEOUT_S = 10.0


def wait_until(
    released: Callable[[], bool],
    describe: Callable[[str], str],
    device: torch.device,
    warn_s: float | None = None,
    timeout_s: float | None = None,
) -> None:
    """Poll `released()` until it holds (sleeping up to 1 ms between polls), warn once after `warn_s`, and after
    `timeout_s` synchronize `device` (never while a CUDA graph is being captured: that would invalidate the
    capture) and raise `RingStallError` if it still does not hold.

    Args:
        released: reads pinned words the device writes; no driver call.
        describe: `describe("has waited 1.2 s")` -> the message naming what is waited for and the likely causes.
        device: the device whose kernels release it.
        warn_s, timeout_s: default `WAIT_WARN_S`, `WAIT_TIMEOUT_S` (read at each call).

    Raises:
        RingStallError: not released in time; the caller has changed nothing.
    """
    if released():
        return
    warn_s = WAIT_WARN_S if warn_s is None else warn_s
    timeout_s = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    t0 = time.perf_counter()
    warned, pause = False, 0.0
    while not released():
        waited = time.perf_counter() - t0
        if not warned and waited >= warn_s:
            warnings.warn(RingWaitWarning(describe(f"has waited {waited:.1f} s")), stacklevel=3)
            warned = True
        if waited >= timeout_s:
            capturing = is_capturing(device)
            if device.type != "cpu" and not capturing:
                torch.cuda.synchronize(device)
            if released():
                return
            how = " and a device synchronization" if device.type != "cpu" and not capturing else ""
            if capturing:
                how = " (no device synchronization: the current stream is capturing a CUDA graph)"
            raise RingStallError(describe(f"gave up after {time.perf_counter() - t0:.1f} s{how}"))
        time.sleep(pause)
        pause = min(pause * 2 or 2e-6, 1e-3)
