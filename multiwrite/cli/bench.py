"""`multiwrite bench`: options, checks before the run, the run, the report.

One process, one run: the trace-replay workload of the project's performance anchors (BENCHMARKS.md) for
each configuration and concurrency, through the variants of `multiwrite.bench.variants` (timed as
`multiwrite.bench.runner` describes), every variant checked against the reference; then the prefill burst;
with `--launch` and `--stage` the parts of `multiwrite.bench.launch` and `multiwrite.bench.stage`; then the
report of `multiwrite.bench.report` on the terminal, and on request a CSV file and a plot. Exit codes:
`multiwrite.cli.args.EXIT_CODES_HELP`. Only argparse and `multiwrite.cli.args` are imported at the top: the
measurements (torch, the library) load when the subcommand runs.
"""

from __future__ import annotations

import argparse
import contextlib
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from multiwrite.cli.args import (
    EXIT_CODES_HELP,
    RefusedError,
    UsageError,
    add_device_options,
    add_progress_option,
    add_subcommand,
    add_trace_option,
    int_list,
    non_negative_int,
    positive_int,
    progress_bar,
    refuse_if_too_big,
    refuse_unwritable_outputs,
    show_progress,
    write_outputs,
)

if TYPE_CHECKING:
    import torch

    from multiwrite.bench.runner import BenchResult
    from multiwrite.cli.bench_model import ModelOptions


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
    from multiwrite.workload import CONFIGS

    names = [x.strip().upper() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration {text!r} (known: {', '.join(CONFIGS)})")
    return names


def groups_list(text: str) -> list[int]:
    """`"3,11,20"` -> `[3, 11, 20]` (argparse type of `--groups`; `bench.groups.group_counts`)."""
    from multiwrite.bench.groups import group_counts

    try:
        return group_counts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register the `bench` subcommand on the `multiwrite` command's subparsers."""
    from multiwrite.bench.glossary import help_text  # (numpy only: the terms and configurations for the help)
    from multiwrite.workload import CONFIGS, MAX_PROMPT_TOKENS

    p = add_subcommand(
        sub,
        common,
        "bench",
        cmd_bench,
        help="measure fused vs per-group vs naive block-table writes on the trace, with ratios, CSV and a plot",
        description=help_text(
            "Replay the trace workload of BENCHMARKS.md through the fused writer, one writer per group, "
            "naive per-write slice assignment and the launch floor, side by side in one run; check every "
            "variant against the reference; measure a prefill burst against a plain copy of the same bytes; "
            "judge the goals of BENCHMARKS.md."
        ),
        epilog=textwrap.fill(EXIT_CODES_HELP, 78),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f = FULL
    p.add_argument(
        "--quick",
        action="store_true",
        help="small run for a smoke test: G1,G3, 120 steps, small burst; with --model, 40 model steps at C=40 and on a "
        "CPU the tiny preset (about a minute on 2 cores; it says what it chose); its goal verdicts are indicative only",
    )
    add_trace_option(p, MAX_PROMPT_TOKENS)
    p.add_argument("--configs", type=config_list, help=f"configurations among {','.join(CONFIGS)} (all)")
    p.add_argument("--concurrency", type=int_list, help="request slots = table rows, list (40,256)")
    p.add_argument("--steps", type=positive_int, help=f"scheduler steps per configuration ({f.steps})")
    p.add_argument("--warmup", type=non_negative_int, help=f"first steps left out of the statistics ({f.warmup})")
    p.add_argument("--burst-requests", type=positive_int, help=f"requests of the prefill burst ({f.burst_requests})")
    p.add_argument("--burst-ids", type=positive_int, help=f"manager block ids per request and group ({f.burst_ids})")
    p.add_argument("--burst-reps", type=non_negative_int, help=f"timed burst repetitions, 0: none ({f.burst_reps})")
    p.add_argument(
        "--launch",
        action="store_true",
        help="also time the Triton launch itself (triton-cuda): each launch path next to an empty launch in the "
        "same loop, a tight loop of a captured decode apply, and device times behind a sleep (GPU)",
    )
    from multiwrite.cli.bench_model import add_model_options

    add_model_options(p)
    p.add_argument(
        "--stage",
        action="store_true",
        help="also time the whole block-table stage per decode step (G3: staging, apply, gather, slot mappings): "
        "prepare_inputs, our three calls, vLLM's call pattern and the anchor designs (GPU: also vLLM 0.33's own class, "
        "on vLLM's UVA path) next to an empty launch in the same loop",
    )
    p.add_argument(
        "--groups",
        type=groups_list,
        help="with --stage: the numbers of KV-cache groups to sweep, e.g. 3,11,20 (the configurations of that many "
        "groups: G1-G4, G11, G20; G11 and G20 mix full-attention, sliding-window and mamba-like groups of "
        "illustrative shapes); reports each design per group count and the change from the fewest to the most (3)",
    )
    from multiwrite.cli.bench_sglang import add_sglang_options

    add_sglang_options(p)
    add_device_options(p)
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch threads (default: 1 on CPU, as BENCHMARKS.md's CPU figures; torch's default on a GPU)",
    )
    p.add_argument("--csv", metavar="PATH", help="write one row per measurement to this CSV file")
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="plot staging + apply and apply time per variant and configuration (needs 'multiwrite[plot]')",
    )
    add_progress_option(p)


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
    opts: BenchOptions,
    device: torch.device,
    backend: str | None,
    trace_path: str | None,
    progress: bool,
    launch: bool = False,
    stage: bool = False,
    model: ModelOptions | None = None,
    stage_configs: Sequence[str] = ("G3",),
) -> BenchResult:
    """Measure every configuration and concurrency of `opts`, then the burst, on `device`; with `stage` the stage
    designs on each configuration of `stage_configs`.

    Raises:
        TraceError: the trace cannot be read. BackendUnavailableError: the backend cannot run on `device`.
    """
    import torch

    from multiwrite.bench.runner import BenchResult, measure_burst, measure_config
    from multiwrite.environment import environment
    from multiwrite.workload import load_trace
    from multiwrite.writer import FusedStagedWriter

    trace = load_trace(trace_path)
    backend_obj = FusedStagedWriter(device, backend).backend  # fails here, before measuring, if it cannot run
    backend_name = backend_obj.NAME
    timestamp = datetime.now().astimezone().isoformat(timespec="seconds")
    passes = 2 if device.type == "cuda" else 1
    total = len(opts.configs) * len(opts.concurrency) * opts.steps * passes + opts.burst_reps
    total += 2 * len(opts.concurrency) * opts.steps if launch else 0
    total += len(stage_configs) * len(opts.concurrency) * opts.steps if stage else 0
    total += len(model.concurrency) * model.steps if model else 0
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
        if launch:
            from multiwrite.bench.launch import measure_launch

            tight_n = 3000 if opts.steps >= FULL.steps else 200
            burst = (opts.burst_requests, opts.burst_ids)
            c = opts.concurrency
            result.launch = measure_launch(trace, device, opts.steps, opts.warmup, c, tight_n, burst, tick)
        if stage:
            from multiwrite.bench.stage import measure_stage

            if device.type == "cuda":
                from multiwrite.bench.launch import empty_launcher

                empty, floor = empty_launcher(device), "floor-triton"
            else:
                empty, floor = (lambda: backend_obj.apply([])), "floor"
            cs = opts.concurrency
            result.stage = measure_stage(trace, device, backend, opts.steps, opts.warmup, cs, empty, floor, tick,
                                         configs=stage_configs)  # fmt: skip
        if model is not None:
            from multiwrite.cli.bench_model import run_model

            result.model = run_model(model, trace, device, backend, tick)
    result.interpreted = ran_interpreted(backend_obj)
    result.quick = opts.steps < FULL.steps or opts.burst_reps < FULL.burst_reps
    return result


def ran_interpreted(backend: object) -> bool:
    """Whether `backend` ran its kernels through Triton's interpreter (`TRITON_INTERPRET=1`, a Triton
    backend on a CPU device): Triton backends report how they launched in `launch_paths()`."""
    from multiwrite.bench.runner import launch_paths

    return "interpreter" in launch_paths(backend)


def check_sizes(opts: BenchOptions, device: torch.device) -> None:
    """Raise `RefusedError` when the run cannot fit: burst block ids beyond int32, or more memory than the
    host (or the device) has."""
    if opts.burst_reps:
        largest = (1 + 3 * opts.burst_requests * opts.burst_ids) * 2  # G3's group 1 writes 2 kernel ids per id
        if largest > 2**31 - 1:
            raise RefusedError(
                f"--burst-requests {opts.burst_requests} --burst-ids {opts.burst_ids}: the burst's kernel block ids "
                f"reach {largest:,}, beyond int32 (2,147,483,647): refused before the run"
            )
    from multiwrite.bench.runner import memory_needed

    host, dev, what = memory_needed(opts, device)
    refuse_if_too_big(what, host, dev, device)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run `multiwrite bench`; returns the exit code (0 verified, 1 a mismatch).

    Raises:
        UsageError: options that contradict each other. RefusedError: a run that cannot fit. TraceError,
        DeviceError, BackendUnavailableError: bad trace, device or backend. All before measuring.
    """
    if args.sglang:
        from multiwrite.cli.bench_sglang import cmd_bench_sglang

        return cmd_bench_sglang(args)
    import torch

    from multiwrite.environment import resolve_device

    opts = options_from_args(args)
    if opts.warmup >= opts.steps:
        raise UsageError(f"argument --warmup: {opts.warmup} warm-up steps leave none of {opts.steps} steps to measure")
    if args.groups and not args.stage:
        raise UsageError("argument --groups: only with --stage")
    from multiwrite.bench.groups import BY_GROUP_COUNT

    stage_configs = [BY_GROUP_COUNT[n] for n in args.groups or [3]]
    refuse_unwritable_outputs(args.csv, args.plot)
    device = resolve_device(args.device)  # DeviceError: main() reports it, exit code 2
    check_sizes(opts, device)
    from multiwrite.cli.bench_model import model_options, model_plot_path

    model = model_options(args, opts, device)
    if model is not None and model.chosen:
        print(model.chosen, flush=True)  # before the run: what it will take is what this says
    if args.launch:
        from multiwrite.plugins.dispatch import available_backends

        status = next((s for s in available_backends(device) if s.name == "triton-cuda"), None)
        if status is None or not status.available:
            why = "; ".join(status.reasons) if status is not None else "not registered"
            raise RefusedError(f"--launch times triton-cuda, which cannot run on {device}: {why}")
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if device.type == "cpu" else threads_before)
    torch.set_num_threads(threads)
    try:
        result = run_bench(opts, device, args.backend, args.trace, show_progress(args.no_progress), args.launch,
                           args.stage, model, stage_configs)  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    result.env["torch_threads"] = str(threads)
    from multiwrite.bench.plot import write_plot
    from multiwrite.bench.report import terminal_report, write_csv

    write_outputs(terminal_report(result), args.csv, args.plot, partial(write_csv, result), partial(write_plot, result))
    if args.plot and result.model is not None:
        from multiwrite.bench.model_report import write_model_plot

        write_model_plot(result.model, result.env, model_plot_path(args.plot))
        print(f"plot: {model_plot_path(args.plot)}")
    return 1 if result.failures() else 0
