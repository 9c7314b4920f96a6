"""Host cost of the capture check of every eager apply and of the shared-ring lock: micro-measurements, not a test.

    python scripts/capture_probe_costs.py                                     # on a GPU machine: real applies
    TRITON_INTERPRET=1 python scripts/capture_probe_costs.py --device cpu     # the host path, a stand-in launch

Every eager job first asks whether the current stream captures a CUDA graph (`multiwrite.capture.refuse_capture`,
which raises `GraphCaptureError` if so), and a `FusedStagedWriter.apply` of batches that arrive as plain arrays
copies them into the device's shared staging ring of the Triton backend under a lock. Prints medians in
microseconds:
  - `torch.cuda.is_current_stream_capturing()` (GPU only) and `refuse_capture` alone;
  - an uncontended `threading.RLock` acquire + release (the lock of the shared ring);
  - a decode-sized `BlockTables.apply_staged_writes` (8 requests of G3; the tables' own staging ring: no lock) and
    a `FusedStagedWriter.apply` of three `StagedWriteTensor`s (merged into one batch: the shared ring, one lock),
    each with the capture check as shipped and with it replaced by a no-op (the module-level `refuse_capture` of
    `multiwrite.tables.block_tables` and `multiwrite.writer`), alternating in blocks so drift reaches both alike.
On CPU (Triton's interpreter) the kernel launch is replaced by a stand-in that only stores the completion token
(bound as the apply launcher's fast launch function for every variant), so what remains is the host path.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time

import numpy as np
import torch

import multiwrite.tables.block_tables as block_tables_module
import multiwrite.writer as writer_module
from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.capture import refuse_capture

#: Positions of the completion word's address and of the token in the apply kernel's arguments.
DONE_ARG, TOKEN_ARG = 5, 6


def median_us(fn, n: int, sync) -> float:
    times = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if i % 50 == 49:
            sync()
    sync()
    return statistics.median(times) / 1e3


def stand_in_launches(backend: TritonCudaBackend, device: torch.device) -> None:
    """Make every apply launch on `device` store its token and do nothing else (CPU: the host path alone)."""

    def fire_token(g0, g1, stream, args):
        ctypes.c_int32.from_address(args[DONE_ARG]).value = args[TOKEN_ARG]

    launcher = backend.device_state(device).apply_launcher
    for dt in (np.int32, np.int64, np.float32):
        for decode in (False, True):
            launcher.fire[(np.dtype(dt).char, decode)] = fire_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    backend = TritonCudaBackend()  # a fresh one: its own device state
    if device.type == "cpu":
        stand_in_launches(backend, device)
    print(f"device {device}, {args.n} calls each, medians in us")
    if device.type == "cuda":
        probe = median_us(torch.cuda.is_current_stream_capturing, args.n, sync)
        print(f"  torch.cuda.is_current_stream_capturing(): {probe:.3f}")
    print(f"  refuse_capture({device}): {median_us(lambda: refuse_capture(device, 'x'), args.n, sync):.3f}")
    lock = threading.RLock()

    def lock_pair():
        lock.acquire()
        lock.release()

    print(f"  RLock acquire + release: {median_us(lock_pair, args.n, sync):.3f}")

    bt = BlockTables([16, 32, 8], 64, [64, 32, 128], device, [16, 16, 8], backend=backend)
    tabs = [StagedWriteTensor((16, 64), torch.int32, device, name=f"t{i}") for i in range(3)]
    fused = FusedStagedWriter(device, backend=backend)
    step = [0]

    def decode_step():  # one new block id for 8 requests (timed: the apply only)
        s = step[0] = step[0] + 1
        for r in range(8):
            bt.append_block_ids(r, ([s % 60], [], [s % 100]), overwrite=(s % 30 == 0))

    def timed_apply_bt(n):
        times = []
        for i in range(n):
            decode_step()
            t0 = time.perf_counter_ns()
            bt.apply_staged_writes()
            times.append(time.perf_counter_ns() - t0)
            if i % 50 == 49:
                sync()
        sync()
        return statistics.median(times) / 1e3

    def timed_apply_fused(n):
        times = []
        for i in range(n):
            for j, t in enumerate(tabs):
                t.stage_write(i % 16, 0, [i, j])
            t0 = time.perf_counter_ns()
            fused.apply(tabs)
            times.append(time.perf_counter_ns() - t0)
            if i % 50 == 49:
                sync()
        sync()
        return statistics.median(times) / 1e3

    timed_apply_bt(200)  # compile, bind, warm
    timed_apply_fused(200)
    real = refuse_capture
    modules = (block_tables_module, writer_module)

    def no_check(device, what):
        return None

    results: dict[str, list[float]] = {k: [] for k in ("bt check", "bt no check", "fused check", "fused no check")}
    block = max(args.n // 20, 100)
    try:
        for _ in range(10):
            for label, check in (("check", real), ("no check", no_check)):
                for module in modules:
                    module.refuse_capture = check
                results[f"bt {label}"].append(timed_apply_bt(block))
                results[f"fused {label}"].append(timed_apply_fused(block))
    finally:
        for module in modules:
            module.refuse_capture = real
    for k, v in results.items():
        print(f"  apply, {k}: {statistics.median(v):.3f}")
    print(
        "  capture check cost per apply: "
        f"BlockTables {statistics.median(results['bt check']) - statistics.median(results['bt no check']):+.3f}, "
        f"fused {statistics.median(results['fused check']) - statistics.median(results['fused no check']):+.3f}"
    )


if __name__ == "__main__":
    main()
