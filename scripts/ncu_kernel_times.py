"""Kernel device time under Nsight Compute: a script, not a test or a bench, since `ncu` must start Python itself.

Run from the repository root on a GPU machine with Nsight Compute::

    python scripts/ncu_kernel_times.py [--ncu PATH] [--cache-control all|none] [--reps 20] [--out ncu.log]

It starts `ncu --profile-from-start off ... python scripts/ncu_kernel_times.py --target`, which captures G3
decode applies at C=40 and C=256 and a prefill burst (`multiwrite.bench.captured`: the `WriteBatch`es a
`BlockTables` hands its backend), warms them up (compiles, binds the fast launchers), then, between
`cudaProfilerStart` and `cudaProfilerStop`, applies each `--reps` times through a fresh `triton-cuda` backend
(`Backend.apply`: one launch of the apply kernel per batch, the batch copied into the backend's shared staging
ring) and launches the empty Triton kernel `--reps` times, each followed by a synchronize, and writes a
manifest of those launches. ncu's `gpu__time_duration.sum` (`--clock-control none`) of each launch is mapped onto
the manifest (in launch order): device time per apply, launch overhead excluded. `--cache-control all`
(ncu's default) flushes caches before each kernel; `none` keeps them warm. With `--target --device cpu`
(and TRITON_INTERPRET=1) the target runs its sequence without a profiler (a smoke test).
Exit codes: 0 measured, 1 ncu failed or its output was not understood, 2 no ncu or no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from multiwrite.bench.captured import capture_burst, capture_decode, describe, launches_per_apply
from multiwrite.environment import synchronize

#: Configurations measured: (label, concurrency); all G3.
DECODE_CONFIGS = (("decode-G3-C40", 40), ("decode-G3-C256", 256))


def log(*args) -> None:
    print(" ".join(str(a) for a in args), flush=True)


def target(args: argparse.Namespace) -> int:
    """The profiled program: the launch sequence of the module docstring; writes `args.manifest`."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from multiwrite.bench.floor_kernel import empty_kernel

    configs = []
    for label, c in DECODE_CONFIGS:
        backend, batches = capture_decode(device, c)
        configs.append((label, backend, batches))
    backend, batches, nbytes = capture_burst(device, args.burst_requests, args.burst_ids)
    configs.append(("burst-G3", backend, batches))
    dummy = torch.zeros(1, device=device)
    # Warm-up, outside the profiled range: compiles, binds and validates the fast launchers.
    for _ in range(args.warmup):
        for _label, backend, batches in configs:
            backend.apply(batches)
            synchronize(device)
        empty_kernel[(1,)](dummy)
        synchronize(device)
    sequence = []
    profiling = device.type == "cuda"
    if profiling:
        torch.cuda.profiler.start()
    try:
        for label, backend, batches in configs:
            for _ in range(args.reps):
                backend.apply(batches)
                synchronize(device)
            per_apply = launches_per_apply(batches)
            info = {"label": label, "kernel": "write", "launches": args.reps * per_apply, "per_apply": per_apply}
            info.update(describe(batches))
            if label.startswith("burst"):
                info["bytes"] = nbytes
            info["launch_path"] = backend.launch_paths()
            sequence.append(info)
        for _ in range(args.reps):
            empty_kernel[(1,)](dummy)
            synchronize(device)
        sequence.append({"label": "empty", "kernel": "empty", "launches": args.reps, "per_apply": 1})
    finally:
        if profiling:
            torch.cuda.profiler.stop()
    with open(args.manifest, "w") as f:
        json.dump({"reps": args.reps, "sequence": sequence}, f, indent=1)
    print(f"ncu_kernel_times.py --target: {sum(s['launches'] for s in sequence)} measured launches; "
          f"manifest {args.manifest}")  # fmt: skip
    return 0


#: Kernels ncu profiles: ours (`apply_kernel_fn` in backends/triton/kernels/apply.py) and the bench's empty one.
NCU_KERNEL_REGEX = "apply_kernel|empty_kernel"
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


def profile(args: argparse.Namespace) -> dict:
    """Device time per kernel from Nsight Compute (`gpu__time_duration.sum`), launch overhead excluded.

    Raises:
        RuntimeError: ncu failed, timed out, or its output was not understood (its log is in `args.out`).
    """
    target = Path(__file__).resolve()
    ncu = args.ncu
    reps = args.reps
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
    log(f"  {ncu}: {' '.join(version.stdout.split()[-3:])}")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "manifest.json"
        cmd = [ncu, "--clock-control", "none", "--cache-control", args.cache_control,
               "--metrics", "gpu__time_duration.sum", "--csv",
               "--kernel-name", f"regex:{NCU_KERNEL_REGEX}", "--profile-from-start", "off",
               sys.executable, str(target), "--target", "--device", str(args.device), "--reps", str(reps),
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
        Path(args.out).write_text(log_text)
        head = _head(out, err)
        if timed_out or proc.returncode:
            why = f"timed out after {NCU_TIMEOUT_S} s" if timed_out else f"exited {proc.returncode}"
            log(f"  ncu {why}; first lines of its output:\n{head}")
            raise RuntimeError(f"ncu {why} (see {args.out})")
        try:
            man = json.loads(manifest.read_text())
            kernels = parse_ncu_csv(out)
            res = assign_ncu_rows(kernels, man)
        except (OSError, ValueError, KeyError) as exc:
            log(f"  cannot read ncu's results ({type(exc).__name__}: {exc}); first lines of its output:\n{head}")
            raise RuntimeError(f"ncu output not understood: {exc} (see {args.out})") from None
    res["seconds"] = round(seconds, 1)
    res["command"] = shlex.join(cmd)
    res["cache_control"] = (
        "all (ncu default: caches flushed before each kernel)"
        if args.cache_control == "all"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="store_true", help="be the profiled program (ncu starts it so)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --target (smoke test)")
    ap.add_argument("--reps", type=int, default=20, help="applies and empty launches measured per configuration")
    ap.add_argument("--warmup", type=int, default=5, help="--target: warm-up rounds before the profiled range")
    ap.add_argument("--burst-requests", type=int, default=256)
    ap.add_argument("--burst-ids", type=int, default=1024)
    ap.add_argument("--manifest", help="--target: where to write the launch manifest (JSON)")
    ap.add_argument("--ncu", default=shutil.which("ncu"), help="path of Nsight Compute's ncu (default: ncu on PATH)")
    ap.add_argument(
        "--cache-control", default="all", choices=["all", "none"],
        help="ncu --cache-control: all (flush caches before each kernel, ncu's default) or none (warm caches)",
    )  # fmt: skip
    ap.add_argument("--out", default="ncu.log", help="where ncu's full output goes (ncu.log)")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and args.device.index is None and torch.cuda.is_available():
        args.device = torch.device("cuda", torch.cuda.current_device())
    if args.target:
        if not args.manifest:
            ap.error("--target needs --manifest")
        return target(args)
    if args.device.type != "cuda" or not torch.cuda.is_available():
        print("ncu_kernel_times.py: needs a CUDA device", file=sys.stderr)
        return 2
    if not args.ncu:
        print("ncu_kernel_times.py: ncu is not on PATH (pass --ncu PATH)", file=sys.stderr)
        return 2
    try:
        res = profile(args)
    except RuntimeError as exc:
        print(f"ncu_kernel_times.py: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
