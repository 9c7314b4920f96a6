"""GPU timing run for `triton-cuda`: host and device times of the fused apply, and Nsight Compute.

Not a test: it measures and reports, it does not pass or fail on speed. The correctness checks it once
ran (the test matrix, race, streams, reallocation, replay) are pytest tests now: `pytest tests/gpu` (or
`tox -e cuda` for everything with triton-cuda forced).

Run from the repository root on the GPU machine (no network needed)::

    OUT=/some/dir python scripts/gpu_check.py            # everything, logs under $OUT
    python scripts/gpu_check.py --parts timing            # a subset
    TRITON_INTERPRET=1 python scripts/gpu_check.py --device cpu --quick   # smoke-test this script on CPU

Parts (each in its own try/except; the exit status is non-zero if any fails):
  install  multiwrite must be installed (entry points); if not, `pip install --no-deps -e .` is tried.
  timing   host times on the trace for G1-G4 at C=40/256 (the launcher/guard variants on G1 and G3): in
           each step every variant, in turn, stages, applies, synchronizes, then launches the empty Triton
           kernel and synchronizes, so "x empty" is the ratio of medians of apply (or step) and the
           empty launch measured in the same loop; then the tight-loop pair (empty launch vs
           `TritonWriter.apply` of a captured decode batch, synchronizing every 50 calls); then device
           times from CUDA events around work queued behind a short sleep (decode, prefill burst vs a
           pinned H2D copy).
  ncu      Nsight Compute (`ncu`, skipped when absent or with --device cpu) profiles scripts/ncu_target.py:
           gpu__time_duration.sum of our kernel per apply (G3 decode at C=40 and 256, prefill burst)
           and of the empty kernel, 20 applies each between cudaProfilerStart/Stop, --clock-control
           none: the kernel time on the device, launch overhead excluded (log: ncu.log).

Writes `$OUT/gpu_check.log`, `$OUT/results.json`, `$OUT/ncu.log` (OUT defaults to ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ncu_target.py, the capture helpers, sits beside us

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


#: (launcher, guard) variants of the trace loop; the non-default ones run on G1 and G3 only.
TIMING_VARIANTS = (("auto", "kernel"), ("run", "kernel"), ("jit", "kernel"), ("auto", "event"))


def part_timing(args) -> dict:
    """Host times in the trace loop (apply and empty launch side by side), the tight-loop pair, and
    device times from CUDA events behind a sleep."""
    device = args.device
    from multiwrite.bench_triton import empty_kernel

    dummy = torch.zeros(1, device=device)
    for _ in range(20):
        empty_kernel[(1,)](dummy)  # compile (and warm) outside every timed region
    sync(device)
    res: dict = {}
    res["trace"] = _trace_loop(device, args, lambda: empty_kernel[(1,)](dummy))
    res["tight_loop"] = _tight_loop(device, args, lambda: empty_kernel[(1,)](dummy))
    res["device"] = _device_times(device, args)
    bad = [f"{r['launcher']}/{r['guard']} C={r['C']} {r['groups']}" for r in res["trace"] if r["mismatches"]]
    if bad:
        raise AssertionError(f"trace loop: tables differ from the reference for {', '.join(bad)}")
    return res


def _trace_loop(device, args, empty_launch: Callable[[], object]) -> list[dict]:
    """Per configuration, every variant replays the same trace steps, taking turns within each step in
    an order that rotates from step to step (drift reaches them alike; the garbage collector is off).
    One turn: stage, apply, synchronize, then one empty Triton launch (JIT path, as `floor-triton` of
    the bench), synchronize. So the empty launch of a row is measured in the same loop, under the same
    conditions as its apply, and the ratios are ratios of medians over the same steps. At the end each
    variant's tables are checked against the reference."""
    from multiwrite.block_tables import BlockTables
    from multiwrite.reference import ReferenceBlockTables
    from multiwrite.replay import count_mismatches
    from multiwrite.workload import CONFIGS, load_trace, max_blocks_per_group, replay_steps

    trace = load_trace()
    steps = 25 if args.quick else 1000
    warm = 5 if args.quick else 100
    clock = time.perf_counter_ns
    rows = []
    for c in (40, 256):
        for name, (bs, kbs) in CONFIGS.items():
            variants = TIMING_VARIANTS if name in ("G1", "G3") else TIMING_VARIANTS[:1]
            schedule = list(replay_steps(trace, bs, c, steps))
            runners = []
            for launcher, guard in variants:
                backend = backend_instance(launcher=launcher, guard=guard)
                bt = BlockTables(bs, c, max_blocks_per_group(bs), device, kbs, backend=backend)
                runners.append(SimpleNamespace(launcher=launcher, guard=guard, backend=backend, bt=bt,
                                               step=[], apply=[], empty=[]))  # fmt: skip
            orders = [runners[k:] + runners[:k] for k in range(len(runners))]
            gc.collect()
            gc.disable()
            try:
                for i, calls in enumerate(schedule):
                    measured = i >= warm and bool(calls)
                    for r in orders[i % len(orders)]:
                        bt = r.bt
                        t0 = clock()
                        for req, ids, ow in calls:
                            bt.append_block_ids(req, ids, ow)
                        t1 = clock()
                        bt.apply_staged_writes()
                        t2 = clock()
                        sync(device)
                        t3 = clock()
                        empty_launch()
                        t4 = clock()
                        sync(device)
                        if measured:
                            r.step.append((t2 - t0) / 1e3)
                            r.apply.append((t2 - t1) / 1e3)
                            r.empty.append((t4 - t3) / 1e3)
            finally:
                gc.enable()
            ref = ReferenceBlockTables(bs, c, max_blocks_per_group(bs), kbs)
            for calls in schedule:
                for req, ids, ow in calls:
                    ref.append_block_ids(req, ids, ow)
            for r in runners:
                apply_us, step_us, empty_us = (statistics.median(x) for x in (r.apply, r.step, r.empty))
                row = {
                    "launcher": r.launcher, "guard": r.guard, "C": c, "groups": name, "steps": len(r.apply),
                    "apply_us": apply_us, "empty_us": empty_us, "step_us": step_us,
                    "apply_x_empty": apply_us / empty_us, "step_x_empty": step_us / empty_us,
                    "apply_p99_us": float(np.percentile(r.apply, 99)),
                    "empty_p99_us": float(np.percentile(r.empty, 99)),
                    "launch_path": r.backend.writer(r.bt.block_tables[0].device).launch_path,
                    "host_waits": r.backend.writer(r.bt.block_tables[0].device).waits,
                    "mismatches": count_mismatches(r.bt, ref),
                }  # fmt: skip
                rows.append(row)
                log(f"  {r.launcher:4s} {r.guard:6s} C={c:3d} {name}: apply {apply_us:6.2f} us, empty {empty_us:6.2f} "
                    f"us (same loop) = {row['apply_x_empty']:.2f}x; step {step_us:6.2f} us = "
                    f"{row['step_x_empty']:.2f}x; {row['steps']} steps"
                    + (f"; {row['mismatches']} MISMATCHES" if row["mismatches"] else ""))  # fmt: skip
    return rows


def _tight_loop(device, args, empty_launch: Callable[[], object]) -> dict:
    """The tight-loop pair (synchronize every 50 calls, no staging): per G3 decode batch captured from
    the trace, the empty launch and then `TritonWriter.apply` of that batch alone, back to back."""
    from ncu_target import capture_decode, describe

    n = 200 if args.quick else 3000
    out = {}
    for c in (40, 256):
        writer, batches = capture_decode(device, c)
        for _ in range(10):  # first apply compiles and binds the launcher; then every ring slot is used once
            writer.apply(batches)
        sync(device)
        waits0 = writer.waits
        empty_us = _median_us(empty_launch, n, device)
        apply_us = _median_us(lambda w=writer, b=batches: w.apply(b), n, device)
        row = {"empty_us": empty_us, "apply_us": apply_us, "apply_x_empty": apply_us / empty_us,
               "host_waits": writer.waits - waits0, "launch_path": writer.launch_path, **describe(batches)}  # fmt: skip
        out[f"G3-C{c}"] = row
        log(f"  tight loop, G3 C={c} decode batch ({row['writes']} writes, {row['values']} values): "
            f"TritonWriter.apply alone {apply_us:.2f} us, empty launch {empty_us:.2f} us = {row['apply_x_empty']:.2f}x"
            f" (slot waits {row['host_waits']})")  # fmt: skip
    return out


def _device_times(device, args) -> dict:
    """Device time per apply, launch overhead excluded: events around work queued behind a sleep."""
    if device.type != "cuda":
        log("  device times (CUDA events): skipped on CPU")
        return {"skipped": "cpu"}
    from ncu_target import capture_burst, capture_decode

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

    def warm(writer, batches) -> None:
        for _ in range(10):  # compile, bind, and grow every ring slot outside the timed region
            writer.apply(batches)
        sync(device)

    dummy = torch.zeros(1, device=device)
    out["empty_kernel_us"] = timed(lambda: empty_kernel[(1,)](dummy))
    for c in (40, 256):
        writer, batches = capture_decode(device, c)
        warm(writer, batches)
        out[f"decode_G3_C{c}_us"] = timed(lambda w=writer, b=batches: w.apply(b))
    # Prefill burst (the bench's: G3, 256 requests x 3 groups x 1024 ids, overwrites), one apply; vs a
    # pinned H2D copy of the same bytes.
    writer, batches, nbytes = capture_burst(device)
    warm(writer, batches)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out["burst_apply_us"] = timed(lambda: writer.apply(batches), 20e-3)  # a 4 MB host memcpy comes first
    out["burst_h2d_copy_us"] = timed(lambda: dst.copy_(src, non_blocking=True), 1e-3)
    out["burst_bytes"] = nbytes
    out["burst_vs_copy_bandwidth"] = out["burst_h2d_copy_us"] / out["burst_apply_us"]
    for k, v in out.items():
        log(f"  device (CUDA events behind a sleep) {k}: {v:.3f}" if isinstance(v, float) else f"  device {k}: {v}")
    return out


# -- ncu -------------------------------------------------------------------------------------------
#: Kernels ncu profiles: ours (`_write_kernel_fn` in backends/triton_kernel.py) and the bench's empty one.
NCU_KERNEL_REGEX = "write_kernel|empty_kernel"
NCU_TIMEOUT_S = 150
_UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "nsec": 1e-3, "us": 1.0, "usecond": 1.0, "usec": 1.0, "\u00b5s": 1.0,
            "ms": 1e3, "msecond": 1e3, "msec": 1e3, "s": 1e6, "second": 1e6, "sec": 1e6}  # fmt: skip


def parse_ncu_csv(text: str, metric: str = "gpu__time_duration.sum") -> list[dict]:
    """Per profiled kernel, in launch order: {"id", "name", "grid", "block", "us"} from `ncu --csv` output
    (the "details" layout, one row per metric, or the "raw" layout, one column per metric and a units
    row). Lines that are not CSV (==PROF== lines, the target's own output) are ignored.

    Raises:
        ValueError: no header, no rows for `metric`, or a unit or value it cannot read.
    """
    import csv

    lines = [ln for ln in text.splitlines() if ln.lstrip().startswith('"')]
    rows = list(csv.reader(lines))
    head_at = next((i for i, r in enumerate(rows) if "ID" in r and "Kernel Name" in r), None)
    if head_at is None:
        raise ValueError("no CSV header with 'ID' and 'Kernel Name' in ncu's output")
    head = rows[head_at]
    col = {name: i for i, name in enumerate(head)}
    body = [r for r in rows[head_at + 1 :] if len(r) == len(head) and r != head]

    def us(value: str, unit: str) -> float:
        factor = _UNIT_US.get(unit.strip())
        if factor is None:
            raise ValueError(f"unknown unit {unit!r} for {metric}")
        try:
            return float(value.replace(",", "").strip()) * factor
        except ValueError:
            raise ValueError(f"unreadable value {value!r} for {metric}") from None

    kernels: dict[int, dict] = {}
    if "Metric Name" in col and "Metric Value" in col:  # details layout
        unit_col = col.get("Metric Unit")
        for r in body:
            if r[col["Metric Name"]] != metric:
                continue
            kid = int(r[col["ID"]])
            unit = r[unit_col] if unit_col is not None else "ns"
            kernels[kid] = _kernel_row(r, col, kid, us(r[col["Metric Value"]], unit))
    elif metric in col:  # raw layout: the first row after the header holds units (empty ID)
        units = next((r for r in body if not r[col["ID"]].strip()), None)
        unit = units[col[metric]] if units is not None else "ns"
        for r in body:
            if r[col["ID"]].strip():
                kid = int(r[col["ID"]])
                kernels[kid] = _kernel_row(r, col, kid, us(r[col[metric]], unit))
    else:
        raise ValueError(f"CSV header has neither 'Metric Name' nor a {metric!r} column: {head}")
    if not kernels:
        raise ValueError(f"ncu's CSV has no {metric} rows (no kernel matched, or profiling failed)")
    return [kernels[k] for k in sorted(kernels)]


def _kernel_row(r: list[str], col: dict, kid: int, us: float) -> dict:
    def get(name: str) -> str:
        return r[col[name]] if name in col else ""

    return {"id": kid, "name": get("Kernel Name"), "grid": get("Grid Size"), "block": get("Block Size"), "us": us}


def assign_ncu_rows(kernels: list[dict], manifest: dict) -> dict:
    """Map ncu's kernels (launch order) onto the target's manifest; the measured launches are the last
    ones. Per label: median/min/max device time per apply (a multi-batch apply sums its launches).

    Raises:
        ValueError: fewer kernels than the manifest lists, or a kernel name where another was expected.
    """
    seq = manifest["sequence"]
    total = sum(s["launches"] for s in seq)
    if len(kernels) < total:
        raise ValueError(f"ncu reported {len(kernels)} kernels matching {NCU_KERNEL_REGEX!r}; the target made {total}")
    extra = len(kernels) - total
    kernels = kernels[extra:]
    out: dict = {"extra_kernels_before_range": extra}
    k = 0
    for s in seq:
        chunk = kernels[k : k + s["launches"]]
        k += s["launches"]
        names = sorted({x["name"] for x in chunk})
        empty = s["kernel"] == "empty"
        if any(("empty_kernel" in x["name"]) != empty for x in chunk):
            raise ValueError(f"{s['label']}: expected {'the empty kernel' if empty else 'our kernel'}, got {names}")
        per = max(1, s["per_apply"])
        applies = [sum(x["us"] for x in chunk[j : j + per]) for j in range(0, len(chunk), per)]
        info = {key: v for key, v in s.items() if key not in ("label", "kernel")}
        info.update({
            "median_us": statistics.median(applies), "min_us": min(applies), "max_us": max(applies),
            "applies": len(applies), "kernel_names": names, "grids": sorted({x["grid"] for x in chunk}),
            "blocks": sorted({x["block"] for x in chunk}),
        })  # fmt: skip
        out[s["label"]] = info
    return out


def _head(out: str, err: str, n: int = 12) -> str:
    """ncu's own messages (==PROF==, ==WARNING==, ==ERROR== lines), then the first lines of stdout and stderr."""
    prof = [ln for ln in (out + "\n" + err).splitlines() if ln.startswith("==")][:n]
    parts = [("ncu messages", prof), ("stdout", out.strip().splitlines()[:n]), ("stderr", err.strip().splitlines()[:n])]
    return "\n".join(f"    [{name}] {ln}" for name, lines in parts for ln in lines)


def part_ncu(args) -> dict:
    """Device time per kernel from Nsight Compute (`gpu__time_duration.sum`), launch overhead excluded."""
    target = Path(__file__).resolve().with_name("ncu_target.py")
    ncu = args.ncu or shutil.which("ncu")
    reps = 5 if args.quick else 20
    if args.device.type != "cuda" or not ncu:
        reason = "--device cpu" if args.device.type != "cuda" else "ncu is not on PATH (pass --ncu PATH)"
        log(f"  SKIPPED: {reason}: no kernel device times from Nsight Compute")
        res: dict = {"skipped": reason}
        if args.device.type == "cpu":  # still smoke-test the target program, without a profiler
            with tempfile.TemporaryDirectory() as tmp:
                manifest = Path(tmp) / "manifest.json"
                cmd = [sys.executable, str(target), "--device", "cpu", "--reps", "2", "--warmup", "1",
                       "--burst-requests", "8", "--burst-ids", "16", "--manifest", str(manifest)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if proc.returncode:
                    raise RuntimeError(f"ncu_target.py on CPU exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
                seq = json.loads(manifest.read_text())["sequence"]
                res["target_smoke"] = [(s["label"], s["launches"]) for s in seq]
                log(f"  ncu_target.py smoke test on CPU (no profiler): {res['target_smoke']}")
        return res
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
    log(f"  {ncu}: {' '.join(version.stdout.split()[-3:])}")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "manifest.json"
        cmd = [ncu, "--clock-control", "none", "--cache-control", args.ncu_cache_control,
               "--metrics", "gpu__time_duration.sum", "--csv",
               "--kernel-name", f"regex:{NCU_KERNEL_REGEX}", "--profile-from-start", "off",
               sys.executable, str(target), "--device", str(args.device), "--reps", str(reps),
               "--manifest", str(manifest)]  # fmt: skip
        log("  " + shlex.join(cmd))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=NCU_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # ncu and the target it started (its own session)
            out, err = proc.communicate()
        seconds = time.perf_counter() - t0
        log_text = f"$ {shlex.join(cmd)}\n== stdout\n{out[-2_000_000:]}\n== stderr\n{err[-200_000:]}\n"
        (OUT / "ncu.log").write_text(log_text)
        head = _head(out, err)
        if timed_out or proc.returncode:
            why = f"timed out after {NCU_TIMEOUT_S} s" if timed_out else f"exited {proc.returncode}"
            log(f"  ncu {why}; first lines of its output:\n{head}")
            raise RuntimeError(f"ncu {why} (see ncu.log)")
        try:
            man = json.loads(manifest.read_text())
            kernels = parse_ncu_csv(out)
            res = assign_ncu_rows(kernels, man)
        except (OSError, ValueError, KeyError) as exc:
            log(f"  cannot read ncu's results ({type(exc).__name__}: {exc}); first lines of its output:\n{head}")
            raise RuntimeError(f"ncu output not understood: {exc} (see ncu.log)") from None
    res["seconds"] = round(seconds, 1)
    res["command"] = shlex.join(cmd)
    res["cache_control"] = (
        "all (ncu default: caches flushed before each kernel)"
        if args.ncu_cache_control == "all"
        else "none (caches kept warm between kernels, as in a serving loop)"
    )
    log(f"  cache control: {res['cache_control']}")
    for label, v in res.items():
        if isinstance(v, dict):
            extra = f", {v['writes']} writes, {v['values']} values" if "writes" in v else ""
            log(f"  ncu {label}: median {v['median_us']:.2f} us (min {v['min_us']:.2f}, max {v['max_us']:.2f}) over "
                f"{v['applies']} applies; grid {','.join(v['grids'])}{extra}")  # fmt: skip
    if res["extra_kernels_before_range"]:
        log(f"  note: {res['extra_kernels_before_range']} kernels before the profiled range were reported too "
            "(--profile-from-start off ignored?); the last ones were used")  # fmt: skip
    for label in ("decode-G3-C40", "decode-G3-C256"):
        us = res[label]["median_us"]
        log(f"  goal: kernel device time of a decode step <= 5 us: {label} {us:.2f} us: "
            + ("met" if us <= 5.0 else f"missed by {us / 5.0:.2f}x"))  # fmt: skip
    return res


PARTS = {"install": part_install, "timing": part_timing, "ncu": part_ncu}


def main(argv=None) -> int:
    global _log_file
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (interpreter smoke test)")
    ap.add_argument("--quick", action="store_true", help="small iteration counts (smoke test)")
    ap.add_argument("--ncu", default=None, help="path of Nsight Compute's ncu (default: ncu on PATH)")
    ap.add_argument(
        "--ncu-cache-control", default="all", choices=["all", "none"],
        help="ncu --cache-control: all (flush caches before each kernel, the default) or none (warm caches)",
    )  # fmt: skip
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
        skipped = p["ok"] and isinstance(p.get("result"), dict) and p["result"].get("skipped")
        log(f"  {name:8s} " + (f"SKIPPED ({skipped})" if skipped else "PASS" if p["ok"] else "FAIL: " + p["error"]))
    timing = parts.get("timing", {}).get("result")
    if timing:
        log("\n  host time per apply, trace loop: each step stages, applies, synchronizes, then launches the empty")
        log("  Triton kernel (JIT path) and synchronizes; medians over the same steps; x = ratio of medians")
        head = ("launcher", "guard", "C", "grp", "apply us", "empty us", "apply x", "step us", "step x")
        log("  {:9s} {:6s} {:>4s} {:3s} {:>9s} {:>9s} {:>8s} {:>8s} {:>8s}".format(*head))
        for r in timing["trace"]:
            log(f"  {r['launcher']:9s} {r['guard']:6s} {r['C']:4d} {r['groups']:3s} {r['apply_us']:9.2f} "
                f"{r['empty_us']:9.2f} {r['apply_x_empty']:8.2f} {r['step_us']:8.2f} "
                f"{r['step_x_empty']:8.2f}")  # fmt: skip
        if timing["trace"]:
            log(f"  launch path: {timing['trace'][0]['launch_path']}")
        log("  tight loop (synchronize every 50 calls, no staging), G3 decode batch from the trace:")
        for k, v in timing.get("tight_loop", {}).items():
            log(f"    {k}: TritonWriter.apply alone {v['apply_us']:.2f} us, empty launch {v['empty_us']:.2f} us, "
                f"{v['apply_x_empty']:.2f}x")  # fmt: skip
        for k, v in timing.get("device", {}).items():
            log(f"  device (CUDA events behind a sleep) {k}: {v:.3f}" if isinstance(v, float) else f"  device {k}: {v}")
    ncu = parts.get("ncu", {}).get("result")
    if ncu and not ncu.get("skipped"):
        log("  device time per kernel from ncu (gpu__time_duration.sum, --clock-control none):")
        for k, v in ncu.items():
            if isinstance(v, dict):
                log(f"    {k}: median {v['median_us']:.2f} us (min {v['min_us']:.2f}) over {v['applies']} applies")


if __name__ == "__main__":
    sys.exit(main())
