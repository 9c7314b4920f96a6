"""GPU acceptance run for `triton-cuda` (issue 3): tests, race, streams, reallocation, timing.

Run from the repository root on the GPU machine (no network needed)::

    OUT=/some/dir python scripts/gpu_check.py            # everything, logs under $OUT
    python scripts/gpu_check.py --parts race,streams      # a subset
    TRITON_INTERPRET=1 python scripts/gpu_check.py --device cpu --quick   # smoke-test this script on CPU

Parts (each in its own try/except; the exit status is non-zero if any fails):
  install  multiwrite must be installed (entry points); if not, `pip install --no-deps -e .` is tried.
  tests    `python -m pytest tests -q -rs` with MULTIWRITE_BACKEND=triton-cuda (log: pytest.log; no -x,
           so one run shows every failure).
  race     the stream held busy by `torch.cuda._sleep`, 10,000 applies of random batches through
           BlockTables and three StagedWriteTensors (int32/int64/float32, overlapping writes) with a
           ring of depth 2 and no host synchronization, then one synchronize: equal to the reference.
  streams  applies on a non-default stream land on that stream (checked while it is still asleep);
           two streams sharing one ring of depth 2.
  realloc  `.tensor` replaced through its setter, `resize_` and `set_` in place: writes land in the new
           storage, the old storage (and a canary allocated where it was freed) is never written.
  replay   `multiwrite replay --device cuda --backend triton-cuda` for G1 and G3 at C=40 and 256.
  timing   median host time per apply vs an empty Triton launch (same run), per launcher and guard, on
           the trace for G1-G4 at C=40/256; device time per apply (CUDA events around an apply queued
           behind a short sleep, so launch overhead is excluded); a prefill burst vs a pinned H2D copy.

Writes `$OUT/gpu_check.log`, `$OUT/pytest.log`, `$OUT/results.json` (OUT defaults to ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

OUT = Path(os.environ.get("OUT") or "gpu_check_out")
RESULTS: dict = {"parts": {}}
_log_file = None


def log(*args) -> None:
    """Print and append to $OUT/gpu_check.log."""
    line = " ".join(str(a) for a in args)
    print(line, flush=True)
    if _log_file is not None:
        _log_file.write(line + "\n")
        _log_file.flush()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy(device: torch.device, seconds: float) -> None:
    """Hold the current stream busy for about `seconds` (no-op on CPU)."""
    if device.type == "cuda":
        clock_hz = 2.0e9  # H200 boost clock is ~1.98 GHz; the exact figure does not matter
        torch.cuda._sleep(int(seconds * clock_hz))


def backend_instance(**kw):
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    return TritonCudaBackend(**kw)


# -- random workloads --------------------------------------------------------------------------------
class RandomBlockTables:
    """A BlockTables plus its reference, driven by random append_block_ids calls (with overlaps)."""

    def __init__(self, device, backend, rng, reqs=48, block_sizes=(16, 32, 8), kernel_block_sizes=(16, 16, 8)):
        from multiwrite import BlockTables
        from multiwrite.reference import ReferenceBlockTables

        self.widths = [40, 24, 60]
        self.bt = BlockTables(list(block_sizes), reqs, self.widths, device, list(kernel_block_sizes), backend=backend)
        self.ref = ReferenceBlockTables(list(block_sizes), reqs, self.widths, list(kernel_block_sizes))
        self.k = self.bt.kernel_blocks_per_block
        self.rng = rng
        self.reqs = reqs

    def stage_step(self, max_calls: int = 12) -> None:
        rng = self.rng
        for _ in range(int(rng.integers(1, max_calls + 1))):
            r = int(rng.integers(0, self.reqs))
            overwrite = bool(rng.random() < 0.3)
            ids = []
            for g, k in enumerate(self.k):
                room = (self.widths[g] * k - (0 if overwrite else int(self.ref.num_blocks[g, r]))) // k
                n = int(rng.integers(0, min(room, 3 if rng.random() < 0.9 else 40) + 1)) if room > 0 else 0
                ids.append(rng.integers(1, 100_000, n).tolist())
            if not overwrite and not any(ids):
                continue
            self.bt.append_block_ids(r, ids, overwrite)
            self.ref.append_block_ids(r, ids, overwrite)

    def mismatches(self) -> int:
        from multiwrite.replay import count_mismatches

        return count_mismatches(self.bt, self.ref)


class RandomTensors:
    """Three StagedWriteTensors (int32 k=2, int64, float32) applied together, with their references."""

    def __init__(self, device, backend, rng):
        from multiwrite import FusedStagedWriter, StagedWriteTensor

        self.tabs = [
            StagedWriteTensor((16, 300), torch.int32, device, name="i32", kernel_blocks_per_block=2),
            StagedWriteTensor((8, 70), torch.int64, device, name="i64"),
            StagedWriteTensor(33, torch.float32, device, name="f32"),
        ]
        self.refs = [np.zeros(t.tensor.shape if t.tensor.dim() == 2 else (33, 1), np.float64) for t in self.tabs]
        self.ks = [2, 1, 1]
        self.writer = FusedStagedWriter(device, backend=backend)
        self.rng = rng

    def stage_step(self) -> None:
        from multiwrite.reference import apply_writes_reference

        rng = self.rng
        for _ in range(int(rng.integers(0, 10))):
            j = int(rng.integers(0, 3))
            rows, cols = self.refs[j].shape
            k = self.ks[j]
            row = int(rng.integers(0, rows))
            n = int(rng.integers(0, cols // k + 1)) if rng.random() < 0.1 else int(rng.integers(0, 4))
            n = min(n, cols // k)
            start = int(rng.integers(0, cols - n * k + 1))
            vals = rng.integers(0, 1 << 20, n)
            vals = vals + 0.5 if j == 2 else vals
            self.tabs[j].stage_write(row, start, vals)
            apply_writes_reference(self.refs[j], [(row, start, vals)], k)

    def apply(self) -> None:
        self.writer.apply(self.tabs)

    def mismatches(self) -> int:
        bad = 0
        for t, ref in zip(self.tabs, self.refs):
            got = t.tensor.cpu().numpy().reshape(ref.shape).astype(np.float64)
            bad += int(np.count_nonzero(got != ref))
        return bad


# -- parts ---------------------------------------------------------------------------------------------
def part_install(args) -> dict:
    try:
        version = importlib.metadata.version("multiwrite")
    except importlib.metadata.PackageNotFoundError:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."]
        log("multiwrite not installed; running", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log(proc.stdout[-2000:], proc.stderr[-2000:])
        if proc.returncode:
            raise RuntimeError("pip install -e . failed") from None
        importlib.invalidate_caches()
        version = importlib.metadata.version("multiwrite")
    import triton

    import multiwrite

    statuses = multiwrite.available_backends(args.device)
    info = {
        "multiwrite": version, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "cuda": torch.version.cuda, "hip": torch.version.hip,
        "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
        "driver": _driver_version(),
        "backends": {s.name: ("available" if s.available else s.reasons) for s in statuses},
    }  # fmt: skip
    for k, v in info.items():
        log(f"  {k}: {v}")
    if not any(s.name == "triton-cuda" and s.available for s in statuses):
        raise RuntimeError("triton-cuda is not available on this device")
    return info


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0]
    except Exception as exc:
        return f"unknown ({exc})"


def part_tests(args) -> dict:
    env = dict(os.environ, MULTIWRITE_BACKEND="triton-cuda")
    # No -x: one GPU run should show every failure, not only the first.
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-rs", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (OUT / "pytest.log").write_text(proc.stdout + "\n" + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    for line in tail:
        log("  " + line)
    if proc.returncode:
        raise RuntimeError(f"pytest exited {proc.returncode} (see pytest.log)")
    return {"seconds": round(time.perf_counter() - t0, 1), "summary": tail[-1] if tail else ""}


def part_race(args) -> dict:
    device = args.device
    backend = backend_instance(ring_depth=2)
    rng = np.random.default_rng(1234)
    bt = RandomBlockTables(device, backend, rng)
    ts = RandomTensors(device, backend, rng)
    n = 300 if args.quick else 10_000
    # Warm-up: compile and bind the launcher of every dtype (binding validates with one sync), then
    # nothing below synchronizes until the end.
    bt.stage_step()
    bt.bt.apply_staged_writes()
    for j, t in enumerate(ts.tabs):
        t.stage_write(0, 0, [1])
        ts.refs[j][0, 0 : ts.ks[j]] = [1 * ts.ks[j] + x if ts.ks[j] > 1 else 1 for x in range(ts.ks[j])]
    ts.apply()
    sync(device)
    t0 = time.perf_counter()
    busy(device, 0.5)
    for it in range(n):
        if it % 1000 == 999:
            busy(device, 0.05)  # fall behind again, so the host has to wait for slots
        bt.stage_step()
        bt.bt.apply_staged_writes()
        if it % 3 == 0:
            ts.stage_step()
            ts.apply()
    host_s = time.perf_counter() - t0
    sync(device)
    writer = backend.writer(device)
    bad_bt, bad_ts = bt.mismatches(), ts.mismatches()
    res = {
        "applies": n, "ring_depth": 2, "host_waits": writer.waits, "host_seconds": round(host_s, 2),
        "mismatches_block_tables": bad_bt, "mismatches_tensors": bad_ts, "launch_path": writer.launch_path,
    }  # fmt: skip
    log(f"  {res}")
    if bad_bt or bad_ts:
        raise AssertionError(f"race: {bad_bt} + {bad_ts} cells differ from the reference")
    if device.type == "cuda" and writer.waits == 0:
        raise AssertionError("race: the host never had to wait for a slot; the guard was not exercised")
    return res


def part_streams(args) -> dict:
    device = args.device
    if device.type != "cuda":
        log("  skipped on CPU")
        return {"skipped": "cpu"}
    from multiwrite import StagedWriteTensor

    backend = backend_instance(ring_depth=2)
    rng = np.random.default_rng(7)
    # 1. The launch goes to the current (non-default) stream: while that stream sleeps, the default
    #    stream sees nothing written; after it, everything.
    t = StagedWriteTensor((64, 128), torch.int32, device, name="t")
    from multiwrite import FusedStagedWriter

    writer = FusedStagedWriter(device, backend=backend)
    t.stage_write(0, 0, [1])
    writer.apply([t])  # first launch binds the fast path (one validation sync)
    sync(device)
    s = torch.cuda.Stream(device)
    ref = t.tensor.cpu().numpy().copy()
    with torch.cuda.stream(s):
        busy(device, 0.3)
        for row in range(64):
            vals = rng.integers(1, 1000, 5)
            t.stage_write(row, 3, vals)
            ref[row, 3:8] = vals
        writer.apply([t])
    early = t.tensor.cpu().numpy()  # default stream: must not wait for s
    s.synchronize()
    late = t.tensor.cpu().numpy()
    if np.array_equal(early, ref):
        raise AssertionError("the apply on a non-default stream ran before that stream's sleep ended")
    if not np.array_equal(late, ref):
        raise AssertionError("non-default stream: result differs from the reference")
    # 2. Two streams, two table sets, one backend (one ring of depth 2), alternating, no host sync.
    s2 = torch.cuda.Stream(device)
    sets = [RandomBlockTables(device, backend, rng), RandomBlockTables(device, backend, rng)]
    for it in range(2000 if not args.quick else 100):
        stream = (s, s2)[it % 2]
        with torch.cuda.stream(stream):
            if it % 500 == 0:
                busy(device, 0.02)
            rb = sets[it % 2]
            rb.stage_step()
            rb.bt.apply_staged_writes()
    s.synchronize()
    s2.synchronize()
    bad = sum(rb.mismatches() for rb in sets)
    res = {"non_default_stream": "ok", "two_streams_mismatches": bad, "host_waits": backend.writer(device).waits}
    log(f"  {res}")
    if bad:
        raise AssertionError(f"two streams: {bad} cells differ")
    return res


def part_realloc(args) -> dict:
    device = args.device
    from multiwrite import FusedStagedWriter, StagedWriteTensor

    backend = backend_instance(ring_depth=2)
    writer = FusedStagedWriter(device, backend=backend)
    rng = np.random.default_rng(11)
    out = {}

    def stage(t, ref, n=20, cols=None):
        rows, cols = ref.shape[0], cols or ref.shape[1]
        for _ in range(n):
            row, m = int(rng.integers(0, rows)), int(rng.integers(1, 5))
            start = int(rng.integers(0, cols - m + 1))
            vals = rng.integers(1, 1 << 30, m)
            t.stage_write(row, start, vals)
            ref[row, start : start + m] = vals

    # a) replaced through the setter, with writes staged before and after
    t = StagedWriteTensor((32, 64), torch.int32, device, name="a")
    ref = np.zeros((32, 64), np.int64)
    stage(t, ref)
    writer.apply([t])
    old = t.tensor
    old_snapshot = old.cpu().numpy().copy()
    new = old.clone()
    stage(t, ref)  # staged for the old tensor, applied to the new one
    t.tensor = new
    stage(t, ref)
    writer.apply([t])
    sync(device)
    ok_a = np.array_equal(new.cpu().numpy(), ref) and np.array_equal(old.cpu().numpy(), old_snapshot)
    out["setter"] = ok_a

    # b) resize_ in place to more columns (reallocates); a canary allocated right after may reuse the freed block
    t = StagedWriteTensor((32, 64), torch.int32, device, name="b")
    ref = np.zeros((32, 64), np.int64)
    stage(t, ref)
    writer.apply([t])
    sync(device)
    ptr_before = t.tensor.data_ptr()
    t.tensor.resize_(32, 96)
    t.tensor.zero_()
    canary = torch.full((32, 64), -7, dtype=torch.int32, device=device)
    ref = np.zeros((32, 96), np.int64)
    stage(t, ref, cols=64)  # staging still checks the old width; the new row stride (96) must be used
    writer.apply([t])
    sync(device)
    ok_b = np.array_equal(t.tensor.cpu().numpy(), ref) and bool((canary == -7).all())
    out["resize_"] = ok_b
    out["resize_reallocated"] = t.tensor.data_ptr() != ptr_before

    # c) set_ to another storage (same shape, so only the pointer changes), then back
    t = StagedWriteTensor((32, 64), torch.int32, device, name="c")
    ref = np.zeros((32, 64), np.int64)
    stage(t, ref)
    writer.apply([t])
    old_alias = t.tensor.view(32, 64)  # keeps the old storage alive and visible
    old_snapshot = old_alias.cpu().numpy().copy()
    other = t.tensor.clone()
    t.tensor.set_(other)
    stage(t, ref)
    writer.apply([t])
    sync(device)
    ok_c = np.array_equal(t.tensor.cpu().numpy(), ref) and np.array_equal(old_alias.cpu().numpy(), old_snapshot)
    out["set_"] = ok_c

    # d) BlockTables: one group's table replaced mid-run through the setter
    rb = RandomBlockTables(device, backend, rng)
    for _ in range(50):
        rb.stage_step()
        rb.bt.apply_staged_writes()
    sync(device)
    old = rb.bt[1].tensor
    rb.bt[1].tensor = old.clone()
    old_snapshot = old.cpu().numpy().copy()
    for _ in range(50):
        rb.stage_step()
        rb.bt.apply_staged_writes()
    sync(device)
    out["block_tables_setter"] = rb.mismatches() == 0 and np.array_equal(old.cpu().numpy(), old_snapshot)
    log(f"  {out}")
    failed = [k for k, v in out.items() if v is False]
    if failed:
        raise AssertionError(f"reallocated tables: {failed} failed")
    return out


def part_replay(args) -> dict:
    res = {}
    device = "cuda" if args.device.type == "cuda" else "cpu"
    for name, bs, kbs in (("G1", "16", "16"), ("G3", "16,32,8", "16,16,8")):
        for c in (40, 256):
            cmd = [sys.executable, "-m", "multiwrite.cli", "replay", "--device", device, "--no-progress",
                   "--backend", "triton-cuda", "--block-sizes", bs, "--kernel-block-sizes", kbs,
                   "--concurrency", str(c)]  # fmt: skip
            if args.quick:
                cmd += ["--steps", "30"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            text = (proc.stdout + proc.stderr).strip()
            log(f"  {name} C={c}: rc={proc.returncode}: " + " | ".join(text.splitlines()[-4:]))
            res[f"{name}-C{c}"] = {"rc": proc.returncode, "out": text[-1500:]}
            if proc.returncode:
                raise AssertionError(f"replay {name} C={c} exited {proc.returncode}")
    return res


def _median_us(fn: Callable[[], object], n: int, device, sync_every: int = 50, setup=None) -> float:
    times = []
    clock = time.perf_counter
    for i in range(n):
        if setup is not None:
            setup()
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if i % sync_every == sync_every - 1:
            sync(device)
    sync(device)
    return statistics.median(times) * 1e6


def part_timing(args) -> dict:
    device = args.device
    from multiwrite.bench_triton import empty_kernel
    from multiwrite.block_tables import BlockTables
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    res: dict = {}
    dummy = torch.zeros(1, device=device)
    for _ in range(20):
        empty_kernel[(1,)](dummy)
    n = 200 if args.quick else 3000
    empty_us = _median_us(lambda: empty_kernel[(1,)](dummy), n, device)
    res["empty_launch_us"] = empty_us
    log(f"  empty Triton launch (JIT path, tensor arg): {empty_us:.2f} us host")

    trace = load_trace()
    configs = {"G1": ([16], None), "G2": ([16, 16], None), "G3": ([16, 32, 8], [16, 16, 8]), "G4": ([16] * 4, None)}
    variants = [("auto", "kernel"), ("run", "kernel"), ("jit", "kernel"), ("auto", "event")]
    steps = 25 if args.quick else 400
    warm = 5 if args.quick else 50
    rows = []
    for launcher, guard in variants:
        for c in (40, 256):
            for name, (bs, kbs) in configs.items():
                if (launcher, guard) != ("auto", "kernel") and name in ("G2", "G4"):
                    continue  # the other variants on G1 and G3 only, to keep the run short
                backend = backend_instance(launcher=launcher, guard=guard)
                bt = BlockTables(bs, c, max_blocks_per_group(bs), device, kbs, backend=backend)
                step_us, apply_us = [], []
                for i, calls in enumerate(replay_steps(trace, bs, c, steps)):
                    t0 = time.perf_counter()
                    for req, ids, ow in calls:
                        bt.append_block_ids(req, ids, ow)
                    t1 = time.perf_counter()
                    bt.apply_staged_writes()
                    t2 = time.perf_counter()
                    sync(device)
                    if i >= warm and calls:
                        step_us.append((t2 - t0) * 1e6)
                        apply_us.append((t2 - t1) * 1e6)
                row = {
                    "launcher": launcher, "guard": guard, "C": c, "groups": name,
                    "apply_us": statistics.median(apply_us), "step_us": statistics.median(step_us),
                    "launch_path": backend.writer(device).launch_path,
                }  # fmt: skip
                row["apply_x_empty"] = row["apply_us"] / empty_us
                row["step_x_empty"] = row["step_us"] / empty_us
                rows.append(row)
                log(f"  {launcher:4s} {guard:6s} C={c:3d} {name}: apply {row['apply_us']:.2f} us "
                    f"({row['apply_x_empty']:.2f}x), step {row['step_us']:.2f} us "
                    f"({row['step_x_empty']:.2f}x)")  # fmt: skip
    res["trace"] = rows
    res["backend_only"] = _backend_only(device, n)
    res["device"] = _device_times(device, args)
    return res


def _capture_batch(device, c: int, bs, kbs):
    """A decode-like WriteBatch from a steady-state trace step, and the writer that applies it."""
    from multiwrite.block_tables import BlockTables
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    backend = backend_instance()
    bt = BlockTables(bs, c, max_blocks_per_group(bs), device, kbs, backend=backend)
    captured = []
    writer = backend.writer(bt.device)
    real_apply = writer.apply
    writer.apply = lambda batches: (captured.append(list(batches)), real_apply(batches))
    for calls in replay_steps(load_trace(), bs, c, 120):
        for req, ids, ow in calls:
            bt.append_block_ids(req, ids, ow)
        bt.apply_staged_writes()
    writer.apply = real_apply
    sync(device)
    recent = sorted(captured[-50:], key=lambda batches: batches[0].num_writes)
    decode = recent[len(recent) // 2]  # the median step of the last 50: decode-dominated
    return writer, [_own_batch(b) for b in decode]


def _own_batch(b):
    from multiwrite.backend import WriteBatch

    return WriteBatch(b.tables, b.meta.copy(), b.values.copy(), b.may_overlap, b.values_in_order)


def _backend_only(device, n: int) -> dict:
    """Host time of TritonWriter.apply alone (no staging, no FusedStagedWriter), one decode batch."""
    out = {}
    for c, bs, kbs in ((40, [16, 32, 8], [16, 16, 8]), (256, [16, 32, 8], [16, 16, 8])):
        writer, batches = _capture_batch(device, c, bs, kbs)
        us = _median_us(lambda w=writer, b=batches: w.apply(b), n, device)
        out[f"G3-C{c}"] = {"us": us, "writes": batches[0].num_writes, "values": int(batches[0].values.shape[0])}
        log(f"  TritonWriter.apply alone, G3 C={c} ({batches[0].num_writes} writes): {us:.2f} us")
    return out


def _device_times(device, args) -> dict:
    """Device time per apply, launch overhead excluded: events around work queued behind a sleep."""
    if device.type != "cuda":
        return {"skipped": "cpu"}
    from multiwrite.bench_triton import empty_kernel

    out = {}
    reps = 20 if args.quick else 200

    def timed(fn, ahead_s: float = 100e-6) -> float:
        """Median device time of `fn`'s GPU work; `ahead_s` must exceed `fn`'s host time."""
        ts = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            busy(device, ahead_s)  # so the work below is queued before the start event runs
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) * 1000.0)
        return statistics.median(ts)

    dummy = torch.zeros(1, device=device)
    out["empty_kernel_us"] = timed(lambda: empty_kernel[(1,)](dummy))
    for c in (40, 256):
        writer, batches = _capture_batch(device, c, [16, 32, 8], [16, 16, 8])
        out[f"decode_G3_C{c}_us"] = timed(lambda w=writer, b=batches: w.apply(b))
    # Prefill burst: 256 requests x 3 groups x 1024 ids, overwrite, one apply; vs a pinned H2D copy.
    from multiwrite import BlockTables

    bt = BlockTables([16, 16, 16], 256, [1100] * 3, device, backend=backend_instance())
    ids = np.arange(1, 1025, dtype=np.int32)

    def burst():
        for r in range(256):
            bt.append_block_ids(r, [ids, ids, ids], True)
        bt.apply_staged_writes()

    burst()
    sync(device)
    nbytes = 256 * 3 * 1024 * 4
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    burst_writer = bt.backend.writer(bt.device)
    captured = []
    real = burst_writer.apply
    burst_writer.apply = lambda b: captured.append([_own_batch(x) for x in b])
    for r in range(256):
        bt.append_block_ids(r, [ids, ids, ids], True)
    bt.apply_staged_writes()
    burst_writer.apply = real
    burst_batches = captured[0]
    out["burst_apply_us"] = timed(lambda: burst_writer.apply(burst_batches), 20e-3)  # 3 MB host memcpy first
    out["burst_h2d_copy_us"] = timed(lambda: dst.copy_(src, non_blocking=True), 1e-3)
    out["burst_bytes"] = nbytes
    out["burst_vs_copy_bandwidth"] = out["burst_h2d_copy_us"] / out["burst_apply_us"]
    for k, v in out.items():
        log(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    return out


PARTS = {
    "install": part_install, "tests": part_tests, "race": part_race, "streams": part_streams,
    "realloc": part_realloc, "replay": part_replay, "timing": part_timing,
}  # fmt: skip


def main(argv=None) -> int:
    global _log_file
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (interpreter smoke test)")
    ap.add_argument("--quick", action="store_true", help="small iteration counts (smoke test)")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    OUT.mkdir(parents=True, exist_ok=True)
    _log_file = open(OUT / "gpu_check.log", "a")
    log(f"== gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')} device={args.device} parts={args.parts}")
    failures = []
    for name in args.parts.split(","):
        log(f"-- {name}")
        t0 = time.perf_counter()
        try:
            result = PARTS[name](args)
            RESULTS["parts"][name] = {"ok": True, "result": result}
            log(f"   {name}: PASS ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:
            failures.append(name)
            RESULTS["parts"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            log(traceback.format_exc())
            log(f"   {name}: FAIL ({type(exc).__name__}: {exc})")
            if name == "install":
                break
        with contextlib.suppress(Exception):
            (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    _summary()
    log(f"== {'FAILED: ' + ', '.join(failures) if failures else 'all parts passed'}")
    return 1 if failures else 0


def _summary() -> None:
    parts = RESULTS["parts"]
    log("\n== summary")
    for name, p in parts.items():
        log(f"  {name:8s} {'PASS' if p['ok'] else 'FAIL: ' + p['error']}")
    timing = parts.get("timing", {}).get("result")
    if not timing:
        return
    log(f"\n  empty Triton launch: {timing['empty_launch_us']:.2f} us host")
    head = ("launcher", "guard", "C", "grp", "apply us", "x empty", "step us", "x empty")
    log("  {:9s} {:6s} {:>4s} {:3s} {:>9s} {:>8s} {:>8s} {:>8s}".format(*head))
    for r in timing["trace"]:
        log(f"  {r['launcher']:9s} {r['guard']:6s} {r['C']:4d} {r['groups']:3s} {r['apply_us']:9.2f} "
            f"{r['apply_x_empty']:8.2f} {r['step_us']:8.2f} {r['step_x_empty']:8.2f}")  # fmt: skip
    if timing["trace"]:
        log(f"  launch path: {timing['trace'][0]['launch_path']}")
    for k, v in timing.get("backend_only", {}).items():
        log(f"  TritonWriter.apply alone {k}: {v['us']:.2f} us")
    for k, v in timing.get("device", {}).items():
        log(f"  device {k}: {v:.3f}" if isinstance(v, float) else f"  device {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
