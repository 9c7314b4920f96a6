"""`multiwrite bench --model`: its options, the checks before the run, and the run (`multiwrite.bench.model_step`).

Imports only argparse and `multiwrite.cli.args` at the top, as `multiwrite.cli.bench` does.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from multiwrite.cli.args import RefusedError, UsageError, positive_int

#: The presets of `--model-preset` (`multiwrite.bench.model.PRESETS`), named here so that `--help` stays light.
PRESET_NAMES = ("llama-8b", "small", "tiny")
#: What `--quick --model` runs unless `--model-preset`, `--model-steps` or `--concurrency` say otherwise: on a CPU
#: the tiny preset with sdpa-gathered attention (FlexAttention unfused reads every page of the cache at each step),
#: everywhere this many scheduler steps at one concurrency (about a minute on the 2-core CPU machine, the quick
#: bench before it included; at C=256 a tiny step takes there about 5x one at C=40).
QUICK_CPU_PRESET = "tiny"
QUICK_MODEL_STEPS = 40
QUICK_MODEL_CONCURRENCY = [40]
ATTENTION_NAMES = ("auto", "flex-paged", "sdpa-gathered")

MODEL_HELP = (
    "also time a decode step of a model-shaped stack with random weights whose layers write K/V through the slot "
    "mappings and attend through the gathered block tables (FlexAttention), on G1 tables at each --concurrency, and "
    "the block-table stage of each design in the same run (prepare_inputs, graph mode, vLLM's call pattern through "
    "multiwrite.vllm; on a GPU also on vLLM 0.33's own class where it loads, and the three-launch anchor); reports "
    "each design's share of TPOT, eager (stage host time + the step's eager wall time) and graph (stage host time + "
    "replay launch + the replay's device time, synchronous scheduling), and whether the host work hides behind "
    "the previous step's device time under async scheduling (computed from the medians, and on a GPU measured: "
    "each step one design runs its stage right after a replay is launched). The step leaves "
    "out embedding, rotary embeddings, final norm, LM head, sampling and collectives"
)


@dataclass
class ModelOptions:
    """What `--model` runs: the preset's name, the attention implementation, scheduler steps, warm-up steps and the
    concurrencies; `chosen`: the line saying what `--quick` chose in place of the defaults (empty when it chose
    nothing)."""

    preset: str
    attention: str
    steps: int
    warmup: int
    concurrency: list[int]
    chosen: str = ""


def add_model_options(p: argparse.ArgumentParser) -> None:
    """`--model`, `--model-preset`, `--attention`, `--model-steps` on the `bench` parser."""
    p.add_argument("--model", action="store_true", help=MODEL_HELP)
    p.add_argument(
        "--model-preset",
        choices=PRESET_NAMES,
        help="the stack of --model: llama-8b (Llama-3-8B's shape: 32 layers, hidden 4096, 32/8 heads of 128, MLP "
        "14336; default on a GPU), small (about 1B: 16 layers, hidden 2048, 32/8 heads of 64, MLP 8192; default "
        "on a CPU), tiny (tests; default of --quick on a CPU)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_NAMES,
        default="auto",
        help="attention of --model: flex-paged (auto: FlexAttention with a BlockMask over the gathered tables, "
        "compiled; unfused for the tiny preset on a CPU) or the sdpa-gathered fallback (pages gathered through the "
        "tables, then SDPA); if flex-paged fails at its warm-up the run falls back and says why",
    )
    p.add_argument(
        "--model-steps",
        type=positive_int,
        help="scheduler steps of --model per concurrency (default: --steps; 40 with --quick, at C=40 only unless "
        "--concurrency is given); the model runs on the decode steps after --warmup",
    )


def model_options(args: argparse.Namespace, steps: Any, device: Any) -> ModelOptions | None:
    """The `--model` options (None without `--model`), checked; `steps` is the bench's `BenchOptions`.

    Raises:
        UsageError: `--model-preset`, `--attention` or `--model-steps` without `--model`, or no step to measure.
        RefusedError: the weights and KV caches would not fit in the device's (a CPU's: the host's) memory.
    """
    if not args.model:
        given = [o for o, v in (("--model-preset", args.model_preset), ("--model-steps", args.model_steps)) if v]
        given += ["--attention"] if args.attention != "auto" else []
        if given:
            raise UsageError(f"argument {given[0]}: only with --model")
        return None
    preset = args.model_preset or ("llama-8b" if device.type == "cuda" else "small")
    model_steps = args.model_steps or steps.steps
    chosen = []
    if args.quick and not args.model_preset and device.type != "cuda":
        preset = QUICK_CPU_PRESET
        chosen.append(f"--model-preset {preset}")
    if args.quick and not args.model_steps:
        model_steps = QUICK_MODEL_STEPS
        chosen.append(f"--model-steps {model_steps}")
    concurrency = steps.concurrency
    if args.quick and not args.concurrency:
        concurrency = QUICK_MODEL_CONCURRENCY
        chosen.append(f"--concurrency {','.join(map(str, concurrency))} for --model")
    attention = args.attention
    if args.quick and attention == "auto" and device.type != "cuda":  # (unfused flex-paged reads the whole cache)
        attention = "sdpa-gathered"
        chosen.append(f"--attention {attention}")
    note = f"--quick --model: {', '.join(chosen)} (a smoke test; give these options to choose)" if chosen else ""
    opts = ModelOptions(preset, attention, model_steps, steps.warmup, list(concurrency), note)
    if opts.warmup >= opts.steps:
        raise UsageError(f"argument --model-steps: {opts.warmup} warm-up steps leave none of {opts.steps} to measure")
    refuse_if_it_cannot_fit(opts, args.trace, device)
    return opts


def refuse_if_it_cannot_fit(opts: ModelOptions, trace_path: str | None, device: Any) -> None:
    """Raise `RefusedError` when the largest concurrency's weights and KV caches exceed the free memory."""
    from multiwrite.bench.model import PRESETS
    from multiwrite.bench.model_step import memory_needed, num_pages
    from multiwrite.cli.args import refuse_if_too_big
    from multiwrite.workload import load_trace

    trace = load_trace(trace_path)
    shape = PRESETS[opts.preset]
    worst = max(opts.concurrency, key=lambda c: num_pages(trace, c, opts.steps))
    need = memory_needed(shape, num_pages(trace, worst, opts.steps), device)
    try:
        refuse_if_too_big(f"--model --model-preset {opts.preset} at --concurrency {worst}", 0, need, device)
    except RefusedError as exc:
        raise RefusedError(f"{exc} (weights and KV caches of every layer; try fewer --model-steps or C)") from None


def run_model(opts: ModelOptions, trace, device, backend, tick):
    """Run `bench.model_step.measure_model` for `opts`."""
    from multiwrite.bench.model import PRESETS
    from multiwrite.bench.model_step import measure_model

    return measure_model(trace, device, backend, PRESETS[opts.preset], opts.steps, opts.warmup, opts.concurrency,
                         opts.attention, tick)  # fmt: skip


def model_plot_path(path: str) -> str:
    """Where `--plot PATH` puts the `--model` figure: `bench.png` -> `bench-model.png`."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-model{ext or '.png'}"
