"""`multiwrite bench --model`: the block-table stage inside a decode step of a model-shaped stack, in TPOT.

Per concurrency C, the trace-replay workload's schedule (`workload.replay_schedule`, one KV-cache group: G1, block
size 16, as a Llama has) runs step by step. Every step, prefill chunks included, goes through every stage design
of `bench.stage` (the same objects, on G1 tables; timed on the host as `--stage` times them, in rotating order), so
that the tables evolve as in serving. On each decode step after the warm-up, the model step then runs on the
`ours` design's outputs: a `bench.model.DecoderStack` whose layers write K/V through the slot mappings and attend
through the gathered block tables (`bench.paged_attention`), timed
- eager: host wall time from the call to the end of a synchronize (`eager_wall_us`; `eager_host_us`: to the
  call's return, the host's share of it);
- graph: the step captured once per C in a CUDA graph (a GPU), its replay timed with CUDA events (`graph_device_us`)
  and the replay call on the host (`replay_host_us`).
Padding: the step is shaped for C batch entries (a graph's bucket); entries past the step's batch have no query.

Figures per design d, from medians over the measured steps (what a step leaves out: `model.py`'s docstring):
- eager TPOT(d) = stage host time(d) + eager wall: an eager engine's host runs the stage, then the step;
- graph TPOT(d) = stage host time(d) + replay host + graph device time: synchronous scheduling, the host runs the
  stage, then launches the replay and waits;
- share = stage host time / TPOT;
- async scheduling (the host prepares step n + 1 while the device runs step n): the host work of a step, stage host
  time(d) + replay host, hides iff it is below the graph device time; `margin` = device time - host work. Measured
  too where there is a graph: each measured step, one design in turn runs its stage right after a replay is
  launched (`_Model.stage_behind_replay`), instead of in the synchronous rotation.
The graph-mode design's captured stage (its consume and stage kernels, a few us of device time: BENCHMARKS.md) is
replayed in a graph of its own, not timed, and not added to the model's graph.

Checked on a few decode steps: every design's gathered rows and slot mappings against `multiwrite.reference`
(`bench.stage`), then in layer 0 that every token's K and V sit exactly at the slot the reference tables give, and
each entry's attention output against dense attention over the history the reference tables address (relative
error at most `TOLERANCE[dtype]`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from multiwrite.bench.model import DecoderStack, ModelShape, model_dtype
from multiwrite.bench.paged_attention import DESCRIPTIONS, PagedAttention, PagedBatch, dense_attention
from multiwrite.bench.runner import gc_paused, rotations
from multiwrite.bench.stage import _check, build_designs, note_path, time_stage
from multiwrite.bench.stage_designs import (
    Anchor3,
    Design,
    GraphMode,
    Ours,
    StepBuffers,
    Vllm033,
    VllmThreeCalls,
    capture,
)
from multiwrite.environment import synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import CONFIGS, TOKEN_BUDGET, Trace, max_blocks_per_group, replay_schedule

#: The model's KV-cache group configuration: one group of block size 16.
MODEL_CONFIG = "G1"
#: Largest relative error (max |paged - dense| / max |dense| per entry) the attention check accepts, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def designs(device: torch.device) -> tuple[list[type[Design]], list[str]]:
    """The stage designs of the model bench on `device` (built on G1 tables), and a line for each one left out."""
    out: list[type[Design]] = [Ours, GraphMode, VllmThreeCalls]
    skipped: list[str] = []
    if device.type == "cuda":
        out += [Vllm033, Anchor3]  # (vllm-0.33 is skipped, with its reason, where vLLM is absent)
    else:
        skipped.append(
            "anchor-3 and vllm-0.33 not run: their kernels are Triton kernels, which off a GPU would time the "
            "interpreter"
        )
    return out, skipped


def num_pages(trace: Trace, concurrency: int, steps: int) -> int:
    """KV-cache pages the run's schedule addresses at C = `concurrency`: the largest block id + 1, the dump block
    not counted (G1: kernel block = block)."""
    bs, _ = CONFIGS[MODEL_CONFIG]
    top = 0
    for step in replay_schedule(trace, bs, concurrency, steps):
        for _, ids, _ in step.calls:
            if ids[0]:
                top = max(top, max(ids[0]))
    return top + 1


def memory_needed(shape: ModelShape, pages: int, device: torch.device) -> int:
    """Bytes of the run's weights and KV caches on `device` (activations and the tables not counted)."""
    dtype = model_dtype(device)
    size = torch.empty(0, dtype=dtype).element_size()
    bs = CONFIGS[MODEL_CONFIG][0][0]
    return shape.params() * size + (pages + 1) * bs * shape.kv_bytes_per_slot(dtype)


@dataclass
class ModelResult:
    """What `measure_model` measured: per C one dict in `steps` (the model step), per (C, design) one in `rows`
    (the stage); `skipped`: designs not run and why; `attention`: the implementation that ran (and why not the
    first choice, in `fallback`)."""

    shape: ModelShape
    dtype: str
    attention: str = ""
    fallback: str = ""
    steps: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """One line per design or model step whose check failed."""
        out = [f"model stage {r['label']} C={r['C']}: {r['mismatch']}" for r in self.rows if r["mismatch"]]
        return out + [f"model step C={s['C']}: {s['mismatch']}" for s in self.steps if s["mismatch"]]


class _Model:
    """The decoder stack on `ours`' persistent outputs, its padded step inputs, and its graph."""

    def __init__(self, shape, ours: Design, c: int, pages: int, device, attention: PagedAttention):
        bs = CONFIGS[MODEL_CONFIG][1][0]
        dtype = model_dtype(device)
        self.device, self.c = device, c
        self.stack = DecoderStack(shape, pages * bs, bs, device, dtype, attention)
        self.gathered = ours.bt.input_block_tables[0][:c]
        self.slots = ours.bt.slot_mappings[0, :c]
        self.batch = PagedBatch(c, self.gathered.shape[1], 1, bs, pages * bs, device)
        self.q_pos = torch.full((c, 1), -1, dtype=torch.int64, device=device)
        self.x = torch.randn(c, shape.hidden, device=device, dtype=dtype)
        self.graph: Any = None  # a `torch.cuda.CUDAGraph` once captured
        self._events: tuple[Any, Any] | None = None
        self._async_events: tuple[Any, ...] | None = None

    def load(self, positions: Sequence[int]) -> None:
        """The step's query positions (entries past the batch: -1), before the step runs."""
        pos = np.full((self.c, 1), -1, dtype=np.int64)
        pos[: len(positions), 0] = positions
        self.q_pos.copy_(torch.from_numpy(pos))

    def step(self, record: bool = False) -> torch.Tensor:
        self.batch.update(self.gathered, self.q_pos)
        return self.stack.forward(self.x, self.slots, self.batch, record)

    def capture(self) -> None:
        """The step captured in a CUDA graph (a GPU; elsewhere no graph: `graph` stays None)."""
        if self.device.type == "cuda":
            self.graph = capture(self.device, self.step)

    def stage_behind_replay(self, design: Design, calls: Any, x: StepBuffers) -> dict[str, float]:
        """Async scheduling, measured: replay the graph (the previous decode step's model: its inputs are still in
        place; rewriting its K/V is idempotent), then at once run `design`'s stage of this step (staging `calls` and
        `run(x)`, timed; then `after(x)`, its untimed device work) while the device is busy, then synchronize.

        Returns `hidden` (1.0 when the host had issued the stage before the device could have finished the replay:
        host time from the replay call to the stage's return below the replay's device time), `exposed_us` (device
        time from the replay's end to the stage's end: the stage's own kernels when hidden, more when the device
        waited for the host; a GPU) and `busy_host_us` (the stage's host time with the device busy)."""
        clock = time.perf_counter_ns
        cuda = self.device.type == "cuda"
        if cuda and self._async_events is None:
            self._async_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        events = self._async_events if cuda else None
        if events:
            events[0].record()
        t0 = clock()
        self.graph.replay()
        if events:
            events[1].record()
        t1 = clock()
        design.stage(calls)
        design.run(x)
        t2 = clock()
        design.after(x)
        if events:
            events[2].record()
        synchronize(self.device)
        t3 = clock()
        if events:
            device = events[0].elapsed_time(events[1]) * 1e3
            exposed = events[1].elapsed_time(events[2]) * 1e3
        else:  # (off a GPU the replay runs to its end before the stage: nothing overlaps)
            device, exposed = (t1 - t0) / 1e3, (t3 - t1) / 1e3
        return {"hidden": float((t2 - t0) / 1e3 < device), "exposed_us": exposed, "busy_host_us": (t2 - t1) / 1e3}

    def timed_replay(self) -> tuple[float, float]:
        """Replay the graph: (host time of the replay call, device time of the replay), us; the device time from
        CUDA events on a GPU, else the wall time to the end of a synchronize."""
        assert self.graph is not None
        clock = time.perf_counter_ns
        if self.device.type != "cuda":
            t0 = clock()
            self.graph.replay()
            t1 = clock()
            synchronize(self.device)
            return (t1 - t0) / 1e3, (clock() - t0) / 1e3
        if self._events is None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        start, end = self._events
        start.record()
        t0 = clock()
        self.graph.replay()
        t1 = clock()
        end.record()
        synchronize(self.device)
        return (t1 - t0) / 1e3, start.elapsed_time(end) * 1e3


def _check_model(model: _Model, ref: ReferenceBlockTables, rows: Sequence[int], starts: Sequence[int]) -> str:
    """ "" when layer 0's K/V sit at the reference slots and its attention matches dense attention, else why."""
    rec, stack = model.stack.recorded, model.stack
    bs = CONFIGS[MODEL_CONFIG][1][0]
    tol = TOLERANCE[rec["q"].dtype]
    k_cache, v_cache = stack.k_caches[0], stack.v_caches[0]
    for b, (row, p) in enumerate(zip(rows, starts)):
        table = torch.from_numpy(ref.tables[0][row, : p // bs + 1].astype(np.int64)).to(model.device)
        pos = torch.arange(p + 1, device=model.device)
        slots = table[pos // bs] * bs + pos % bs
        if not (torch.equal(k_cache[:, slots[-1]], rec["k"][b]) and torch.equal(v_cache[:, slots[-1]], rec["v"][b])):
            return f"layer 0: entry {b} (row {row}, position {p}): its K/V is not at slot {int(slots[-1])}"
        k, v = k_cache[:, slots].transpose(0, 1).clone(), v_cache[:, slots].transpose(0, 1).clone()
        k[-1], v[-1] = rec["k"][b], rec["v"][b]
        want = dense_attention(rec["q"][b], k, v, pos[-1:])
        err = float((rec["out"][b].double() - want).abs().max() / want.abs().max().clamp(min=1e-30))
        if not err <= tol:
            return f"layer 0: entry {b} (row {row}, position {p}): attention relative error {err:.3g} > {tol:g}"
    return ""


def measure_model(
    trace: Trace,
    device: torch.device,
    backend: str | None,
    shape: ModelShape,
    steps: int,
    warmup: int,
    concurrency: Sequence[int],
    attention: str,
    tick: Callable[[int], None],
    checks: int = 3,
    tamper: Callable | None = None,
) -> ModelResult:
    """The measurement of the module docstring at each concurrency. `tamper(step, gathered, slots)`, if given, may
    change `ours`' gathered table (int32 `[C, width]`) and slot mappings (int64 `[C]`) of a decode step before the
    model reads them (the tests plant wrong values through it)."""
    dtype = model_dtype(device)
    result = ModelResult(shape, str(dtype).replace("torch.", ""))
    kinds, result.skipped = designs(device)
    impl = PagedAttention(attention, compile=device.type == "cuda" or shape.compile_on_cpu)
    result.attention = impl.name
    clock = time.perf_counter_ns
    bs, kbs = CONFIGS[MODEL_CONFIG]
    for c in concurrency:
        schedule = list(replay_schedule(trace, bs, c, steps))
        runners = build_designs(kinds, device, backend, c, result.skipped, MODEL_CONFIG)
        model = _Model(shape, runners[0], c, num_pages(trace, c, steps), device, impl)
        ref = ReferenceBlockTables(bs, c, max_blocks_per_group(bs), kbs)
        x = StepBuffers(device, c, TOKEN_BUDGET)
        decode = [i for i, s in enumerate(schedule) if s.is_decode]
        measured = [i for i in decode if i >= warmup]
        stride = max(1, len(measured) // max(checks, 1))
        check_at = set(measured[::stride][:checks]) | set(measured[-1:])
        stage_us: dict[str, list[float]] = {r.name: [] for r in runners}
        overlap = {r.name: {"hidden": [], "exposed_us": [], "busy_host_us": []} for r in runners}
        turns = 0  # async turns so far: the designs take them in order
        mismatch = {r.name: "" for r in runners}
        t = {k: [] for k in ("eager_wall_us", "eager_host_us", "graph_device_us", "replay_host_us", "batch", "ctx")}
        model_mismatch = ""
        orders = rotations(runners)
        with gc_paused():
            for i, step in enumerate(schedule):
                x.load(step)
                synchronize(device)
                # One design per measured step (in turn) runs its stage behind the previous step's graph replay.
                behind = runners[turns % len(runners)] if model.graph is not None and i in measured else None
                turns += behind is not None
                for r in orders[i % len(orders)]:
                    calls = r.prepare(step.calls)
                    if r is behind:
                        a = model.stage_behind_replay(r, calls, x)
                        for k, value in a.items():
                            overlap[r.name][k].append(value)
                        continue
                    took = time_stage(r, calls, x, device)
                    if i in measured:
                        stage_us[r.name].append(took)
                for req, ids, overwrite in step.calls:
                    ref.append_block_ids(req, ids, overwrite)
                ref.apply_staged_writes()
                if i in decode:
                    if tamper is not None:
                        tamper(i, model.gathered, model.slots)
                    model.load(step.starts)
                    if not model.stack.recorded:  # the first decode step: warm up (compiles), then capture
                        result.attention, result.fallback = _warm_up(model, result)
                        try:
                            model.capture()
                        except Exception as exc:  # the graph figures are then not measured, and the report says why
                            model.graph = None
                            why = f"C={c}: the step could not be captured in a CUDA graph ({type(exc).__name__}: "
                            result.skipped.append(why + f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
                        synchronize(device)
                    t0 = clock()
                    model.step(record=i in check_at)
                    t1 = clock()
                    synchronize(device)
                    t2 = clock()
                    if i in check_at:
                        model_mismatch = model_mismatch or _check_model(model, ref, step.rows, step.starts)
                        for r in runners:
                            mismatch[r.name] = mismatch[r.name] or _check(r, x, ref)
                    if i in measured:
                        t["eager_host_us"].append((t1 - t0) / 1e3)
                        t["eager_wall_us"].append((t2 - t0) / 1e3)
                        t["batch"].append(len(step.rows))
                        t["ctx"].append(float(np.mean(step.starts)) + 1)
                    if model.graph is not None and i in measured:
                        host, dev = model.timed_replay()
                        t["replay_host_us"].append(host)
                        t["graph_device_us"].append(dev)
                tick(1)
        tick(steps - len(schedule))
        med = {k: float(np.median(v)) if v else math.nan for k, v in t.items()}
        pages = model.batch.num_pages
        result.steps.append({"C": c, "steps": len(t["batch"]), "mismatch": model_mismatch, "pages": pages, **med})
        for r in runners:
            s, a = stage_us[r.name], overlap[r.name]
            result.rows.append({
                "C": c, "variant": r.name, "label": r.label, "path": r.path, "launches": r.launches,
                "mismatch": mismatch[r.name],
                "stage_us": float(np.median(s)) if s else math.nan,
                "stage_p99_us": float(np.percentile(s, 99)) if s else math.nan, "n": len(s),
                "behind_n": len(a["hidden"]), "hidden_frac": float(np.mean(a["hidden"])) if a["hidden"] else math.nan,
                "exposed_us": float(np.median(a["exposed_us"])) if a["exposed_us"] else math.nan,
                "busy_host_us": float(np.median(a["busy_host_us"])) if a["busy_host_us"] else math.nan,
            })  # fmt: skip
            note_path(r, result.skipped)
        del model, runners
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _warm_up(model: _Model, result: ModelResult) -> tuple[str, str]:
    """Run the step three times (compiling FlexAttention where it is compiled); on a failure of `flex-paged`, switch
    to the `sdpa-gathered` fallback. Returns (the attention that runs, why the fallback, or "")."""
    attention = model.stack.attention
    try:
        for _ in range(3):
            model.step(record=True)
        synchronize(model.device)
        return attention.name, result.fallback
    except Exception as exc:
        if attention.impl != "flex-paged":
            raise
        why = f"flex-paged failed here ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
        model.stack.attention = PagedAttention("sdpa-gathered")
        for _ in range(3):
            model.step(record=True)
        synchronize(model.device)
        return f"sdpa-gathered ({DESCRIPTIONS['sdpa-gathered']})", why
