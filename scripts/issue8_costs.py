"""Host cost of issue 8's guards (capture check, thread locks): micro-measurements, not a test or a bench goal.

    python scripts/issue8_costs.py                  # on a GPU machine: the CUDA probe and a real apply
    TRITON_INTERPRET=1 python scripts/issue8_costs.py --device cpu   # host path with a stand-in launcher

Prints medians in microseconds:
  - `refuse_capture` alone (for CUDA tables: torch's C probe behind torch.cuda.is_current_stream_capturing);
  - an uncontended `threading.RLock` acquire + release (the Triton writer's shared-ring path takes one);
  - a decode-sized `BlockTables.apply_staged_writes` (lent ring: no lock) and a fused apply of three
    `StagedWriteTensor`s (shared ring: one lock), each with the capture check as shipped and with it
    replaced by a no-op, alternating in blocks so drift reaches both alike. On CPU the kernel launch is
    replaced by a stand-in that only stores the completion token, so what remains is the host path.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time

import numpy as np
import torch

import multiwrite.writer as writer_module
from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.capture import refuse_capture


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    backend = TritonCudaBackend()
    if device.type == "cpu":  # a stand-in launch: store the token, nothing else (host path only)
        writer = backend.writer(device)

        def fire_token(g0, g1, stream, args):
            ctypes.c_int32.from_address(args[5]).value = args[6]

        for dt in (np.int32, np.int64, np.float32):
            for decode in (False, True):
                writer._fire[(np.dtype(dt), decode)] = fire_token
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
    tabs = [StagedWriteTensor((16, 64), d, device, name=str(d)) for d in (torch.int32, torch.int32, torch.int32)]
    fused = FusedStagedWriter(device, backend=backend)
    step = [0]

    def decode_step():  # one new block id for 8 requests, then the apply (timed: the apply only)
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
    real = writer_module.refuse_capture
    results: dict[str, list[float]] = {k: [] for k in ("bt check", "bt no check", "fused check", "fused no check")}
    block = max(args.n // 20, 100)
    for _ in range(10):
        for label, check in (("check", real), ("no check", lambda device, what: None)):
            writer_module.refuse_capture = check
            results[f"bt {label}"].append(timed_apply_bt(block))
            results[f"fused {label}"].append(timed_apply_fused(block))
    writer_module.refuse_capture = real
    for k, v in results.items():
        print(f"  apply, {k}: {statistics.median(v):.3f}")
    print(
        "  capture check cost per apply: "
        f"BlockTables {statistics.median(results['bt check']) - statistics.median(results['bt no check']):+.3f}, "
        f"fused {statistics.median(results['fused check']) - statistics.median(results['fused no check']):+.3f}"
    )


if __name__ == "__main__":
    main()
