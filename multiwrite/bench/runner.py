"""The measurements of `multiwrite bench`: trace replay through every variant, and the prefill burst.

Timing follows the project's performance anchors (BENCHMARKS.md): per step, host time
(`time.perf_counter_ns`) of staging plus apply and of apply alone; the device is synchronized after each
step, outside the timed region; warm-up steps are skipped; statistics are over the remaining steps with
at least one write. The variants (and floors) take turns within each step, in an order that rotates from
step to step, so that drift and noise of the machine reach all of them alike; the garbage collector is
off while timing (as in `timeit`), so that one variant's garbage is never collected on another's clock.
On a GPU, a second pass with fresh tables times each apply on the device with CUDA events; it is separate
so that recording events never adds to the host times of the first pass.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import torch

from multiwrite.bench.variants import VARIANTS, Mismatch, Snapshot, TablesSpec, compare, floors
from multiwrite.environment import synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import CONFIGS, StagedCall, Trace, max_blocks_per_group, replay_steps

Tick = Callable[[int], None]
T = TypeVar("T")


@dataclass(frozen=True)
class Stats:
    """Median and 99th percentile of `n` samples, microseconds (nan when `n == 0`)."""

    median_us: float
    p99_us: float
    n: int

    @classmethod
    def of(cls, samples_us: Sequence[float]) -> Stats:
        """Statistics of samples given in microseconds."""
        if not len(samples_us):
            return cls(math.nan, math.nan, 0)
        a = np.asarray(samples_us, dtype=np.float64)
        return cls(float(np.median(a)), float(np.percentile(a, 99)), int(a.size))


@dataclass
class VariantResult:
    """One variant (or floor) on one configuration.

    Attributes:
        step: host time per step, staging plus apply, microseconds (None for a floor: it stages nothing).
        apply: host time per apply, microseconds.
        device: device time per apply from CUDA events, microseconds (None off GPUs).
        verified: its final tables equal the reference (None for a floor, which writes nothing).
        mismatch: how they differ, when they do.
    """

    variant: str
    step: Stats | None
    apply: Stats
    device: Stats | None = None
    verified: bool | None = None
    mismatch: Mismatch | None = None


@dataclass
class ConfigResult:
    """Every variant on one configuration (`G1`..`G4`) at one concurrency.

    Attributes:
        steps: scheduler steps replayed (fewer than asked when the trace ran out).
        writes_per_step: median `append_block_ids` calls per measured step.
        floor: name of the floor the fused/floor ratios use (`floor` on CPU, `floor-triton` on a GPU).
    """

    config: str
    concurrency: int
    steps: int
    writes_per_step: float
    variants: dict[str, VariantResult] = field(default_factory=dict)
    floor: str = "floor"

    def ratio(self, metric: str, other: str) -> float:
        """Median `metric` (`"step"` or `"apply"`) of fused over that of `other`; a floor's step is its apply."""
        fused, o = self.variants["fused"], self.variants[other]
        num = getattr(fused, metric)
        den = getattr(o, metric) or o.apply
        return num.median_us / den.median_us if den.median_us > 0 else math.nan


@dataclass
class BurstResult:
    """The prefill burst: `requests` new requests x 3 groups (G3) x `ids_per_group` manager ids, one step.

    Attributes:
        bytes_written: kernel block ids written per apply x 4 bytes.
        stage: host time of staging the burst, microseconds.
        apply: host time of apply plus device synchronize, microseconds.
        copy: the same bytes through a plain copy (`copy_name`), synchronized, microseconds.
    """

    requests: int
    ids_per_group: int
    bytes_written: int
    stage: Stats
    apply: Stats
    copy: Stats
    copy_name: str
    verified: bool
    mismatch: Mismatch | None = None

    @property
    def apply_bytes_per_s(self) -> float:
        """Effective bandwidth of the fused apply, bytes/s (median time)."""
        return self.bytes_written / (self.apply.median_us * 1e-6)

    @property
    def copy_bytes_per_s(self) -> float:
        """Bandwidth of the plain copy, bytes/s (median time)."""
        return self.bytes_written / (self.copy.median_us * 1e-6)


def launch_paths(backend: object) -> str:
    """How `backend`'s kernels launched, for a backend that says (`launch_paths()`: the Triton backends), else ""."""
    paths = getattr(backend, "launch_paths", None)
    return str(paths()) if callable(paths) else ""


def rotations(runners: list[T]) -> list[list[T]]:
    """Every rotation of `runners`: step i runs them in the order `rotations(runners)[i % len(runners)]`."""
    return [runners[k:] + runners[:k] for k in range(len(runners))]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off for the duration (after a collection), as it was afterwards: no design's garbage
    is collected on another's clock."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_host(
    runners: list, schedule: list[list[StagedCall]], warmup: int, device: torch.device, tick: Tick
) -> dict[str, tuple[list[float], list[float]]]:
    """Replay `schedule` through every runner; per runner, host times of measured steps in microseconds:
    (staging plus apply, apply alone)."""
    samples: dict[str, tuple[list[float], list[float]]] = {r.name: ([], []) for r in runners}
    orders = rotations(runners)
    clock = time.perf_counter_ns
    with gc_paused():
        for i, calls in enumerate(schedule):
            measured = i >= warmup and bool(calls)
            for r in orders[i % len(orders)]:
                t0 = clock()
                r.stage(calls)
                t1 = clock()
                r.apply()
                t2 = clock()
                synchronize(device)
                if measured:
                    step_us, apply_us = samples[r.name]
                    step_us.append((t2 - t0) / 1e3)
                    apply_us.append((t2 - t1) / 1e3)
            tick(1)
    return samples


def time_device(
    runners: list, schedule: list[list[StagedCall]], warmup: int, device: torch.device, tick: Tick
) -> dict[str, list[float]]:
    """GPU only: replay `schedule` again; per runner, device time of each measured apply, microseconds,
    between CUDA events recorded just before and after it."""
    events = {r.name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for r in runners}
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    orders = rotations(runners)
    for i, calls in enumerate(schedule):
        measured = i >= warmup and bool(calls)
        for r in orders[i % len(orders)]:
            start, end = events[r.name]
            r.stage(calls)
            start.record()
            r.apply()
            end.record()
            end.synchronize()
            if measured:
                samples[r.name].append(start.elapsed_time(end) * 1e3)
        tick(1)
    return samples


def measure_config(
    trace: Trace,
    config: str,
    concurrency: int,
    steps: int,
    warmup: int,
    device: torch.device,
    backend: str | None,
    tick: Tick,
) -> ConfigResult:
    """Replay `steps` scheduler steps of configuration `config` through every variant and floor, timed, then
    check each variant's final tables against `ReferenceBlockTables` fed the same calls."""
    block_sizes, kernel_block_sizes = CONFIGS[config]
    widths = max_blocks_per_group(block_sizes)
    schedule = list(replay_steps(trace, block_sizes, concurrency, steps))
    reference = ReferenceBlockTables(block_sizes, concurrency, widths, kernel_block_sizes)
    for calls in schedule:
        for req, ids, overwrite in calls:
            reference.append_block_ids(req, ids, overwrite)
    gpu = device.type == "cuda"
    passes = 2 if gpu else 1

    def make_variants() -> list:
        spec = TablesSpec(block_sizes, kernel_block_sizes, concurrency, widths, device, backend)
        return [cls(spec) for cls in VARIANTS]

    variants = make_variants()
    floor_runners = floors(device, variants[0].tables.backend)
    host = time_host(variants + floor_runners, schedule, warmup, device, tick)
    mismatches = {v.name: compare(v.snapshot(), reference) for v in variants}
    dev: dict[str, list[float]] = {}
    if gpu:
        variants2 = make_variants()
        dev = time_device(variants2 + floor_runners, schedule, warmup, device, tick)
        for v in variants2:
            mismatches[v.name] = mismatches[v.name] or compare(v.snapshot(), reference)
    tick((steps - len(schedule)) * passes)  # the trace ran out: finish this configuration's share of the bar
    measured = [len(c) for i, c in enumerate(schedule) if i >= warmup and c]
    result = ConfigResult(
        config,
        concurrency,
        len(schedule),
        float(np.median(measured)) if measured else math.nan,
        floor=floor_runners[0].name,
    )
    for r in variants + floor_runners:
        step_us, apply_us = host[r.name]
        is_floor = r.name.startswith("floor")
        result.variants[r.name] = VariantResult(
            r.name,
            None if is_floor else Stats.of(step_us),
            Stats.of(apply_us),
            Stats.of(dev[r.name]) if gpu else None,
            None if is_floor else mismatches[r.name] is None,
            None if is_floor else mismatches[r.name],
        )
    return result


def burst_calls(requests: int, ids_per_group: int, num_groups: int) -> list[StagedCall]:
    """Overwrites of `requests` rows, each with `ids_per_group` distinct manager ids (>= 1) per group."""
    n = ids_per_group
    return [
        (r, [list(range(1 + (g * requests + r) * n, 1 + (g * requests + r + 1) * n)) for g in range(num_groups)], True)
        for r in range(requests)
    ]


def _burst_expected(requests: int, n: int, ks: list[int]) -> SimpleNamespace:
    """What the burst's tables must hold, built with numpy (the per-cell reference is slow at this size)."""
    tables = []
    for g, k in enumerate(ks):
        ids = 1 + (g * requests + np.arange(requests)[:, None]) * n + np.arange(n)[None, :]
        tables.append((ids[:, :, None] * k + np.arange(k)).reshape(requests, n * k))
    num_blocks = np.asarray([[n * k] * requests for k in ks])
    return SimpleNamespace(tables=tables, num_blocks=num_blocks)


def measure_burst(
    requests: int, ids_per_group: int, reps: int, device: torch.device, backend: str | None, tick: Tick
) -> BurstResult:
    """Stage the burst (G3 block sizes) and apply it `reps` times (after 2 untimed), each timed up to a
    device synchronize; in between, a plain copy of the same bytes (pinned host-to-device with
    `non_blocking=True` on a GPU, `numpy.copyto` on a CPU), timed the same way."""
    block_sizes, kernel_block_sizes = CONFIGS["G3"]
    tables = BlockTables(block_sizes, requests, [ids_per_group] * 3, device, kernel_block_sizes, backend=backend)
    ks = tables.kernel_blocks_per_block
    calls = burst_calls(requests, ids_per_group, len(block_sizes))
    cells = requests * ids_per_group * sum(ks)
    copy: Callable[[], object]
    if device.type == "cuda":
        src = torch.arange(cells, dtype=torch.int32).pin_memory()
        dst = torch.empty(cells, dtype=torch.int32, device=device)
        copy, copy_name = (lambda: dst.copy_(src, non_blocking=True)), "pinned-h2d-copy"
    else:
        src_np, dst_np = np.arange(cells, dtype=np.int32), np.empty(cells, dtype=np.int32)
        copy, copy_name = (lambda: np.copyto(dst_np, src_np)), "numpy-copy"
    clock = time.perf_counter_ns
    stage_us: list[float] = []
    apply_us: list[float] = []
    copy_us: list[float] = []
    for rep in range(-2, reps):
        synchronize(device)
        t0 = clock()
        for req, ids, overwrite in calls:
            tables.append_block_ids(req, ids, overwrite)
        t1 = clock()
        tables.apply_staged_writes()
        synchronize(device)
        t2 = clock()
        copy()
        synchronize(device)
        t3 = clock()
        if rep >= 0:
            stage_us.append((t1 - t0) / 1e3)
            apply_us.append((t2 - t1) / 1e3)
            copy_us.append((t3 - t2) / 1e3)
            tick(1)
    snap = Snapshot(
        [t.tensor.cpu().numpy() for t in tables.block_tables],
        tables.num_blocks.copy(),
        tables.num_blocks_device.cpu().numpy(),
    )
    mismatch = compare(snap, _burst_expected(requests, ids_per_group, ks))
    return BurstResult(
        requests,
        ids_per_group,
        cells * 4,
        Stats.of(stage_us),
        Stats.of(apply_us),
        Stats.of(copy_us),
        copy_name,
        mismatch is None,
        mismatch,
    )


@dataclass
class BenchResult:
    """Everything one `multiwrite bench` run measured, and what it ran on.

    Attributes:
        timestamp: ISO 8601, local time with its offset, when the run started.
        env: `environment.environment(device)`: versions, device and its name, torch threads.
        backend: name of the backend the fused and per-group variants used.
        trace: where the trace came from, and its number of requests.
        interpreted: the backend ran its kernels through Triton's interpreter (`TRITON_INTERPRET=1` on a
            CPU device): its times measure the interpreter, so no goal is judged.
        quick: fewer steps or burst repetitions than the goals were set on (`--quick`, or smaller
            options): the goal verdicts are indicative only.
    """

    timestamp: str
    env: dict[str, str]
    backend: str
    trace: str
    steps: int
    warmup: int
    configs: list[ConfigResult] = field(default_factory=list)
    burst: BurstResult | None = None
    interpreted: bool = False
    quick: bool = False
    launch: Any = None  # a `bench.launch.LaunchResult` with --launch
    stage: Any = None  # a `bench.stage.StageResult` with --stage
    model: Any = None  # a `bench.model_step.ModelResult` with --model

    @property
    def gpu(self) -> bool:
        """True when the run was on a CUDA or ROCm device."""
        return self.env["device"].startswith("cuda")

    def failures(self) -> list[str]:
        """One line per variant whose final tables differed from the reference (empty: all verified)."""
        out = []
        for c in self.configs:
            for v in c.variants.values():
                if v.mismatch is not None:
                    out.append(
                        f"{v.variant} {c.config} C={c.concurrency}: {v.mismatch.cells} cells differ from the "
                        f"reference; first: {v.mismatch.first}"
                    )
        if self.burst is not None and self.burst.mismatch is not None:
            m = self.burst.mismatch
            out.append(f"fused prefill burst: {m.cells} cells differ from the expected tables; first: {m.first}")
        if self.launch is not None:
            out += self.launch.failures()
        if self.stage is not None:
            out += self.stage.failures()
        if self.model is not None:
            out += self.model.failures()
        return out


def memory_needed(opts, device: torch.device) -> tuple[int, int, str]:
    """(host bytes, device bytes, the options responsible) of the largest part of a run of `opts` (a
    `multiwrite.cli.bench.BenchOptions`), about: the configurations run one after another, so the largest counts.

    Per configuration: the int32 tables of every variant (twice on a GPU: the device pass uses fresh
    ones), the int64 reference, host snapshots. The burst: its int32 tables, the staged values (grown
    by doubling), the Python lists of manager ids (about 36 bytes an id), the int64 expected tables, a
    snapshot, and the copy's source and destination.
    """
    gpu = device.type == "cuda"
    parts: list[tuple[int, int, str]] = []
    for config in opts.configs:
        block_sizes, kbs = CONFIGS[config]
        widths = max_blocks_per_group(block_sizes)
        cells = sum(w * (bs // k) for w, bs, k in zip(widths, block_sizes, kbs)) + len(block_sizes)
        for c in opts.concurrency:
            tables = c * cells * 4 * len(VARIANTS) * (2 if gpu else 1)
            host = c * cells * (8 + 4 * len(VARIANTS))
            parts.append((host, tables, f"--concurrency {c} (configuration {config})"))
    if opts.burst_reps:
        ids = opts.burst_requests * opts.burst_ids * 3
        cells = opts.burst_requests * opts.burst_ids * sum(bs // k for bs, k in zip(*CONFIGS["G3"]))
        host = ids * (36 + 8) + cells * (8 + 4 + 8 + 4)
        parts.append((host, cells * 8, f"--burst-requests {opts.burst_requests} --burst-ids {opts.burst_ids}"))

    def total(p: tuple[int, int, str]) -> int:
        return p[0] + p[1]

    return max(parts, key=total) if parts else (0, 0, "")
