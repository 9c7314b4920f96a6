"""`multiwrite bench --stage`: the whole block-table stage of a decode step, next to one empty launch.

Per step of the trace-replay workload (G3, or with `--groups` each configuration of the sweep: `bench.groups`; each
concurrency), each design stages the step's `append_block_ids`
calls and runs the step's whole block-table stage (apply the writes, gather the scheduled rows, compute the
slot mappings), timed on the host up to its return; the device is then synchronized, and one empty launch
(`floor`: an empty Triton kernel on a GPU, one empty backend call on a CPU) is timed in the same loop after the
same synchronize, as in BENCHMARKS.md's anchors of the stage. The designs take turns in a rotating order.
Statistics are over the decode steps (every scheduled request computes one token) after the warm-up; every
step runs through every design, prefill chunks included, so the tables evolve as in serving.

The step's inputs (`idx_mapping`, `query_start_loc`, `positions`) are written into persistent device buffers
before the timed region, as an engine's input buffers are; no padding rows or tokens. The step's
`append_block_ids` arguments are built afresh right before each design's timed region (`Design.prepare`), as an
engine's model runner receives them (vLLM's worker deserializes the scheduler output of the step), not reused
from the schedule built at the start of the run, whose objects sit cold in memory by then.

Designs (`STAGE_VARIANTS`):
- `ours`: `BlockTables.prepare_inputs` (on `triton-cuda`/`triton-rocm`: apply, gather and slot mappings in ONE
  launch);
- `ours-3-calls`: `apply_staged_writes`, `gather_block_tables`, `compute_slot_mappings` (three calls);
- `anchor-3`: our apply, then the anchor gather and slot-mapping kernels (`bench.anchor_kernels`, vLLM's v2
  model-runner design: three launches); GPU only;
- `anchor-2`: our apply, then the anchor's fused gather + slot mapping (vllm-project/vllm PR #34660: two
  launches); GPU only;
- `graph-mode`: `BlockTables(..., cuda_graphs=True)` with `prepare_inputs` captured once per concurrency C in a
  CUDA graph, over input buffers of its own padded to C requests and `TOKEN_BUDGET` tokens (outside the timed
  region). Timed per step: staging plus `commit_staged_writes()` (which publishes the step's batch with the
  ticket of the next replay), the host's whole work per step in graph mode (launches: "0 (replay)"); the step's
  inputs are then written into its buffers and the graph replayed (`torch.cuda.CUDAGraph.replay`: the consume
  kernel applies the committed batch, the stage kernel gathers and maps), outside the timed region, before the
  synchronize. Off a GPU, on a backend with a graph mode (the Triton backends through Triton's interpreter), the
  capture is `multiwrite.capture.simulated_capture` and the replay its `SimulatedGraph.replay()`: verified, its
  times those of the interpreter. Goal (GPU): at most 0.5 empty launch per decode step.
- `ours-batched`, `graph-mode-batched`: the same, with the step staged by ONE `append_block_ids_batch` call (its
  three lists built before the timed region) instead of a Python loop of `append_block_ids` calls.
- `vllm-3-calls`: vLLM 0.33's call pattern through `multiwrite.vllm.BlockTables` (a loop of `append_block_ids`,
  then `apply_staged_writes`, `gather_block_tables`, `compute_slot_mappings`: three launches), with vLLM's block
  sizes as kernel block sizes (kernel block = block, G3's widths);
- `vllm-0.33`: the same calls on vLLM 0.33's own `BlockTables` (`multiwrite.vllm.upstream`: an installed vLLM, or
  its two files from `MULTIWRITE_VLLM_SRC` / `MULTIWRITE_VLLM_WHEEL`); GPU only. Its buffers take vLLM's CUDA path
  (UVA: pinned host memory its kernels read in place) where it works, else vLLM's fallback (explicit copies), and
  the report names it by its path: `vllm-0.33-uva` or `vllm-0.33-fallback` (with the reason).

Every design's gathered rows (the cells each step defines) and slot mappings are checked against
`multiwrite.reference` on a few steps, and its final tables at the end.
"""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.bench.groups import STAGE_CONFIGS, describe, sweep_rows
from multiwrite.bench.runner import gc_paused, rotations
from multiwrite.bench.stage_designs import (
    STAGE_CONFIG,
    STAGE_VARIANTS,
    AnchorDesign,
    Design,
    GraphMode,
    GraphModeBatched,
    Ours,
    OursBatched,
    StepBuffers,
    Vllm033,
    VllmThreeCalls,
)
from multiwrite.bench.variants import compare
from multiwrite.environment import synchronize
from multiwrite.errors import BackendUnavailableError
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import TOKEN_BUDGET, Trace, max_blocks_per_group, replay_schedule

#: Why the anchor kernels are not timed off a GPU.
ANCHORS_OFF_GPU = (
    "anchor-3 and anchor-2 not run: their kernels are Triton kernels, which off a GPU run through Triton's "
    "interpreter and would time the interpreter, not the design"
)
#: Why vLLM's own class is not timed off a GPU.
VLLM_OFF_GPU = (
    "vllm-0.33 not run: vLLM 0.33's kernels are Triton kernels, which off a GPU run through Triton's interpreter"
)
#: Why graph mode is not run off a GPU on a backend without a graph mode.
GRAPH_MODE_OFF_GPU = (
    "graph-mode not run: it replays prepare_inputs captured in a CUDA graph (BlockTables(..., cuda_graphs=True)), "
    "which needs a CUDA GPU, or off a GPU a backend with a graph mode (triton-cuda or triton-rocm through Triton's "
    "interpreter, replayed by a simulated capture); {backend} has none"
)
#: The graph-mode goal: host time per step (staging + commit) in empty launches.
GRAPH_MODE_GOAL = 0.5


@dataclass
class StageResult:
    """What `measure_stage` measured: one dict per (C, design) in `rows`; designs not run and why in `skipped`."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    floor: str = ""

    def failures(self) -> list[str]:
        """One line per design whose outputs or tables differed from the reference."""
        return [f"stage {r['label']} {r['config']} C={r['C']}: {r['mismatch']}" for r in self.rows if r["mismatch"]]


def _check(runner: Design, x: StepBuffers, ref: ReferenceBlockTables) -> str:
    """ "" when the runner's gathered cells of this step and its slot mappings equal the reference's, else why."""
    rows, qsl, pos = x.host
    zero = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, rows, x.n, zero)
    slots = compute_slot_mappings_reference(ref.tables, runner.kernel_block_sizes, rows, qsl, pos, x.T)
    gathered, got_slots = runner.outputs(x)
    for g, (got, exp) in enumerate(zip(gathered, want)):
        got = got.cpu().numpy()
        counts = ref.num_blocks[g, rows]
        defined = np.arange(got.shape[1])[None, :] < counts[:, None]  # the cells this step's gather defines
        bad = np.argwhere(defined & (got != exp))
        if bad.size:
            b, c = (int(i) for i in bad[0])
            return f"group {g} gathered[{b}, {c}] = {got[b, c]}, reference {exp[b, c]}"
    got_slots = got_slots.cpu().numpy()
    bad = np.argwhere(got_slots != slots)
    if bad.size:
        g, i = (int(v) for v in bad[0])
        return f"slot_mappings[{g}, {i}] = {got_slots[g, i]}, reference {slots[g, i]}"
    return ""


def build_designs(
    variants: Sequence[type[Design]],
    device: torch.device,
    backend: str | None,
    concurrency: int,
    skipped: list[str],
    config: str = STAGE_CONFIG,
) -> list[Design]:
    """The designs of `variants` that can run on configuration `config` at C = `concurrency`; for each one that
    cannot (e.g. graph mode on a backend without one) a line saying why is appended to `skipped` (once)."""
    runners: list[Design] = []
    for v in variants:
        try:
            runners.append(v(device, backend, concurrency, TOKEN_BUDGET, config))
        except BackendUnavailableError as exc:
            reason = f"{v.name} not run: {exc}"
            if issubclass(v, GraphMode) and device.type != "cuda":
                reason = GRAPH_MODE_OFF_GPU.format(backend=runners[0].bt.backend.NAME if runners else backend)
            if reason not in skipped:
                skipped.append(reason)
    return runners


def time_stage(r: Design, calls: object, x: StepBuffers, device: torch.device) -> float:
    """Host time, us, of design `r`'s stage of one step: staging `calls` (from `r.prepare`) and `r.run(x)`, timed;
    then its untimed device work (`r.after(x)`) and a synchronize."""
    clock = time.perf_counter_ns
    t0 = clock()
    r.stage(calls)
    r.run(x)
    t1 = clock()
    r.after(x)
    synchronize(device)
    return (t1 - t0) / 1e3


def measure_stage(
    trace: Trace,
    device: torch.device,
    backend: str | None,
    steps: int,
    warmup: int,
    concurrency: Sequence[int],
    empty: Callable[[], object],
    floor: str,
    tick: Callable[[int], None],
    checks: int = 4,
    configs: Sequence[str] = (STAGE_CONFIG,),
) -> StageResult:
    """The measurement of the module docstring at each configuration of `configs` (names of
    `bench.groups.STAGE_CONFIGS`) and concurrency; `empty` is the floor's one call."""
    result = StageResult(floor=floor)
    variants: list[type[Design]] = list(STAGE_VARIANTS)
    if device.type != "cuda":
        variants = [v for v in variants if not issubclass(v, (AnchorDesign, Vllm033))]
        result.skipped.append(ANCHORS_OFF_GPU)
        result.skipped.append(VLLM_OFF_GPU)
    for config in configs:
        for c in concurrency:
            _measure_one(result, trace, device, backend, steps, warmup, config, c, variants, empty, tick, checks)
    return result


def _measure_one(result, trace, device, backend, steps, warmup, config, c, variants, empty, tick, checks) -> None:
    """`measure_stage` at one configuration and concurrency: its rows appended to `result`."""
    clock = time.perf_counter_ns
    bs, kbs = STAGE_CONFIGS[config]
    schedule = list(replay_schedule(trace, bs, c, steps))
    runners = build_designs(variants, device, backend, c, result.skipped, config)
    refs = {tuple(k): ReferenceBlockTables(bs, c, max_blocks_per_group(bs), k)
            for k in {tuple(r.kernel_block_sizes) for r in runners} | {tuple(kbs)}}  # fmt: skip
    x = StepBuffers(device, c, TOKEN_BUDGET)
    measured = [i for i, s in enumerate(schedule) if i >= warmup and s.is_decode]
    stride = max(1, len(measured) // max(checks, 1))
    check_at = set(measured[::stride][:checks]) | set(measured[-1:])
    samples = {r.name: ([], []) for r in runners}
    mismatch = {r.name: "" for r in runners}
    orders = rotations(runners)
    with gc_paused():
        for i, step in enumerate(schedule):
            x.load(step)
            synchronize(device)
            timed = i in measured
            for r in orders[i % len(orders)]:
                stage_us = time_stage(r, r.prepare(step.calls), x, device)
                t2 = clock()
                empty()
                t3 = clock()
                synchronize(device)
                if timed:
                    samples[r.name][0].append(stage_us)
                    samples[r.name][1].append((t3 - t2) / 1e3)
            for ref in refs.values():
                for req, ids, overwrite in step.calls:
                    ref.append_block_ids(req, ids, overwrite)
                ref.apply_staged_writes()
            if i in check_at:
                for r in runners:
                    mismatch[r.name] = mismatch[r.name] or _check(r, x, refs[tuple(r.kernel_block_sizes)])
            tick(1)
    tick(steps - len(schedule))
    for r in runners:
        final = compare(r.snapshot(), refs[tuple(r.kernel_block_sizes)])
        if final is not None and not mismatch[r.name]:
            mismatch[r.name] = f"final tables: {final.cells} cells differ; first: {final.first}"
        step_us, empty_us = samples[r.name]
        writes = float(np.median([len(schedule[i].calls) for i in measured])) if measured else math.nan
        s = float(np.median(step_us)) if step_us else math.nan
        e = float(np.median(empty_us)) if empty_us else math.nan
        result.rows.append({
            "config": config, "C": c, "variant": r.name, "label": r.label, "path": r.path, "launches": r.launches,
            "steps": len(step_us), "writes_per_step": writes,
            "step_us": s, "step_p99_us": float(np.percentile(step_us, 99)) if step_us else math.nan,
            "empty_us": e, "step_x_empty": s / e if e > 0 else math.nan, "mismatch": mismatch[r.name],
            "launch_path": r.launch_path(),
        })  # fmt: skip
        note_path(r, result.skipped)


def note_path(r: Design, notes: list[str]) -> None:
    """Where design `r` ran vLLM's fallback buffers instead of its UVA path, a line saying why appended to `notes`
    (once)."""
    if r.path == "fallback" and (note := f"{r.label}: vLLM's buffers without UVA, because {r.why}") not in notes:
        notes.append(note)


#: What the two paths of vLLM's own class are, for the report.
PATHS = (
    "vllm-0.33-uva: vLLM's CUDA path (pinned host buffers its kernels read in place through a CUDA view; "
    "multiwrite.vllm.upstream.cuda_view_of_pinned stands in for vLLM's compiled get_cuda_view_from_cpu_tensor); "
    "vllm-0.33-fallback: its path without UVA (explicit host-to-device copies)"
)


def stage_lines(r: StageResult, gpu: bool, format_table: Callable) -> list[str]:
    """The `--stage` section of the terminal report (`format_table`: `bench.report`'s): a table per configuration,
    and with several configurations the sweep (`bench.groups.sweep_rows`)."""
    what = "one empty Triton launch" if gpu else "one empty backend call"
    configs = list(dict.fromkeys(x["config"] for x in r.rows)) or [STAGE_CONFIG]
    head = (
        f"stage (--stage): host time per decode step, staging + apply + gather + slot mappings, {', '.join(configs)}, "
        f"next to {what} ({r.floor}) timed in the same loop after the same synchronize; median (p99) us, lower is "
        "better; x: ratio of medians"
    )
    legend = (
        "ours: prepare_inputs; ours-3-calls: apply, gather_block_tables, compute_slot_mappings; anchor-3: our "
        "apply + vLLM-style gather and slot-mapping kernels; anchor-2: our apply + fused gather/slot mapping "
        "(vllm-project/vllm PR #34660); graph-mode: prepare_inputs captured in a CUDA graph (off a GPU: a simulated "
        "capture), timed: staging + commit_staged_writes (the replay runs untimed); -batched: the step staged by one "
        "append_block_ids_batch call instead of a loop of append_block_ids; vllm-3-calls: vLLM 0.33's call pattern "
        "through multiwrite.vllm.BlockTables (kernel block = block); vllm-0.33: the same calls on vLLM 0.33's own "
        "BlockTables"
    )
    out = ["", textwrap.fill(head, 110), textwrap.fill(legend, 110, initial_indent="  ", subsequent_indent="  ")]
    if any(x["path"] for x in r.rows):
        out.append(textwrap.fill(PATHS, 110, initial_indent="  ", subsequent_indent="  "))
    for config in configs:
        out.append(textwrap.fill(describe(config), 110, initial_indent="  ", subsequent_indent="    "))
        out += format_table(
            ["C", "design", "launches", "decode steps", "writes/step", "step", "empty", "step x empty", "verified"],
            [[str(x["C"]), x["label"], x["launches"], str(x["steps"]), f"{x['writes_per_step']:g}",
              f"{x['step_us']:.1f} ({x['step_p99_us']:.1f})", f"{x['empty_us']:.1f}", f"{x['step_x_empty']:.2f}",
              "no" if x["mismatch"] else "yes"] for x in r.rows if x["config"] == config],
        )  # fmt: skip
    if len(configs) > 1:
        heads, rows = sweep_rows(r.rows)
        out += ["", f"  the group sweep: step x empty per number of KV-cache groups, and its change ({heads[-1]})"]
        out += format_table(heads, rows)
    out += [f"  {s}" for s in r.skipped]
    return out


def stage_goal_lines(r: StageResult, gpu: bool, interpreted: bool) -> list[str]:
    """The stage goal of BENCHMARKS.md: eager prepare_inputs <= 2 empty launches per decode step, C=40 and 256."""
    if interpreted or not gpu:
        return [
            "GPU stage goal (prepare_inputs <= 2 empty launches per decode step): not measured on this run",
            f"GPU graph-mode goal (staging + commit_staged_writes <= {GRAPH_MODE_GOAL} empty launch per decode step): "
            "not measured on this run",
        ]
    lines = []
    checks = [(Ours, 2, "prepare_inputs, staging included"), (OursBatched, 1.2, "prepare_inputs, batched staging"),
              (VllmThreeCalls, 1.5, "vLLM's three calls, a loop of append_block_ids")]  # fmt: skip
    checks += [
        (GraphMode, 0.4, "a loop of append_block_ids + commit_staged_writes; the replay not counted"),
        (GraphModeBatched, GRAPH_MODE_GOAL, "batched staging + commit_staged_writes; the replay not counted"),
    ]
    for design, goal, what in checks:
        for c in (40, 256):
            row = next((x for x in r.rows if x["variant"] == design.name and x["C"] == c
                        and x["config"] == STAGE_CONFIG), None)  # fmt: skip
            if row is None:
                lines.append(f"GPU {design.name} at C={c} G3 <= {goal} empty launches: not in this run")
                continue
            x = row["step_x_empty"]
            verdict = "not measured" if not math.isfinite(x) else "met" if x <= goal else f"missed by {x / goal:.1f}x"
            lines.append(f"GPU {design.name} ({what}) at C={c} G3 = {x:.2f} empty launches; goal <= {goal}: {verdict}")
    return lines


def stage_csv_rows(r: StageResult, base: dict[str, str]) -> list[dict[str, str]]:
    """`--csv` rows of the stage part: per (configuration, C, design) `stage_step_us` and `stage_empty_us`; the
    variant is `stage-<label>` (vLLM's own class with its path: `stage-vllm-0.33-uva`)."""
    rows = []
    for x in r.rows:
        for metric, median, p99 in (("stage_step_us", x["step_us"], x["step_p99_us"]),
                                    ("stage_empty_us", x["empty_us"], math.nan)):  # fmt: skip
            rows.append({
                **base, "variant": f"stage-{x['label']}", "config": x["config"], "concurrency": str(x["C"]),
                "metric": metric, "median_us": f"{median:.3f}", "p99_us": f"{p99:.3f}", "n": str(x["steps"]),
                "verified": "false" if x["mismatch"] else "true", "bytes": "",
            })  # fmt: skip
    return rows
