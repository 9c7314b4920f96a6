"""The `multiwrite` command: `replay` (the main job), `info`, `bench`.

Exit codes: 0 success, 1 a mismatch against the reference, 2 bad arguments or input.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from multiwrite.dispatch import BACKEND_ENV, available_backends, select_backend
from multiwrite.environment import DeviceError, environment, resolve_device
from multiwrite.errors import BackendUnavailableError, StagedWriteError
from multiwrite.workload import TraceError, load_trace


def int_list(text: str) -> list[int]:
    """`"16,32,8"` -> `[16, 32, 8]` (argparse type); positive integers only."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool) -> Iterator:
    """A tqdm bar on stderr (the `cli` extra), or a silent stand-in when disabled or tqdm is missing."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    try:
        yield (bar.update if bar is not None else (lambda n=1: None))
    finally:
        if bar is not None:
            bar.close()


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a serving trace through BlockTables and check every table against the reference",
        description="Replay the trace-replay workload (see BENCHMARKS.md) through BlockTables on the selected "
        "backend and device, checking the tables against a plain sequential reference.",
    )
    p.add_argument("--trace", help="CSV with ContextTokens,GeneratedTokens columns (default: embedded Azure trace)")
    p.add_argument("--block-sizes", type=int_list, default=[16, 32, 8], help="tokens per block, per group (16,32,8)")
    p.add_argument("--kernel-block-sizes", type=int_list, default=None, help="kernel block size per group (16,16,8)")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    """Run `multiwrite replay`; returns the exit code."""
    from multiwrite.replay import run_replay

    kbs = args.kernel_block_sizes
    if args.block_sizes == [16, 32, 8] and kbs is None:
        kbs = [16, 16, 8]
    if kbs is not None and len(kbs) != len(args.block_sizes):
        print(f"error: --kernel-block-sizes has {len(kbs)} entries for {len(args.block_sizes)} groups", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    trace = load_trace(args.trace)
    with progress_bar(args.steps, "replay", not args.no_progress) as tick:
        result = run_replay(
            trace, args.block_sizes, kbs, args.concurrency, args.steps, device, args.backend, args.check_every, tick
        )
    env = environment(device)
    apply_us = np.asarray(result.apply_us or [float("nan")])
    step_us = np.asarray(result.step_us or [float("nan")])
    lines = [
        ("trace", f"{trace.source} ({len(trace)} requests)"),
        ("backend", result.backend),
        ("device", f"{env['device']} ({env['device_name']})"),
        (
            "versions",
            f"multiwrite {env['multiwrite']}, torch {env['torch']}, triton {env['triton']}, "
            f"numpy {env['numpy']}, python {env['python']}",
        ),
        ("groups", f"block sizes {args.block_sizes}, kernel block sizes {kbs or args.block_sizes}"),
        ("concurrency", str(args.concurrency)),
        (
            "steps",
            f"{result.steps}"
            + (f" of {args.steps} (the trace ran out of requests)" if result.steps < args.steps else ""),
        ),
        ("writes", str(result.writes)),
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


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="versions, devices and every registered backend with its status")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each failed plugin's traceback")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    """Run `multiwrite info`; returns 0.

    Per device, the backend dispatch would pick is marked selected; when `$MULTIWRITE_BACKEND` forces one
    that cannot run there, a line says so (with its reasons) and nothing is marked.
    """
    cpu = torch.device("cpu")
    env = environment(cpu)
    print("multiwrite info")
    print(
        f"  versions  multiwrite {env['multiwrite']}, torch {env['torch']}, triton {env['triton']}, "
        f"numpy {env['numpy']}, python {env['python']}"
    )
    hip = getattr(torch.version, "hip", None)
    devices = [cpu]
    print(f"  cpu       {env['device_name']} ({env['torch_threads']} torch threads)")
    if torch.cuda.is_available():
        kind = f"ROCm/HIP {hip}" if hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            devices.append(torch.device("cuda", i))
            print(f"  cuda:{i}    {torch.cuda.get_device_name(i)} ({kind})")
    else:
        build = f"HIP {hip}" if hip else f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        print(f"  cuda      no device (torch build: {build})")
    if len(devices) == 1:
        devices.append(torch.device("cuda"))  # say why the GPU backends cannot run here
    forced = os.environ.get(BACKEND_ENV) or None
    for device in devices[:2]:
        print(f"backends for {device}:")
        statuses = available_backends(device)
        try:
            chosen = select_backend(device)  # exactly what dispatch does, $MULTIWRITE_BACKEND included
        except BackendUnavailableError:
            chosen = None
        for s in statuses:
            state = "available" if s.available else "unavailable: " + "; ".join(s.reasons)
            mark = ""
            if chosen is not None and s.name == chosen.NAME and s.taken_by is None:  # names are unique
                mark = f"  <- selected (forced by ${BACKEND_ENV})" if forced else "  <- selected"
            priority = f"{s.priority:>4}" if s.backend is not None else "   -"
            dist = f"{s.distribution} {s.version}" if s.distribution else "-"
            print(f"  {s.name:<13} {dist:<22} priority {priority}  {state}{mark}")
            if getattr(args, "verbose", False) and s.traceback and device == devices[0]:
                print("    " + s.traceback.rstrip().replace("\n", "\n    "))
        if forced and chosen is None:
            owner = next((s for s in statuses if s.name == forced and s.taken_by is None), None)
            if owner is None:
                names = ", ".join(sorted({s.name for s in statuses}))
                why = f"no backend of that name is registered (registered: {names})"
            else:
                why = "; ".join(owner.reasons)
            print(f"  forced by ${BACKEND_ENV}={forced}: cannot run: {why}")
    return 0


def _add_check_backend(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-backend",
        help="run the conformance kit against a backend: one line per property, exit 1 on any failure",
    )
    p.add_argument("name", help="the backend's NAME (see multiwrite info)")
    p.add_argument("--device", default=None, help="device of the tables (default: the first it can run on)")
    p.add_argument("--examples", type=positive_int, default=None, help="hypothesis examples per property (50)")
    p.set_defaults(func=lambda args: __import__("multiwrite.testing").testing.check_backend(
        args.name, args.device, args.examples))  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `multiwrite` command."""
    parser = argparse.ArgumentParser(
        prog="multiwrite", description="Fused block-table writes for paged-KV-cache LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_replay(sub)
    _add_info(sub)
    _add_check_backend(sub)
    try:
        from multiwrite import bench
    except ImportError:
        pass
    else:
        bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `multiwrite` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (TraceError, StagedWriteError, BackendUnavailableError, DeviceError) as exc:
        print(f"multiwrite {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
