"""Where the host time of the eager stage goes, per decode step (issue 24): the trace's G3 schedule through
`bench --stage`'s designs, each step's staging and stage calls timed apart, an empty Triton launch and one bare
launch of the stage kernel through its bound fast launcher (no multiwrite Python around it) timed in the same loop;
then one cProfile pass per design, its top functions by internal time.

    PYTHONPATH=$PWD python scripts/stage_host_costs.py [--steps 300] [--concurrency 40 256] [--profile 25]
        [--configs G3 G20]

Graph mode's designs time staging + `commit_staged_writes` ("calls"); their replay runs untimed, before the
synchronize.

Figures: medians over the decode steps after the warm-up, us. Read them as ratios within one run. The designs run in
a fixed order after each synchronize (the first meets the coldest caches), unlike `bench --stage`, which rotates.

First run, 2026-12-03 at 0bf7951 (H200, torch 2.11, Triton 3.6, 300 steps; us per decode step):

    C=40:  empty launch 17.5; ours-batched staging 1.5 + calls 24.9; ours 1.5 + 21.8; vllm-3-calls 1.6 + 43.9;
           a gather-only call 11.3, the bare C-launcher launch it makes 4.8
    C=256: empty launch 20.1; ours-batched 4.5 + 30.2; ours 5.3 + 24.9; vllm-3-calls 6.0 + 50.8;
           a gather-only call 19.4, its bare launch 6.7

So about two thirds of a call is multiwrite's Python around the launch, and a bare launch through Triton's C
launcher is a third of an empty JIT launch (the cProfile part of that run printed seconds, since fixed).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from multiwrite.backends.triton.launcher import get_stream
from multiwrite.bench.groups import STAGE_CONFIGS
from multiwrite.bench.launch import empty_launcher
from multiwrite.bench.stage_designs import GraphMode, GraphModeBatched, Ours, OursBatched, StepBuffers, VllmThreeCalls
from multiwrite.environment import synchronize
from multiwrite.workload import TOKEN_BUDGET, load_trace, replay_schedule

DESIGNS = (OursBatched, Ours, VllmThreeCalls, GraphMode, GraphModeBatched)


def recorded_gather(bt, x: StepBuffers):
    """The stage launcher of `bt`'s device, and the `(variant, grid0, args)` of one gather-only launch of
    `bt.gather_block_tables(x.idx, x.n)` (nothing staged), recorded at its bound fast launcher (two calls first:
    the second binds it)."""
    launcher = bt.backend.device_state(bt.device).stage_launcher
    bt.gather_block_tables(x.idx, x.n)
    bt.gather_block_tables(x.idx, x.n)
    seen = []
    bound = dict(launcher.fire)

    def recording(variant, fire):
        return lambda g0, g1, stream, args: (seen.append((variant, g0, args)), fire(g0, g1, stream, args))

    launcher.fire.update({v: recording(v, f) for v, f in bound.items() if f is not None})
    try:
        bt.gather_block_tables(x.idx, x.n)
    finally:
        launcher.fire.update(bound)
    if not seen:
        raise RuntimeError(f"the gather did not launch through a bound fast launcher ({launcher.path})")
    return launcher, seen[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--concurrency", type=int, nargs="+", default=[40, 256])
    p.add_argument("--profile", type=int, default=25, help="top N functions of each design's cProfile pass (0: none)")
    p.add_argument("--backend", default=None)
    p.add_argument("--configs", nargs="+", default=["G3"], help="KV-cache group configurations (G3, G11, G20, ...)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trace = load_trace()
    empty = empty_launcher(device) if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter_ns
    for config, c in [(config, c) for config in args.configs for c in args.concurrency]:
        bs, _ = STAGE_CONFIGS[config]
        schedule = list(replay_schedule(trace, bs, c, args.steps))
        measured = {i for i, step in enumerate(schedule) if i >= args.warmup and step.is_decode}
        designs = [d(device, args.backend, c, TOKEN_BUDGET, config) for d in DESIGNS]
        x = StepBuffers(device, c, TOKEN_BUDGET)
        samples: dict[str, list[tuple[float, float]]] = {d.name: [] for d in designs}
        empties: list[float] = []
        for i, step in enumerate(schedule):
            x.load(step)
            synchronize(device)
            for d in designs:
                calls = d.prepare(step.calls)
                t0 = clock()
                d.stage(calls)
                t1 = clock()
                d.run(x)
                t2 = clock()
                d.after(x)
                synchronize(device)
                t3 = clock()
                empty()
                t4 = clock()
                synchronize(device)
                if i in measured:
                    samples[d.name].append(((t1 - t0) / 1e3, (t2 - t1) / 1e3))
                    empties.append((t4 - t3) / 1e3)
        e = float(np.median(empties)) if empties else float("nan")
        print(f"\n{config} C={c}: {len(measured)} decode steps; empty Triton launch {e:.1f} us")
        for d in designs:
            s = np.array(samples[d.name])
            st, run = np.median(s[:, 0]), np.median(s[:, 1])
            tot = np.median(s.sum(axis=1))
            print(f"  {d.name:18s} staging {st:6.1f}  calls {run:6.1f}  step {tot:6.1f} us = {tot / e:.2f} empty")
        # a gather-only call, and the bare fast launch it makes, in one loop
        bt = designs[0].bt
        state = bt.backend.device_state(bt.device)
        print(f"  launch paths: {state.stage_launcher.path}; apply: {state.apply_launcher.path}")
        launcher, (variant, grid0, launch_args) = recorded_gather(bt, x)
        fire = launcher.fire.get(variant)
        index = bt.device.index or 0
        pairs = []
        for _ in range(200):
            synchronize(device)
            t0 = clock()
            bt.gather_block_tables(x.idx, x.n)
            t1 = clock()
            synchronize(device)
            t2 = clock()
            if fire is not None:
                fire(grid0, 1, get_stream(index), launch_args)
            t3 = clock()
            synchronize(device)
            t4 = clock()
            empty()
            t5 = clock()
            pairs.append(((t1 - t0) / 1e3, (t3 - t2) / 1e3, (t5 - t4) / 1e3))
        g, f, e2 = np.median(np.array(pairs), axis=0)
        print(
            f"  gather-only call {g:.1f} us, its bare fast launch {f:.1f} us (fire bound: {fire is not None}), "
            f"empty launch {e2:.1f} us"
        )
        if args.profile:
            for cls in DESIGNS:
                d = cls(device, args.backend, c, TOKEN_BUDGET, config)  # fresh tables: the schedule from its start
                prof = cProfile.Profile()
                for i, step in enumerate(schedule):
                    x.load(step)
                    synchronize(device)
                    calls = d.prepare(step.calls)
                    timed = i in measured
                    if timed:
                        prof.enable()
                    d.stage(calls)
                    d.run(x)
                    if timed:
                        prof.disable()
                    d.after(x)
                    synchronize(device)
                rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[: args.profile]
                print(f"\n  cProfile {d.name} {config} C={c}, per decode step (us, profiler overhead included): "
                      "own, cumulative")
                for (path, line, func), (_, ncalls, own, cum, _) in rows:
                    where = f"{path.rsplit('/', 2)[-1]}:{line}({func})" if line else func
                    n = len(measured)
                    print(f"    {own / n * 1e6:7.2f} {cum / n * 1e6:7.2f}  x{ncalls / n:<5.1f} {where}")


if __name__ == "__main__":
    main()
