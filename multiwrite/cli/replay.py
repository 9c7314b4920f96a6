"""`multiwrite replay`: the trace-replay workload (`multiwrite.replay`) through `BlockTables` on a backend and
device, every table checked against the reference; its options, defaults and report."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from multiwrite.cli import args as cli_args

#: Default `--block-sizes`; the default kernel block size of a group is `gcd(block size, 16)`.
DEFAULT_BLOCK_SIZES = [16, 32, 8]
DEFAULT_KERNEL_BLOCK = 16


def default_kernel_block_sizes(block_sizes: Sequence[int]) -> list[int]:
    """`gcd(bs, 16)` per group: 16 where the block size is a multiple of 16 (a 16-token attention kernel
    block, as G3 of BENCHMARKS.md), else the largest divisor of the block size that divides 16."""
    return [math.gcd(bs, DEFAULT_KERNEL_BLOCK) for bs in block_sizes]


def check_kernel_block_sizes(block_sizes: Sequence[int], kernel_block_sizes: Sequence[int]) -> None:
    """Raise `UsageError` (exit 2, argparse's format) unless there is one kernel block size per group and
    each divides its group's block size."""
    if len(kernel_block_sizes) != len(block_sizes):
        raise cli_args.UsageError(
            f"argument --kernel-block-sizes: {len(kernel_block_sizes)} "
            f"{'entry' if len(kernel_block_sizes) == 1 else 'entries'} for the {len(block_sizes)} groups of "
            f"--block-sizes {','.join(map(str, block_sizes))}"
        )
    from multiwrite.reference import misfit_kernel_block  # (numpy only)

    misfit = misfit_kernel_block(block_sizes, kernel_block_sizes)
    if misfit is not None:
        raise cli_args.UsageError(f"argument --kernel-block-sizes: {misfit}")


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `replay` on the `multiwrite` command's subparsers."""
    from multiwrite.workload import MAX_PROMPT_TOKENS  # (numpy only: the workload's token caps for the help)

    p = cli_args.add_subcommand(
        sub,
        common,
        "replay",
        cmd_replay,
        help="replay a serving trace through BlockTables and check every table against the reference",
        description="Replay the trace-replay workload (see BENCHMARKS.md) through BlockTables on the selected "
        "backend and device, checking the tables against a plain sequential reference. Prompts and outputs "
        f"longer than {MAX_PROMPT_TOKENS} tokens are capped at {MAX_PROMPT_TOKENS} (the workload's limits); "
        "the output says how many were.",
        epilog=cli_args.EXIT_CODES_HELP,
    )
    cli_args.add_trace_option(p, MAX_PROMPT_TOKENS)
    p.add_argument(
        "--block-sizes",
        type=cli_args.int_list,
        default=DEFAULT_BLOCK_SIZES,
        help="tokens per block, per group (16,32,8)",
    )
    p.add_argument(
        "--kernel-block-sizes",
        type=cli_args.int_list,
        default=None,
        help="kernel block size per group, each dividing its block size (default: gcd(block size, 16) per group, "
        "16,16,8 for the default block sizes)",
    )
    p.add_argument("--concurrency", type=cli_args.positive_int, default=40, help="request slots = table rows (40)")
    p.add_argument("--steps", type=cli_args.positive_int, default=1000, help="scheduler steps (1000)")
    cli_args.add_device_options(p)
    p.add_argument(
        "--check-every",
        type=cli_args.non_negative_int,
        default=50,
        help="compare with the reference every N steps, 0: only after the last step (50)",
    )
    p.add_argument(
        "--overlap-rate",
        type=float,
        default=0.1,
        help="share of appends (besides every admission) staged as a decoy overwrite then the real one in the same "
        "step, so that only a backend where the later write wins passes; 0 replays the trace as is (0.1)",
    )
    cli_args.add_progress_option(p)


def cmd_replay(args: argparse.Namespace) -> int:
    """Run `multiwrite replay`; returns the exit code (0 no mismatch, 1 a mismatch).

    Raises:
        UsageError: kernel block sizes that do not match the block sizes. RefusedError: the tables cannot
        fit in memory. TraceError, DeviceError, BackendUnavailableError: bad trace, device or backend.
    """
    import numpy as np

    import multiwrite.replay as replay
    from multiwrite.environment import environment, resolve_device
    from multiwrite.workload import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, load_trace

    kbs = args.kernel_block_sizes
    if kbs is None:
        kbs = default_kernel_block_sizes(args.block_sizes)
    if not 0.0 <= args.overlap_rate <= 1.0:
        raise cli_args.UsageError(f"argument --overlap-rate: expected a share in [0, 1], got {args.overlap_rate}")
    check_kernel_block_sizes(args.block_sizes, kbs)
    device = resolve_device(args.device)
    host, dev = replay.replay_memory(args.block_sizes, kbs, args.concurrency)
    cli_args.refuse_if_too_big(f"--concurrency {args.concurrency}", host, dev, device)
    trace = load_trace(args.trace)
    with cli_args.progress_bar(args.steps, "replay", cli_args.show_progress(args.no_progress)) as tick:
        result = replay.run_replay(
            trace,
            args.block_sizes,
            kbs,
            args.concurrency,
            args.steps,
            device,
            args.backend,
            args.check_every,
            tick,
            overlap_rate=args.overlap_rate,
        )
    env = environment(device)
    apply_us = np.asarray(result.apply_us or [float("nan")])
    step_us = np.asarray(result.step_us or [float("nan")])
    capped_p, capped_o = trace.num_capped()
    lines = [
        ("trace", f"{trace.source} ({len(trace)} requests)"),
        (
            "token caps",
            f"prompts cut to {MAX_PROMPT_TOKENS} tokens ({capped_p} longer in this trace), outputs to "
            f"{MAX_OUTPUT_TOKENS} ({capped_o} longer)",
        ),
        ("backend", result.backend),
        ("device", f"{env['device']} ({env['device_name']})"),
        (
            "versions",
            f"multiwrite {env['multiwrite']}, torch {env['torch']}, triton {env['triton']}, "
            f"numpy {env['numpy']}, python {env['python']}",
        ),
        ("groups", f"block sizes {args.block_sizes}, kernel block sizes {kbs}"),
        ("concurrency", str(args.concurrency)),
        (
            "steps",
            f"{result.steps}"
            + (f" of {args.steps} (the trace ran out of requests)" if result.steps < args.steps else ""),
        ),
        ("writes", str(result.writes)),
        (
            "overlaps",
            f"{result.overlapping_writes} calls staged twice in one step, a decoy overwrite then the real ids "
            f"(--overlap-rate {args.overlap_rate})",
        ),
        ("block ids written", f"{result.block_ids} (kernel block ids)"),
        ("checks", str(result.checks)),
        ("mismatches", str(result.mismatches)),
        ("apply host time", f"median {np.median(apply_us):.1f} us, p99 {np.percentile(apply_us, 99):.1f} us"),
        ("staging + apply", f"median {np.median(step_us):.1f} us, p99 {np.percentile(step_us, 99):.1f} us"),
    ]
    width = max(len(k) for k, _ in lines)
    print("multiwrite replay")
    for key, value in lines:
        print(f"  {key:<{width}}  {value}")
    print(
        "result: OK, zero mismatches" if result.mismatches == 0 else f"result: FAILED, {result.mismatches} mismatches"
    )
    return 0 if result.mismatches == 0 else 1
