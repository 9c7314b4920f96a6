"""`multiwrite bench --stage`: the whole block-table stage of a decode step, next to one empty launch.

Per step of the trace-replay workload (G3, each concurrency), each design stages the step's `append_block_ids`
calls and runs the step's whole block-table stage (apply the writes, gather the scheduled rows, compute the
slot mappings), timed on the host up to its return; the device is then synchronized, and one empty launch
(`floor`: an empty Triton kernel on a GPU, one empty backend call on a CPU) is timed in the same loop after the
same synchronize, as in BENCHMARKS.md's anchors of the stage. The designs take turns in a rotating order.
Statistics are over the decode steps (every scheduled request computes one token) after the warm-up; every
step runs through every design, prefill chunks included, so the tables evolve as in serving.

The step's inputs (`idx_mapping`, `query_start_loc`, `positions`) are written into persistent device buffers
before the timed region, as an engine's input buffers are; no padding rows or tokens. The step's
`append_block_ids` arguments are built afresh right before each design's timed region (`_Runner.prepare`), as an
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

Every design's gathered rows (the cells each step defines) and slot mappings are checked against
`multiwrite.reference` on a few steps, and its final tables at the end.
"""

from __future__ import annotations

import gc
import math
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from multiwrite.bench.runner import launch_paths
from multiwrite.bench.variants import Snapshot, compare
from multiwrite.capture import simulated_capture
from multiwrite.environment import synchronize
from multiwrite.errors import BackendUnavailableError
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import CONFIGS, TOKEN_BUDGET, ScheduledStep, Trace, max_blocks_per_group, replay_schedule

#: The configuration the stage goals are set on (BENCHMARKS.md).
STAGE_CONFIG = "G3"
#: Why the anchor kernels are not timed off a GPU.
ANCHORS_OFF_GPU = (
    "anchor-3 and anchor-2 not run: their kernels are Triton kernels, which off a GPU run through Triton's "
    "interpreter and would time the interpreter, not the design"
)
#: Why graph mode is not run off a GPU on a backend without a graph mode.
GRAPH_MODE_OFF_GPU = (
    "graph-mode not run: it replays prepare_inputs captured in a CUDA graph (BlockTables(..., cuda_graphs=True)), "
    "which needs a CUDA GPU, or off a GPU a backend with a graph mode (triton-cuda or triton-rocm through Triton's "
    "interpreter, replayed by a simulated capture); {backend} has none"
)
#: The graph-mode goal: host time per step (staging + commit) in empty launches.
GRAPH_MODE_GOAL = 0.5


class _Inputs:
    """The step's inputs in persistent device buffers, and views of this step's length."""

    def __init__(self, device: torch.device, max_reqs: int, max_tokens: int):
        self.idx_buf = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.qsl_buf = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.pos_buf = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    def load(self, step: ScheduledStep) -> None:
        rows = np.asarray(step.rows, dtype=np.int32)
        tokens = np.asarray(step.tokens, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        pos = np.concatenate([np.arange(s, s + t) for s, t in zip(step.starts, step.tokens)] or [np.zeros(0)])
        self.n, self.T = rows.shape[0], int(qsl[-1])
        self.idx_buf[: self.n].copy_(torch.from_numpy(rows))
        self.qsl_buf[: self.n + 1].copy_(torch.from_numpy(qsl))
        self.pos_buf[: self.T].copy_(torch.from_numpy(pos.astype(np.int64)))
        self.idx, self.qsl, self.pos = self.idx_buf[: self.n], self.qsl_buf[: self.n + 1], self.pos_buf[: self.T]
        self.host = (rows.tolist(), qsl.tolist(), pos.astype(np.int64).tolist())


class _Runner:
    name = ""
    launches = ""
    config = STAGE_CONFIG  # the tables' configuration (`bench.model_step` runs the designs on G1)

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int):
        bs, kbs = CONFIGS[self.config]
        self.bt = BlockTables(bs, concurrency, max_blocks_per_group(bs), device, kbs, backend=backend,
                              max_num_batched_tokens=max_tokens)  # fmt: skip
        self._append = self.bt.append_block_ids

    def prepare(self, calls):
        """Untimed, right before the step's staging: the step's calls as an engine's model runner receives them,
        freshly built (the scheduler output of this step, deserialized in the worker process in vLLM), not the
        objects the schedule built at the start of the run; returns what `stage` takes."""
        return [(req, [list(g) for g in ids], overwrite) for req, ids, overwrite in calls]

    def stage(self, calls) -> None:
        append = self._append
        for req, ids, overwrite in calls:
            append(req, ids, overwrite)

    def run(self, x: _Inputs) -> None:
        raise NotImplementedError

    def after(self, x: _Inputs) -> None:
        """Device work of the step that is not timed (graph mode's replay); enqueued before the synchronize."""

    def outputs(self, x: _Inputs) -> tuple[list[torch.Tensor], torch.Tensor]:
        assert self.bt.slot_mappings is not None
        return [t[: x.n] for t in self.bt.input_block_tables], self.bt.slot_mappings[:, : x.T]


class Ours(_Runner):
    """`prepare_inputs`: the whole stage in one backend call."""

    name, launches = "ours", "1"

    def run(self, x: _Inputs) -> None:
        self.bt.prepare_inputs(x.idx, x.qsl, x.pos, x.n, x.T)


class _Batched:
    """Staging through ONE `append_block_ids_batch` call per step (the step's calls as three lists, built before
    the timed region: an engine holds them as lists already) instead of a Python loop of `append_block_ids`."""

    bt: BlockTables

    def prepare(self, calls):
        return [c[0] for c in calls], [[list(g) for g in c[1]] for c in calls], [c[2] for c in calls]

    def stage(self, lists) -> None:
        self.bt.append_block_ids_batch(*lists)


class OursBatched(_Batched, Ours):
    """`ours` with the step staged by one `append_block_ids_batch` call."""

    name = "ours-batched"


class OursThreeCalls(_Runner):
    """Our three calls: apply, gather, slot mappings."""

    name, launches = "ours-3-calls", "3"

    def run(self, x: _Inputs) -> None:
        bt = self.bt
        bt.apply_staged_writes()
        bt.gather_block_tables(x.idx, x.n)
        bt.compute_slot_mappings(x.idx, x.qsl, x.pos, x.T)


class _Anchor(_Runner):
    fused = False

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int):
        super().__init__(device, backend, concurrency, max_tokens)
        from multiwrite.bench.anchor_kernels import AnchorStage

        self.anchor = AnchorStage(self.bt, max_tokens, fused=self.fused)

    def run(self, x: _Inputs) -> None:
        self.bt.apply_staged_writes()
        self.anchor.run(x.idx, x.qsl, x.pos)

    def outputs(self, x: _Inputs) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t[: x.n] for t in self.anchor.input_block_tables], self.anchor.slot_mappings[:, : x.T]


class Anchor3(_Anchor):
    """Our apply, then the anchor gather and slot-mapping kernels (vLLM's v2 model runner's design)."""

    name, launches, fused = "anchor-3", "3", False


class Anchor2(_Anchor):
    """Our apply, then the anchor fused gather + slot mapping (vllm-project/vllm PR #34660)."""

    name, launches, fused = "anchor-2", "2", True


class Replayable(Protocol):
    """A captured graph: `torch.cuda.CUDAGraph`, or a `multiwrite.capture.SimulatedGraph`."""

    def replay(self) -> None: ...


def capture(device: torch.device, record: Callable[[], object]) -> Replayable:
    """`record()` captured into a graph to replay (`graph.replay()`): a CUDA graph on a GPU, else a simulated capture
    (`multiwrite.capture.simulated_capture`: CPU tables on a backend whose launches it records)."""
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            record()
        return graph
    with simulated_capture() as simulated:
        record()
    return simulated


class GraphMode(_Runner):
    """Graph mode: `prepare_inputs` captured once in a graph (`capture`); per step staging +
    `commit_staged_writes()` timed, then the step's inputs written into the captured buffers and the graph
    replayed (not timed)."""

    name, launches = "graph-mode", "0 (replay)"

    def __init__(self, device: torch.device, backend: str | None, concurrency: int, max_tokens: int):
        bs, kbs = CONFIGS[self.config]
        self.bt = BlockTables(bs, concurrency, max_blocks_per_group(bs), device, kbs, backend=backend,
                              max_num_batched_tokens=max_tokens, cuda_graphs=True)  # fmt: skip
        self._append = self.bt.append_block_ids
        self._commit = self.bt.commit_staged_writes
        # Persistent inputs padded to the bucket: `concurrency` entries (unused ones: row 0, no tokens) and
        # `max_tokens` tokens (the unscheduled ones marked as padding).
        self.idx = torch.zeros(concurrency, dtype=torch.int32, device=device)
        self.qsl = torch.zeros(concurrency + 1, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.pad = torch.ones(max_tokens, dtype=torch.bool, device=device)
        self._tokens = torch.arange(max_tokens, device=device)
        args = (self.idx, self.qsl, self.pos, concurrency, max_tokens, self.pad)
        self.bt.prepare_inputs(*args)  # compiles the kernels for these buffers: nothing compiles inside the capture
        synchronize(device)
        self.graph = capture(device, lambda: self.bt.prepare_inputs(*args))
        synchronize(device)

    def run(self, x: _Inputs) -> None:
        self._commit()

    def after(self, x: _Inputs) -> None:
        n, T = x.n, x.T
        self.idx[:n].copy_(x.idx)
        self.idx[n:].zero_()
        self.qsl[: n + 1].copy_(x.qsl)
        self.qsl[n + 1 :].fill_(T)
        self.pos[:T].copy_(x.pos)
        torch.ge(self._tokens, T, out=self.pad)
        self.graph.replay()


class GraphModeBatched(_Batched, GraphMode):
    """`graph-mode` with the step staged by one `append_block_ids_batch` call."""

    name = "graph-mode-batched"


#: The designs, in the order the report prints them.
STAGE_VARIANTS = (Ours, OursBatched, OursThreeCalls, Anchor3, Anchor2, GraphMode, GraphModeBatched)


@dataclass
class StageResult:
    """What `measure_stage` measured: one dict per (C, design) in `rows`; designs not run and why in `skipped`."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    floor: str = ""

    def failures(self) -> list[str]:
        """One line per design whose outputs or tables differed from the reference."""
        return [f"stage {r['variant']} {r['config']} C={r['C']}: {r['mismatch']}" for r in self.rows if r["mismatch"]]


def _check(runner: _Runner, x: _Inputs, ref: ReferenceBlockTables) -> str:
    """ "" when the runner's gathered cells of this step and its slot mappings equal the reference's, else why."""
    rows, qsl, pos = x.host
    zero = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, rows, x.n, zero)
    slots = compute_slot_mappings_reference(ref.tables, runner.bt.kernel_block_sizes, rows, qsl, pos, x.T)
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
) -> StageResult:
    """The measurement of the module docstring at each concurrency; `empty` is the floor's one call."""
    result = StageResult(floor=floor)
    variants: list[type[_Runner]] = list(STAGE_VARIANTS)
    if device.type != "cuda":
        variants = [v for v in variants if not issubclass(v, _Anchor)]
        result.skipped.append(ANCHORS_OFF_GPU)
    clock = time.perf_counter_ns
    bs, kbs = CONFIGS[STAGE_CONFIG]
    for c in concurrency:
        schedule = list(replay_schedule(trace, bs, c, steps))
        runners = []
        for v in variants:
            try:
                runners.append(v(device, backend, c, TOKEN_BUDGET))
            except BackendUnavailableError as exc:  # e.g. graph mode on a backend without one
                reason = f"{v.name} not run: {exc}"
                if issubclass(v, GraphMode) and device.type != "cuda":
                    reason = GRAPH_MODE_OFF_GPU.format(backend=runners[0].bt.backend.NAME if runners else backend)
                if reason not in result.skipped:
                    result.skipped.append(reason)
        ref = ReferenceBlockTables(bs, c, max_blocks_per_group(bs), kbs)
        x = _Inputs(device, c, TOKEN_BUDGET)
        measured = [i for i, s in enumerate(schedule) if i >= warmup and s.is_decode]
        stride = max(1, len(measured) // max(checks, 1))
        check_at = set(measured[::stride][:checks]) | set(measured[-1:])
        samples = {r.name: ([], []) for r in runners}
        mismatch = {r.name: "" for r in runners}
        orders = [runners[k:] + runners[:k] for k in range(len(runners))]
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for i, step in enumerate(schedule):
                x.load(step)
                synchronize(device)
                timed = i in measured
                for r in orders[i % len(orders)]:
                    calls = r.prepare(step.calls)
                    t0 = clock()
                    r.stage(calls)
                    r.run(x)
                    t1 = clock()
                    r.after(x)
                    synchronize(device)
                    t2 = clock()
                    empty()
                    t3 = clock()
                    synchronize(device)
                    if timed:
                        samples[r.name][0].append((t1 - t0) / 1e3)
                        samples[r.name][1].append((t3 - t2) / 1e3)
                for req, ids, overwrite in step.calls:
                    ref.append_block_ids(req, ids, overwrite)
                ref.apply_staged_writes()
                if i in check_at:
                    for r in runners:
                        mismatch[r.name] = mismatch[r.name] or _check(r, x, ref)
                tick(1)
        finally:
            if was_enabled:
                gc.enable()
        tick(steps - len(schedule))
        for r in runners:
            bt = r.bt
            snap = Snapshot([t.tensor.cpu().numpy() for t in bt.block_tables], bt.num_blocks.copy(),
                            bt.num_blocks_device.cpu().numpy())  # fmt: skip
            final = compare(snap, ref)
            if final is not None and not mismatch[r.name]:
                mismatch[r.name] = f"final tables: {final.cells} cells differ; first: {final.first}"
            step_us, empty_us = samples[r.name]
            writes = float(np.median([len(schedule[i].calls) for i in measured])) if measured else math.nan
            s = float(np.median(step_us)) if step_us else math.nan
            e = float(np.median(empty_us)) if empty_us else math.nan
            result.rows.append({
                "config": STAGE_CONFIG, "C": c, "variant": r.name, "launches": r.launches, "steps": len(step_us),
                "writes_per_step": writes,
                "step_us": s, "step_p99_us": float(np.percentile(step_us, 99)) if step_us else math.nan,
                "empty_us": e, "step_x_empty": s / e if e > 0 else math.nan, "mismatch": mismatch[r.name],
                "launch_path": launch_paths(bt.backend),
            })  # fmt: skip
    return result


def stage_lines(r: StageResult, gpu: bool, format_table: Callable) -> list[str]:
    """The `--stage` section of the terminal report (`format_table`: `bench.report`'s)."""
    what = "one empty Triton launch" if gpu else "one empty backend call"
    head = (
        f"stage (--stage): host time per decode step, staging + apply + gather + slot mappings, {STAGE_CONFIG}, next "
        f"to {what} ({r.floor}) timed in the same loop after the same synchronize; median (p99) us, lower is "
        "better; x: ratio of medians"
    )
    legend = (
        "ours: prepare_inputs; ours-3-calls: apply, gather_block_tables, compute_slot_mappings; anchor-3: our "
        "apply + vLLM-style gather and slot-mapping kernels; anchor-2: our apply + fused gather/slot mapping "
        "(vllm-project/vllm PR #34660); graph-mode: prepare_inputs captured in a CUDA graph (off a GPU: a simulated "
        "capture), timed: staging + commit_staged_writes (the replay runs untimed); -batched: the step staged by one "
        "append_block_ids_batch call instead of a loop of append_block_ids"
    )
    out = ["", textwrap.fill(head, 110), textwrap.fill(legend, 110, initial_indent="  ", subsequent_indent="  ")]
    out += format_table(
        ["C", "design", "launches", "decode steps", "writes/step", "step", "empty", "step x empty", "verified"],
        [[str(x["C"]), x["variant"], x["launches"], str(x["steps"]), f"{x['writes_per_step']:g}",
          f"{x['step_us']:.1f} ({x['step_p99_us']:.1f})", f"{x['empty_us']:.1f}", f"{x['step_x_empty']:.2f}",
          "no" if x["mismatch"] else "yes"] for x in r.rows],
    )  # fmt: skip
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
    checks = [(d, 2, "prepare_inputs, staging included") for d in (Ours, OursBatched)]
    checks += [(d, GRAPH_MODE_GOAL, "staging + commit_staged_writes per step; the replay not counted")
               for d in (GraphMode, GraphModeBatched)]  # fmt: skip
    for design, goal, what in checks:
        for c in (40, 256):
            row = next((x for x in r.rows if x["variant"] == design.name and x["C"] == c), None)
            if row is None:
                lines.append(f"GPU {design.name} at C={c} G3 <= {goal} empty launches: not in this run")
                continue
            x = row["step_x_empty"]
            verdict = "not measured" if not math.isfinite(x) else "met" if x <= goal else f"missed by {x / goal:.1f}x"
            lines.append(f"GPU {design.name} ({what}) at C={c} G3 = {x:.2f} empty launches; goal <= {goal}: {verdict}")
    return lines


def stage_csv_rows(r: StageResult, base: dict[str, str]) -> list[dict[str, str]]:
    """`--csv` rows of the stage part: per (C, design) `stage_step_us` and `stage_empty_us`."""
    rows = []
    for x in r.rows:
        for metric, median, p99 in (("stage_step_us", x["step_us"], x["step_p99_us"]),
                                    ("stage_empty_us", x["empty_us"], math.nan)):  # fmt: skip
            rows.append({
                **base, "variant": f"stage-{x['variant']}", "config": x["config"], "concurrency": str(x["C"]),
                "metric": metric, "median_us": f"{median:.3f}", "p99_us": f"{p99:.3f}", "n": str(x["steps"]),
                "verified": "false" if x["mismatch"] else "true", "bytes": "",
            })  # fmt: skip
    return rows
