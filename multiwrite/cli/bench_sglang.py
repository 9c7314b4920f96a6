"""`multiwrite bench --sglang`: its options and its run (`multiwrite.bench.sglang`), a run of its own: the other
parts of `bench` are not measured with it.

Imports only argparse and `multiwrite.cli.args` at the top, as `multiwrite.cli.bench` does.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from functools import partial

from multiwrite.cli.args import (
    RefusedError,
    UsageError,
    int_list,
    progress_bar,
    refuse_unwritable_outputs,
    show_progress,
    write_outputs,
)

SGLANG_HELP = (
    "instead of the rest: time SGLang 0.5.23's page-table writers (its extend writer write_cache_indices, Triton on "
    "a GPU, its per-request fallback on a CPU; its decode allocation's write) next to multiwrite.sglang's, per "
    "step at each --sglang-bs, prefixes from the trace's prompt lengths: host time, device time (GPU) and kernels "
    "per call, ratios, the goals of issue 25; SGLang's code is read from its wheel (MULTIWRITE_SGLANG_WHEEL, "
    "MULTIWRITE_SGLANG_SRC, or the one tox -e sglang caches)"
)
#: Steps per writer and bs (--steps and --warmup change them): the defaults, and --quick's.
STEPS, WARMUP = 200, 20
QUICK_STEPS, QUICK_WARMUP = 12, 2


def add_sglang_options(p: argparse.ArgumentParser) -> None:
    """`--sglang` and `--sglang-bs` on the `bench` parser."""
    p.add_argument("--sglang", action="store_true", help=SGLANG_HELP)
    p.add_argument("--sglang-bs", type=int_list, help="batch sizes of --sglang (1,32,256,1024; --quick: 1,32)")


def cmd_bench_sglang(args: argparse.Namespace) -> int:
    """Run `bench --sglang`; returns 0 when every table matched and every goal judged was met, else 1.

    Raises:
        UsageError: no step to measure. RefusedError: SGLang's files not found, an output path that cannot be
        written. DeviceError: a bad --device.
    """
    import torch

    from multiwrite.bench.sglang import (
        BATCH_SIZES,
        measure_sglang,
        sglang_source,
        terminal_report,
        write_csv,
        write_plot,
    )
    from multiwrite.environment import environment, resolve_device
    from multiwrite.sglang.upstream import SglangSourceError
    from multiwrite.workload import load_trace

    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    if warmup >= steps:
        raise UsageError(f"argument --warmup: {warmup} warm-up steps leave none of {steps} steps to measure")
    bss = args.sglang_bs or ([1, 32] if args.quick else list(BATCH_SIZES))
    refuse_unwritable_outputs(args.csv, args.plot)
    device = resolve_device(args.device)
    try:
        source = sglang_source()
    except SglangSourceError as e:
        raise RefusedError(f"--sglang: {e}") from None
    trace = load_trace(args.trace)
    stamp = datetime.now().astimezone().isoformat(timespec="seconds")
    on_device = torch.cuda.device(device) if device.type == "cuda" else None
    with progress_bar(len(bss) * 4 * steps, "bench --sglang", show_progress(args.no_progress)) as tick:
        if on_device is not None:
            with on_device:
                result = measure_sglang(trace, device, bss, steps, warmup, args.backend, tick, stamp,
                                        environment(device), source)  # fmt: skip
        else:
            result = measure_sglang(trace, device, bss, steps, warmup, args.backend, tick, stamp, environment(device),
                                    source)  # fmt: skip
    write_outputs(terminal_report(result), args.csv, args.plot, partial(write_csv, result), partial(write_plot, result))
    return 1 if result.failures() else 0
