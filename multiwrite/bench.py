"""`multiwrite bench`: the fused writer side by side with per-group and naive writes on the real trace.

One process, one run: the trace-replay workload of the project's performance anchors (BENCHMARKS.md) for
each configuration and concurrency, through the variants of `bench_variants` (timed as `bench_run`
describes), every variant checked against the reference; then the prefill burst; then the report of
`bench_report` on the terminal, and on request a CSV file and a plot. Exit codes: 0 all verified, 1 a
variant's tables differed from the reference, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import datetime

import torch

from multiwrite.bench_run import BenchResult, measure_burst, measure_config
from multiwrite.cli import int_list, non_negative_int, positive_int, progress_bar
from multiwrite.environment import environment, resolve_device
from multiwrite.workload import CONFIGS, load_trace
from multiwrite.writer import FusedStagedWriter


@dataclass
class BenchOptions:
    """What to measure. Times of the report are microseconds; see `add_parser` for each option."""

    configs: list[str]
    concurrency: list[int]
    steps: int
    warmup: int
    burst_requests: int
    burst_ids: int
    burst_reps: int  # 0: no burst


#: `--quick`: a run that takes seconds on a 2-core CPU; the defaults otherwise (the anchors' workload, BENCHMARKS.md).
QUICK = BenchOptions(["G1", "G3"], [40, 256], 120, 20, 64, 256, 10)
FULL = BenchOptions(["G1", "G2", "G3", "G4"], [40, 256], 400, 50, 256, 1024, 20)


def config_list(text: str) -> list[str]:
    """`"G1,G3"` -> `["G1", "G3"]` (argparse type); names from `workload.CONFIGS`."""
    names = [x.strip().upper() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration {text!r} (known: {', '.join(CONFIGS)})")
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `bench` subcommand on the `multiwrite` command's subparsers."""
    p = sub.add_parser(
        "bench",
        help="measure fused vs per-group vs naive block-table writes on the trace, with ratios, CSV and a plot",
        description="Replay the trace workload of BENCHMARKS.md through the fused writer, one writer per group, "
        "naive per-write slice assignment and the launch floor, side by side in one run; check every "
        "variant against the reference; measure a prefill burst against a plain copy of the same bytes.",
    )
    f = FULL
    p.add_argument("--quick", action="store_true", help="small run for a smoke test: G1,G3, 120 steps, small burst")
    p.add_argument("--trace", help="CSV with ContextTokens,GeneratedTokens columns (default: embedded Azure trace)")
    p.add_argument("--configs", type=config_list, help=f"configurations among {','.join(CONFIGS)} (all)")
    p.add_argument("--concurrency", type=int_list, help="request slots = table rows, list (40,256)")
    p.add_argument("--steps", type=positive_int, help=f"scheduler steps per configuration ({f.steps})")
    p.add_argument("--warmup", type=non_negative_int, help=f"first steps left out of the statistics ({f.warmup})")
    p.add_argument("--burst-requests", type=positive_int, help=f"requests of the prefill burst ({f.burst_requests})")
    p.add_argument("--burst-ids", type=positive_int, help=f"manager block ids per request and group ({f.burst_ids})")
    p.add_argument("--burst-reps", type=non_negative_int, help=f"timed burst repetitions, 0: none ({f.burst_reps})")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto)")
    p.add_argument("--backend", default=None, help="force a backend by name (default: best available)")
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch threads (default: 1 on CPU, as BENCHMARKS.md's CPU figures; torch's default on a GPU)",
    )
    p.add_argument("--csv", metavar="PATH", help="write one row per measurement to this CSV file")
    p.add_argument("--plot", metavar="PATH.png", help="plot apply time per variant and configuration (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The preset (`--quick` or the defaults) with every option given on the command line applied."""
    preset = QUICK if args.quick else FULL
    return BenchOptions(
        *(
            getattr(args, name) if getattr(args, name) is not None else getattr(preset, name)
            for name in BenchOptions.__dataclass_fields__
        )
    )


def run_bench(
    opts: BenchOptions, device: torch.device, backend: str | None, trace_path: str | None, progress: bool
) -> BenchResult:
    """Measure every configuration and concurrency of `opts`, then the burst, on `device`.

    Raises:
        TraceError: the trace cannot be read. BackendUnavailableError: the backend cannot run on `device`.
    """
    trace = load_trace(trace_path)
    backend_obj = FusedStagedWriter(device, backend).backend  # fails here, before measuring, if it cannot run
    backend_name = backend_obj.NAME
    timestamp = datetime.now().astimezone().isoformat(timespec="seconds")
    passes = 2 if device.type == "cuda" else 1
    total = len(opts.configs) * len(opts.concurrency) * opts.steps * passes + opts.burst_reps
    result = BenchResult(
        timestamp, environment(device), backend_name, f"{trace.source} ({len(trace)} requests)", opts.steps, opts.warmup
    )
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, progress_bar(total, "bench", progress) as tick:
        for config in opts.configs:
            for c in opts.concurrency:
                result.configs.append(measure_config(trace, config, c, opts.steps, opts.warmup, device, backend, tick))
        if opts.burst_reps:
            result.burst = measure_burst(opts.burst_requests, opts.burst_ids, opts.burst_reps, device, backend, tick)
    result.interpreted = ran_interpreted(backend_obj)
    return result


def ran_interpreted(backend: object) -> bool:
    """Whether `backend` ran its kernels through Triton's interpreter (`TRITON_INTERPRET=1`, a Triton
    backend on a CPU device): Triton backends report how they launched in `launch_path`."""
    return "interpreter" in str(getattr(backend, "launch_path", ""))


def output_path_problem(path: str, option: str) -> str | None:
    """Why `path` cannot be written, or None when it can: checked before the run, so that a typo in
    `--csv` or `--plot` fails at once instead of after minutes of measuring. Opens the file for appending
    (which leaves an existing file as it is) and removes it again if it did not exist."""
    if os.path.isdir(path):
        return f"{option} {path}: is a directory"
    existed = os.path.lexists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot write there: {exc.strerror or exc}"
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(path)
    return None


def plot_format_problem(path: str) -> str | None:
    """Why matplotlib cannot save a figure to `path` (its extension names no format it knows), or None."""
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        return f"--plot {path}: matplotlib cannot write .{ext} files (supported: {', '.join(sorted(formats))})"
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run `multiwrite bench`; returns the exit code (0 verified, 1 a mismatch, 2 bad arguments)."""
    opts = options_from_args(args)
    if opts.warmup >= opts.steps:
        print(f"multiwrite bench: error: --warmup {opts.warmup} leaves none of {opts.steps} steps", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("multiwrite bench: error: --plot needs matplotlib: pip install 'multiwrite[plot]'", file=sys.stderr)
            return 2
    problems = [
        output_path_problem(path, option) for path, option in ((args.csv, "--csv"), (args.plot, "--plot")) if path
    ]
    if args.plot:
        problems.append(plot_format_problem(args.plot))
    for problem in filter(None, problems):
        print(f"multiwrite bench: error: {problem}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)  # DeviceError: main() reports it, exit code 2
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if device.type == "cpu" else threads_before)
    torch.set_num_threads(threads)
    try:
        result = run_bench(opts, device, args.backend, args.trace, not args.no_progress)
    finally:
        torch.set_num_threads(threads_before)
    result.env["torch_threads"] = str(threads)
    from multiwrite.bench_report import terminal_report, write_csv, write_plot

    print(terminal_report(result))
    if args.csv:
        write_csv(result, args.csv)
        print(f"csv: {args.csv}")
    if args.plot:
        write_plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 1 if result.failures() else 0
