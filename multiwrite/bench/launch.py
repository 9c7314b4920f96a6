"""`multiwrite bench --launch`: the Triton launch itself, next to one empty launch (GPU; interpreter smoke run).

Three measurements the main bench does not make:

- **same loop**: G1 and G3 replayed through `BlockTables` on fresh `triton-cuda` backends, one per launch
  path (`auto`: Triton's compiled launcher called directly; `run`: `CompiledKernel.run`; `jit`:
  `kernel[grid](...)`; the `launcher` argument of the backend). Each step, each backend in a rotating order
  stages, applies and synchronizes, then launches the empty kernel and synchronizes: its "x empty" ratios pair
  every apply with an empty launch taken right after it, under the same conditions. The kernel launches per
  apply are counted by the backend's launchers (`device_state(device)`: apply, stage and consume launchers).
  Tables are checked against the reference at the end.
- **tight loop**: a captured G3 decode apply (`capture_decode`) alone, no staging, a synchronize every 50
  calls, next to the empty launch timed the same way.
- **device, behind a sleep**: CUDA events around work queued behind `torch.cuda._sleep`, so the launch
  submission is outside the interval: the empty kernel, the decode applies, the prefill burst next to a
  pinned host-to-device copy of its bytes. Skipped off GPUs.

Host times with `time.perf_counter_ns`, microseconds, medians (p99 for the same loop).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.bench.captured import capture_burst, capture_decode, new_triton_backend
from multiwrite.environment import synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.replay import count_mismatches, timed_step
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import CONFIGS, Trace, max_blocks_per_group, replay_steps

#: The `launcher` of the same-loop backends; the first is the default one.
LAUNCH_VARIANTS = ("auto", "run", "jit")


@dataclass
class LaunchResult:
    """What `measure_launch` measured. `same_loop`: one dict per (configuration, C, launcher);
    `tight_loop`: per concurrency; `device`: name -> microseconds (empty off GPUs)."""

    same_loop: list[dict] = field(default_factory=list)
    tight_loop: list[dict] = field(default_factory=list)
    device: dict[str, float] = field(default_factory=dict)
    launch_path: str = ""

    def failures(self) -> list[str]:
        """One line per same-loop backend whose tables differed from the reference."""
        return [
            f"launch {r['launcher']} {r['config']} C={r['C']}: {r['mismatches']} cells differ"
            for r in self.same_loop
            if r["mismatches"]
        ]


def empty_launcher(device: torch.device) -> Callable[[], object]:
    """One launch of the empty Triton kernel (compiled now, outside every timed region) on `device`."""
    from multiwrite.bench.floor_kernel import empty_kernel

    x = torch.zeros(1, device=device)
    for _ in range(3):
        empty_kernel[(1,)](x)  # compile outside every timed region
    synchronize(device)
    return lambda: empty_kernel[(1,)](x)


def launches(backend, device: torch.device) -> int:
    """Kernel launches `backend` (a Triton backend) has issued on `device` so far, every launcher counted."""
    state = backend.device_state(device)
    return state.apply_launcher.launches + state.stage_launcher.launches + state.consume_launcher.launches


def same_loop(trace: Trace, device, steps: int, warmup: int, concurrency: list[int], empty, tick) -> list[dict]:
    """The same-loop measurement (module docstring) for G1 and G3 at each concurrency."""
    clock = time.perf_counter_ns
    rows = []
    for c in concurrency:
        for config in ("G1", "G3"):
            bs, kbs = CONFIGS[config]
            schedule = list(replay_steps(trace, bs, c, steps))
            runners = []
            for launcher in LAUNCH_VARIANTS:
                backend = new_triton_backend(launcher=launcher)
                tables = BlockTables(bs, c, max_blocks_per_group(bs), device, kbs, backend=backend)
                runners.append((launcher, backend, tables, ([], [], []), [0, 0]))
            gc.collect()
            gc.disable()
            try:
                for i, calls in enumerate(schedule):
                    k = i % len(runners)
                    for _, backend, tables, (step_us, apply_us, empty_us), counted in runners[k:] + runners[:k]:
                        before = launches(backend, tables.device)
                        t0, t1, t2 = timed_step(tables, calls, clock)
                        synchronize(device)
                        t3 = clock()
                        empty()
                        t4 = clock()
                        synchronize(device)
                        if i >= warmup and calls:
                            step_us.append((t2 - t0) / 1e3)
                            apply_us.append((t2 - t1) / 1e3)
                            empty_us.append((t4 - t3) / 1e3)
                            counted[0] += launches(backend, tables.device) - before
                            counted[1] += 1
                    tick(1)
            finally:
                gc.enable()
            reference = ReferenceBlockTables(bs, c, max_blocks_per_group(bs), kbs)
            for calls in schedule:
                for req, ids, ow in calls:
                    reference.append_block_ids(req, ids, ow)
            for launcher, backend, tables, (step_us, apply_us, empty_us), counted in runners:
                a, s, e = (statistics.median(x) if x else float("nan") for x in (apply_us, step_us, empty_us))
                rows.append({
                    "config": config, "C": c, "launcher": launcher, "steps": len(apply_us),
                    "apply_us": a, "step_us": s, "empty_us": e, "apply_x_empty": a / e, "step_x_empty": s / e,
                    "apply_p99_us": float(np.percentile(apply_us, 99)) if apply_us else float("nan"),
                    "launches_per_apply": counted[0] / counted[1] if counted[1] else float("nan"),
                    "launch_path": backend.launch_paths(), "mismatches": count_mismatches(tables, reference),
                })  # fmt: skip
    return rows


def _median_us(fn: Callable[[], object], n: int, device, sync_every: int = 50) -> float:
    times = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        fn()
        times.append((clock() - t0) / 1e3)
        if i % sync_every == sync_every - 1:
            synchronize(device)
    synchronize(device)
    return statistics.median(times)


def tight_loop(device, n: int, concurrency: list[int], empty) -> list[dict]:
    """The tight-loop measurement (module docstring), per concurrency."""
    rows = []
    for c in concurrency:
        backend, batches = capture_decode(device, c)
        for _ in range(10):  # compile, bind the launcher, use every ring slot once
            backend.apply(batches)
        synchronize(device)
        empty_us = _median_us(empty, n, device)
        apply_us = _median_us(lambda w=backend, b=batches: w.apply(b), n, device)
        rows.append({"config": "G3", "C": c, "writes": sum(b.num_writes for b in batches), "apply_us": apply_us,
                     "empty_us": empty_us, "apply_x_empty": apply_us / empty_us})  # fmt: skip
    return rows


def device_behind_sleep(device, reps: int, concurrency: list[int], burst: tuple[int, int], empty) -> dict[str, float]:
    """The device measurement (module docstring); empty off GPUs."""
    if device.type != "cuda":
        return {}

    def timed(fn: Callable[[], object], ahead_s: float = 100e-6) -> float:
        ts = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(ahead_s * 2.0e9))  # ~2 GHz clock: the exact figure does not matter
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) * 1e3)
        return statistics.median(ts)

    out = {"empty kernel": timed(empty)}
    for c in concurrency:
        backend, batches = capture_decode(device, c)
        for _ in range(10):
            backend.apply(batches)
        synchronize(device)
        out[f"G3 decode apply, C={c}"] = timed(lambda w=backend, b=batches: w.apply(b))
    backend, batches, nbytes = capture_burst(device, *burst)
    for _ in range(3):
        backend.apply(batches)
    synchronize(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out["prefill burst apply"] = timed(lambda: backend.apply(batches), 20e-3)  # its host memcpy comes first
    out["pinned H2D copy of the burst's bytes"] = timed(lambda: dst.copy_(src, non_blocking=True), 1e-3)
    return out


def measure_launch(trace: Trace, device, steps: int, warmup: int, concurrency: list[int], tight_n: int,
                   burst: tuple[int, int], tick) -> LaunchResult:  # fmt: skip
    """All three measurements of the module docstring on `device` (`triton-cuda` must be able to run)."""
    empty = empty_launcher(device)
    result = LaunchResult()
    result.same_loop = same_loop(trace, device, steps, warmup, concurrency, empty, tick)
    result.tight_loop = tight_loop(device, tight_n, concurrency, empty)
    result.device = device_behind_sleep(device, max(5, tight_n // 10), concurrency, burst, empty)
    result.launch_path = result.same_loop[0]["launch_path"] if result.same_loop else ""
    return result
