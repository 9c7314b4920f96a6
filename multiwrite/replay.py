"""`multiwrite replay`: the trace-replay workload through `BlockTables`, checked against the reference."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.block_tables import BlockTables
from multiwrite.cli_args import (
    EXIT_CODES_HELP,
    UsageError,
    int_list,
    non_negative_int,
    positive_int,
    progress_bar,
    refuse_if_too_big,
    show_progress,
)
from multiwrite.environment import environment, resolve_device, synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import (
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    StagedCall,
    Trace,
    load_trace,
    max_blocks_per_group,
    replay_steps,
)

#: Default `--block-sizes`; the default kernel block size of a group is `gcd(block size, 16)`.
DEFAULT_BLOCK_SIZES = [16, 32, 8]
DEFAULT_KERNEL_BLOCK = 16

#: Added to a block id to make the decoy that an overlapping write replaces (fits int32 after expansion).
DECOY_OFFSET = 500_000


@dataclass
class ReplayResult:
    """What a replay did and measured.

    Attributes:
        step_us / apply_us: host time per step with at least one write, microseconds: staging plus
            `apply_staged_writes`, and `apply_staged_writes` alone.
        mismatches: cells (tables, host and device `num_blocks`) that differed from the reference,
            summed over every check.
        overlapping_writes: decoy calls that a later call of the same step overwrote (`overlap_rate`).
    """

    backend: str
    device: torch.device
    steps: int = 0
    writes: int = 0
    block_ids: int = 0
    checks: int = 0
    mismatches: int = 0
    step_us: list[float] = field(default_factory=list)
    apply_us: list[float] = field(default_factory=list)
    overlapping_writes: int = 0


def count_mismatches(tables: BlockTables, reference: ReferenceBlockTables) -> int:
    """Cells where `tables` (device tables, host and device num_blocks) differ from `reference`."""
    bad = 0
    for g, t in enumerate(tables.block_tables):
        bad += int(np.count_nonzero(t.tensor.cpu().numpy() != reference.tables[g]))
    bad += int(np.count_nonzero(tables.num_blocks != reference.num_blocks))
    bad += int(np.count_nonzero(tables.num_blocks_device.cpu().numpy() != reference.num_blocks))
    return bad


def run_replay(
    trace: Trace,
    block_sizes: Sequence[int],
    kernel_block_sizes: Sequence[int] | None,
    concurrency: int,
    num_steps: int,
    device: torch.device,
    backend: str | None = None,
    check_every: int = 50,
    on_step: Callable[[], None] | None = None,
    overlap_rate: float = 0.0,
) -> ReplayResult:
    """Replay `num_steps` scheduler steps of `trace` through `BlockTables` on `device`.

    Every `check_every` steps (0: only at the end) and after the last step the tables are compared with
    `ReferenceBlockTables` fed the same calls. Host times are taken with `time.perf_counter`; the device
    is synchronized after each step, outside the timed region. With `overlap_rate > 0` the steps go
    through `with_overlaps` (overlapping writes within a step, which only "later wins" gets right).

    Raises:
        BackendUnavailableError: the backend cannot run on `device`.
    """
    widths = max_blocks_per_group(block_sizes)
    tables = BlockTables(block_sizes, concurrency, widths, device, kernel_block_sizes, backend=backend)
    reference = ReferenceBlockTables(block_sizes, concurrency, widths, kernel_block_sizes)
    result = ReplayResult(tables.backend.NAME, tables.device)
    ks = tables.kernel_blocks_per_block
    clock = time.perf_counter
    steps: Iterable[list[StagedCall]] = replay_steps(trace, block_sizes, concurrency, num_steps)
    if overlap_rate > 0:
        steps = with_overlaps(steps, overlap_rate, result)
    for step, calls in enumerate(steps, start=1):
        t0 = clock()
        for req, ids, overwrite in calls:
            tables.append_block_ids(req, ids, overwrite)
        t1 = clock()
        tables.apply_staged_writes()
        t2 = clock()
        synchronize(tables.device)
        if calls:
            result.step_us.append((t2 - t0) * 1e6)
            result.apply_us.append((t2 - t1) * 1e6)
        for req, ids, overwrite in calls:
            reference.append_block_ids(req, ids, overwrite)
            result.block_ids += sum(len(x) * k for x, k in zip(ids, ks))
        result.writes += len(calls)
        result.steps = step
        if check_every and step % check_every == 0:
            result.mismatches += count_mismatches(tables, reference)
            result.checks += 1
        if on_step is not None:
            on_step()
    if not check_every or result.steps % check_every:
        result.mismatches += count_mismatches(tables, reference)
        result.checks += 1
    return result


def with_overlaps(
    steps: Iterable[list[StagedCall]], rate: float, result: ReplayResult | None = None, seed: int = 0
) -> Iterator[list[StagedCall]]:
    """The same steps with overlapping writes: a request preempted and re-admitted within one step.

    Every admission (`overwrite=True`) and a `rate` share of the appends (fixed `seed`) become two
    calls: a decoy overwrite of the request's whole row (its ids + `DECOY_OFFSET`), then the overwrite
    with its real ids from column 0. The tables must end exactly as without the decoys, which holds only
    where the later write wins (in the ids and in `num_blocks`). Counts decoys in
    `result.overlapping_writes`.
    """
    rng = np.random.default_rng(seed)
    held: dict[int, list[list[int]]] = {}
    for calls in steps:
        out: list[StagedCall] = []
        for req, ids, overwrite in calls:
            row = [list(x) for x in ids] if overwrite else [h + list(x) for h, x in zip(held[req], ids)]
            held[req] = row
            if overwrite or rng.random() < rate:
                out.append((req, [[b + DECOY_OFFSET for b in g] for g in row], True))
                out.append((req, row, True))
                if result is not None:
                    result.overlapping_writes += 1
            else:
                out.append((req, ids, overwrite))
        yield out


def default_kernel_block_sizes(block_sizes: Sequence[int]) -> list[int]:
    """`gcd(bs, 16)` per group: 16 where the block size is a multiple of 16 (a 16-token attention kernel
    block, as G3 of BENCHMARKS.md), else the largest divisor of the block size that divides 16."""
    return [math.gcd(bs, DEFAULT_KERNEL_BLOCK) for bs in block_sizes]


def check_kernel_block_sizes(block_sizes: Sequence[int], kernel_block_sizes: Sequence[int]) -> None:
    """Raise `UsageError` (exit 2, argparse's format) unless there is one kernel block size per group and
    each divides its group's block size."""
    if len(kernel_block_sizes) != len(block_sizes):
        raise UsageError(
            f"argument --kernel-block-sizes: {len(kernel_block_sizes)} "
            f"{'entry' if len(kernel_block_sizes) == 1 else 'entries'} for the {len(block_sizes)} groups of "
            f"--block-sizes {','.join(map(str, block_sizes))}"
        )
    for g, (bs, kbs) in enumerate(zip(block_sizes, kernel_block_sizes)):
        if bs % kbs:
            raise UsageError(
                f"argument --kernel-block-sizes: group {g}: block size {bs} is not a positive multiple of kernel "
                f"block size {kbs}"
            )


def replay_memory(block_sizes: Sequence[int], kernel_block_sizes: Sequence[int], concurrency: int) -> tuple[int, int]:
    """(host bytes, device bytes) a replay allocates, about: int32 device tables and `num_blocks`; on the
    host the int64 reference, its `num_blocks`, the staging stamps and one table copied back per check."""
    widths = max_blocks_per_group(block_sizes)
    cells = [w * (bs // kbs) for w, bs, kbs in zip(widths, block_sizes, kernel_block_sizes)]
    groups = len(block_sizes)
    device = concurrency * (sum(cells) + groups) * 4
    host = concurrency * (sum(cells) * 8 + groups * 8 + (groups + 1) * 8 + max(cells) * 5)
    return host, device


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `replay` on the `multiwrite` command's subparsers."""
    p = sub.add_parser(
        "replay",
        parents=[common],
        help="replay a serving trace through BlockTables and check every table against the reference",
        description="Replay the trace-replay workload (see BENCHMARKS.md) through BlockTables on the selected "
        "backend and device, checking the tables against a plain sequential reference. Prompts and outputs "
        f"longer than {MAX_PROMPT_TOKENS} tokens are capped at {MAX_PROMPT_TOKENS} (the workload's limits); "
        "the output says how many were.",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument(
        "--trace",
        help="CSV with ContextTokens,GeneratedTokens columns (default: embedded Azure trace); prompts and "
        f"outputs are capped at {MAX_PROMPT_TOKENS} tokens",
    )
    p.add_argument(
        "--block-sizes", type=int_list, default=DEFAULT_BLOCK_SIZES, help="tokens per block, per group (16,32,8)"
    )
    p.add_argument(
        "--kernel-block-sizes",
        type=int_list,
        default=None,
        help="kernel block size per group, each dividing its block size (default: gcd(block size, 16) per group, "
        "16,16,8 for the default block sizes)",
    )
    p.add_argument("--concurrency", type=positive_int, default=40, help="request slots = table rows (40)")
    p.add_argument("--steps", type=positive_int, default=1000, help="scheduler steps (1000)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto)")
    p.add_argument("--backend", default=None, help="force a backend by name (default: best available)")
    p.add_argument(
        "--check-every",
        type=non_negative_int,
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only when stderr is a terminal)")
    p.set_defaults(func=cmd_replay, parser=p)


def cmd_replay(args: argparse.Namespace) -> int:
    """Run `multiwrite replay`; returns the exit code (0 no mismatch, 1 a mismatch).

    Raises:
        UsageError: kernel block sizes that do not match the block sizes. RefusedError: the tables cannot
        fit in memory. TraceError, DeviceError, BackendUnavailableError: bad trace, device or backend.
    """
    kbs = args.kernel_block_sizes
    if kbs is None:
        kbs = default_kernel_block_sizes(args.block_sizes)
    if not 0.0 <= args.overlap_rate <= 1.0:
        raise UsageError(f"argument --overlap-rate: expected a share in [0, 1], got {args.overlap_rate}")
    check_kernel_block_sizes(args.block_sizes, kbs)
    device = resolve_device(args.device)
    host, dev = replay_memory(args.block_sizes, kbs, args.concurrency)
    refuse_if_too_big(f"--concurrency {args.concurrency}", host, dev, device)
    trace = load_trace(args.trace)
    with progress_bar(args.steps, "replay", show_progress(args.no_progress)) as tick:
        result = run_replay(
            trace, args.block_sizes, kbs, args.concurrency, args.steps, device, args.backend, args.check_every, tick,
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
