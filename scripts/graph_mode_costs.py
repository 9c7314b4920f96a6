"""Host and device costs of graph mode (`BlockTables(..., cuda_graphs=True)`): a measurement, not a test.

    python scripts/graph_mode_costs.py                    # on a GPU machine: C=40 and C=256, G3, 400 steps each
    python scripts/graph_mode_costs.py --steps 200 --concurrency 40 --stage

Replays the real trace (multiwrite.workload, G3) and prints, per concurrency, medians over decode-sized
steps (at most 256 staged values) after 50 warm-up steps:
  - host: staging (the step's append_block_ids) plus `commit_staged_writes()` (which publishes the step's batch
    with the ticket of the next replay), and the commit alone, in us and in empty Triton launches timed in the
    same loop, right after them (the goal of BENCHMARKS.md: staging plus commit at most 0.5 empty launch per step);
  - device: what the captured apply (the consume kernel) adds to a graph, per replay: CUDA events around the
    replay of a graph [empty launch, apply_staged_writes()] and of a graph [empty launch], alternating step by
    step, each replay consuming a real committed step (the goal: at most 3 us at C=256);
  - with --stage, the same for the whole captured stage, `prepare_inputs` (apply, gather, slot mappings) over
    persistent input buffers: decode steps replay a graph captured for C requests and C tokens (the bucket an
    engine would use), other steps one captured for C requests and the whole token budget; the device time
    added is measured on decode steps. Where the stage kernel is a programmatic dependent launch of the consume
    kernel (sm_90+: the Triton plan's `pdl`, `bt.graph.plan.pdl`, read at each capture), a second decode graph
    captured with it as a plain launch is timed in turn with the others.
The device is synchronized after each step, outside the timed regions. Each timed replay is queued behind
about 50 us of device work (`torch.cuda._sleep`) recorded before its start event, so the events time the graph's
device work only, not the host's `graph.replay()` call (whose cost grows with the graph's nodes and with host
load, and which an engine running ahead of the device hides the same way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from multiwrite import BlockTables
from multiwrite.bench.floor_kernel import empty_kernel
from multiwrite.workload import (
    CONFIGS,
    TOKEN_BUDGET,
    load_trace,
    max_blocks_per_group,
    replay_schedule,
    replay_steps,
)

WARMUP = 50
DECODE_VALUES = 256
#: Spin cycles queued before each timed replay: ~50 us at the H200's 1.98 GHz, more than a graph launch takes.
QUEUE_CYCLES = 100_000


def timed_replay(graph: torch.cuda.CUDAGraph, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
    """Replay `graph` between `start` and `end`, queued behind busy device work (see the module docstring)."""
    torch.cuda._sleep(QUEUE_CYCLES)
    start.record()
    graph.replay()
    end.record()


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what `fn()` launches."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_mode_tables(concurrency: int, **kw) -> tuple[BlockTables, Callable[[], None], Callable[[], None]]:
    """G3 graph-mode tables on the GPU for `concurrency` requests (`kw`: more `BlockTables` arguments), with
    `floor()`, one empty Triton launch (compiled now, before any capture), and `with_apply()`, the floor followed
    by `apply_staged_writes()`: what the graphs of this script and of scripts/consume_kernel_costs.py capture."""
    block_sizes, kernel_block_sizes = CONFIGS["G3"]
    widths = max_blocks_per_group(block_sizes)
    bt = BlockTables(block_sizes, concurrency, widths, "cuda", kernel_block_sizes, cuda_graphs=True, **kw)
    word = torch.zeros(1, device="cuda")
    empty_kernel[(1,)](word)
    torch.cuda.synchronize()

    def floor():
        empty_kernel[(1,)](word)

    def with_apply():
        floor()
        bt.apply_staged_writes()

    return bt, floor, with_apply


def measure(concurrency: int, steps: int) -> dict[str, float]:
    block_sizes = CONFIGS["G3"][0]
    bt, floor, with_apply = graph_mode_tables(concurrency)

    g_with, g_without = capture_graph(with_apply), capture_graph(floor)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clock = time.perf_counter_ns
    step_ns, commit_ns, launch_ns, with_us, without_us = [], [], [], [], []
    for i, calls in enumerate(replay_steps(load_trace(), block_sizes, concurrency, steps)):
        t0 = clock()
        for req, ids, overwrite in calls:
            bt.append_block_ids(req, ids, overwrite)
        t1 = clock()
        decode = bt[0].arena.num_values <= DECODE_VALUES  # (the arena every group stages into)
        bt.commit_staged_writes()
        t2 = clock()
        floor()
        t3 = clock()
        torch.cuda.synchronize()
        graph = g_with if i % 2 == 0 else g_without
        if graph is g_without:
            g_with.replay()  # consume this step's batch outside the timed replay
            torch.cuda.synchronize()
        timed_replay(graph, start, end)
        torch.cuda.synchronize()
        if i >= WARMUP and decode:
            step_ns.append(t2 - t0)
            commit_ns.append(t2 - t1)
            launch_ns.append(t3 - t2)
            (with_us if graph is g_with else without_us).append(start.elapsed_time(end) * 1e3)
    launch = statistics.median(launch_ns) / 1e3
    return {
        "steps": len(step_ns),
        "staging+commit us": statistics.median(step_ns) / 1e3,
        "commit us": statistics.median(commit_ns) / 1e3,
        "empty launch us": launch,
        "staging+commit / empty launch": statistics.median(step_ns) / 1e3 / launch,
        "graph with apply us": statistics.median(with_us),
        "graph without us": statistics.median(without_us),
        "device time added us": statistics.median(with_us) - statistics.median(without_us),
    }


def measure_stage(concurrency: int, steps: int) -> dict[str, float]:
    """What a captured `prepare_inputs` adds to a graph per decode replay (see the module docstring)."""
    block_sizes, kernel_block_sizes = CONFIGS["G3"]
    widths = max_blocks_per_group(block_sizes)
    C, T = concurrency, TOKEN_BUDGET
    bt = BlockTables(block_sizes, C, widths, "cuda", kernel_block_sizes, cuda_graphs=True, max_num_batched_tokens=T)
    idx = torch.zeros(C, dtype=torch.int32, device="cuda")
    qsl = torch.zeros(C + 1, dtype=torch.int32, device="cuda")
    pos = torch.zeros(T, dtype=torch.int64, device="cuda")
    pad = torch.ones(T, dtype=torch.bool, device="cuda")
    tokens = torch.arange(T, device="cuda")
    word = torch.zeros(1, device="cuda")
    empty_kernel[(1,)](word)

    def floor():
        empty_kernel[(1,)](word)

    decode_args = (idx, qsl, pos[:C], C, C, pad[:C])
    full_args = (idx, qsl, pos, C, T, pad)
    bt.prepare_inputs(*decode_args)  # compiled before any capture
    bt.prepare_inputs(*full_args)
    torch.cuda.synchronize()

    def with_stage():
        floor()
        bt.prepare_inputs(*decode_args)

    g_decode = capture_graph(with_stage)
    g_full, g_without = capture_graph(lambda: bt.prepare_inputs(*full_args)), capture_graph(floor)
    # The same decode graph with the stage kernel as a plain launch (where the default is PDL), timed in turn.
    plan = bt.graph.plan
    pdl = bool(getattr(plan, "pdl", False))
    plan.pdl = False
    g_plain = capture_graph(with_stage) if pdl else None
    plan.pdl = pdl
    timed_graphs = [g_decode, g_without] + ([g_plain] if pdl else [])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict = {g: [] for g in timed_graphs}
    for i, step in enumerate(replay_schedule(load_trace(), block_sizes, C, steps)):
        for req, ids, overwrite in step.calls:
            bt.append_block_ids(req, ids, overwrite)
        bt.commit_staged_writes()
        n = len(step.rows)
        qsl_host = [0]
        for t in step.tokens:
            qsl_host.append(qsl_host[-1] + t)
        total = qsl_host[-1]
        idx[:n].copy_(torch.tensor(step.rows, dtype=torch.int32))
        idx[n:].zero_()
        qsl[: n + 1].copy_(torch.tensor(qsl_host, dtype=torch.int32))
        qsl[n + 1 :].fill_(total)
        positions = [p for s0, t in zip(step.starts, step.tokens) for p in range(s0, s0 + t)]
        pos[:total].copy_(torch.tensor(positions, dtype=torch.int64))
        torch.ge(tokens, total, out=pad)
        torch.cuda.synchronize()
        timed = step.is_decode and i >= WARMUP
        graph = timed_graphs[i % len(timed_graphs)] if timed else g_decode if step.is_decode else g_full
        if graph is g_without:
            g_decode.replay()  # consume this step's batch outside the timed replay
            torch.cuda.synchronize()
        timed_replay(graph, start, end)
        torch.cuda.synchronize()
        if timed:
            times[graph].append(start.elapsed_time(end) * 1e3)
    without = statistics.median(times[g_without])
    result = {
        "decode steps": sum(len(t) for t in times.values()),
        "PDL": pdl,
        "graph with prepare_inputs us": statistics.median(times[g_decode]),
        "graph without us": without,
        "device time added us": statistics.median(times[g_decode]) - without,
    }
    if pdl:
        result["without PDL: device time added us"] = statistics.median(times[g_plain]) - without
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[40, 256])
    parser.add_argument("--stage", action="store_true", help="also the captured prepare_inputs")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for c in args.concurrency:
        runs = [("apply", measure)] + ([("prepare_inputs", measure_stage)] if args.stage else [])
        for what, fn in runs:
            result = fn(c, args.steps)
            parts = (f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            print(f"C={c} G3 captured {what}: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
