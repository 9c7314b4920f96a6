"""What `multiwrite bench --model` prints, writes to CSV and plots (the measurement: `bench.model_step`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path

from multiwrite.bench.model_step import ModelResult
from multiwrite.bench.stage import PATHS

#: What the TPOT figures assume and leave out, printed with them (report and plot).
ASSUMPTIONS = (
    "TPOT = time per output token of one decode step (every request of the batch gets one token). eager TPOT = "
    "stage host time + the step's eager wall time (the host runs the stage, then the step); graph TPOT = stage "
    "host time + replay host time + the replay's device time (synchronous scheduling: the host runs the stage, "
    "launches the replay, waits). share = stage host time / TPOT. hides (computed from the medians): the host "
    "work of a step (stage + replay launch) hides behind the previous step's device time iff it is shorter; "
    "margin = device time - host work. Async, measured (a GPU): each measured step, one design in turn runs its "
    "stage right after a replay is launched; hidden: the share of those steps whose stage returned before the "
    "replay could have ended; exposed: device time from the replay's end to the stage's end (the stage's own "
    "kernels when hidden). Eager: the step's ops run one by one, "
    "FlexAttention compiled where the attention says so. "
    "Left out of the step: embedding, rotary embeddings, final norm, LM head, sampling, collectives, the "
    "scheduler and input preparation other than the block-table stage; the graph-mode design's captured stage "
    "kernels are not added to the graph's device time. Random weights; trace sequence lengths."
)
#: The designs, in the order the report and the plot show them, with what each one is.
LEGEND = {
    "ours": "multiwrite prepare_inputs (staging + one launch)",
    "graph-mode": "multiwrite graph mode (staging + commit; the stage replays in a graph)",
    "vllm-3-calls": "multiwrite.vllm.BlockTables, vLLM's calls: append loop, apply, gather, slot mappings",
    "vllm-0.33": "vLLM 0.33's own BlockTables (multiwrite.vllm.upstream: an installed vLLM or its files), same calls, "
    "on vLLM's UVA path or its fallback (the design's name says which)",
    "anchor-3": "our apply + vLLM-style gather and slot-mapping kernels (three launches)",
}


def derived(result: ModelResult) -> list[dict]:
    """Per (C, design): the row of `result.rows` with `eager_tpot_us`, `eager_share`, `graph_tpot_us`,
    `graph_share`, `host_work_us`, `async_margin_us`, `hides` (None where not measured) added."""
    out = []
    for r in result.rows:
        s = next(x for x in result.steps if x["C"] == r["C"])
        d = dict(r)
        stage = r["stage_us"]
        eager = stage + s["eager_wall_us"] if r["variant"] != "graph-mode" else math.nan
        graph = stage + s["replay_host_us"] + s["graph_device_us"]
        host = stage + s["replay_host_us"]
        d.update(eager_tpot_us=eager, eager_share=stage / eager, graph_tpot_us=graph, graph_share=stage / graph,
                 host_work_us=host, async_margin_us=s["graph_device_us"] - host,
                 hides=None if not math.isfinite(graph) else host < s["graph_device_us"])  # fmt: skip
        out.append(d)
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.2f}%"


def _us(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1f}"


def model_lines(result: ModelResult, format_table: Callable) -> list[str]:
    """The `--model` section of the terminal report (`format_table`: `bench.report`'s)."""
    sh = result.shape
    head = (
        f"model (--model): a decode step of {sh.name} ({sh.what}: {sh.layers} layers, hidden {sh.hidden}, "
        f"{sh.q_heads}/{sh.kv_heads} heads of {sh.head_dim}, MLP {sh.mlp}; {_count(sh.params())} weights, "
        f"random; {result.dtype}), G1 tables (block size 16); attention: {result.attention}; times: medians over "
        "the measured decode steps, us, lower is better"
    )
    out = ["", textwrap.fill(head, 110)]
    if result.fallback:
        out.append(textwrap.fill(f"  fallback: {result.fallback}", 110, subsequent_indent="    "))
    out += format_table(
        ["C", "decode steps", "batch", "mean context", "eager wall", "eager host", "host / wall", "graph device",
         "replay host", "verified"],
        [[str(s["C"]), str(s["steps"]), f"{s['batch']:g}", f"{s['ctx']:.0f}", _us(s["eager_wall_us"]),
          _us(s["eager_host_us"]), f"{s['eager_host_us'] / s['eager_wall_us']:.2f}", _us(s["graph_device_us"]),
          _us(s["replay_host_us"]), "no" if s["mismatch"] else "yes"] for s in result.steps],
    )  # fmt: skip
    out.append(textwrap.fill(
        "  eager host: the step's host time to the return of its last launch; on a GPU, host / wall near 1 means the "
        "eager step is host-bound (the device waits for the host)", 110, subsequent_indent="    "))  # fmt: skip
    if any(not math.isfinite(s["graph_device_us"]) for s in result.steps):
        out.append("  graph device / replay host: not measured (no CUDA graphs off a GPU)")
    out += ["", "  the block-table stage in the step, per design (stage: host time per step, staging included)"]
    out += format_table(
        ["C", "design", "launches", "stage (p99)", "eager TPOT", "share", "graph TPOT", "share", "hides",
         "margin", "verified"],
        [[str(d["C"]), d["label"], d["launches"], f"{d['stage_us']:.1f} ({d['stage_p99_us']:.1f})",
          _us(d["eager_tpot_us"]), _pct(d["eager_share"]), _us(d["graph_tpot_us"]), _pct(d["graph_share"]),
          "-" if d["hides"] is None else "yes" if d["hides"] else "no", _us(d["async_margin_us"]),
          "no" if d["mismatch"] else "yes"] for d in derived(result)],
    )  # fmt: skip
    behind = [d for d in result.rows if d.get("behind_n")]
    if behind:
        out += ["", "  async scheduling, measured: the stage run right after the previous step's replay is launched"]
        out += format_table(
            ["C", "design", "steps", "stage host (device busy)", "hidden", "exposed"],
            [[str(d["C"]), d["label"], str(d["behind_n"]), _us(d["busy_host_us"]), _pct(d["hidden_frac"]),
              _us(d["exposed_us"])] for d in behind],
        )  # fmt: skip
    ran = {d["variant"] for d in result.rows}
    out += [textwrap.fill(f"{k}: {v}", 110, initial_indent="  ", subsequent_indent="    ")
            for k, v in LEGEND.items() if k in ran]  # fmt: skip
    if any(d.get("path") for d in result.rows):
        out.append(textwrap.fill(PATHS, 110, initial_indent="  ", subsequent_indent="    "))
    out += [f"  {s}" for s in result.skipped]
    out.append(textwrap.fill("assumptions: " + ASSUMPTIONS, 110, initial_indent="  ", subsequent_indent="    "))
    return out


def model_csv_rows(result: ModelResult, base: dict[str, str]) -> list[dict[str, str]]:
    """`--csv` rows of the model part (config: the preset): per C `model_eager_wall_us`, `model_eager_host_us`,
    `model_graph_device_us`, `model_replay_host_us` (variant `model`); per (C, design) `model_stage_host_us`
    (variant `model-<design>`), and where the async pass ran `model_stage_busy_host_us` (its stage host time with
    the device busy) and `model_stage_exposed_us`. The shares and TPOTs follow from these (`derived`)."""
    rows = []

    def row(variant: str, c: int, metric: str, median: float, p99: float, n: int, verified: bool) -> dict[str, str]:
        return {**base, "variant": variant, "config": f"model-{result.shape.name}", "concurrency": str(c),
                "metric": metric, "median_us": f"{median:.3f}", "p99_us": f"{p99:.3f}", "n": str(n),
                "verified": str(verified).lower(), "bytes": ""}  # fmt: skip

    for s in result.steps:
        for metric in ("eager_wall_us", "eager_host_us", "graph_device_us", "replay_host_us"):
            if math.isfinite(s[metric]):
                rows.append(row("model", s["C"], f"model_{metric}", s[metric], math.nan, s["steps"], not s["mismatch"]))
    for d in result.rows:
        rows.append(row(f"model-{d['label']}", d["C"], "model_stage_host_us", d["stage_us"], d["stage_p99_us"],
                        d["n"], not d["mismatch"]))  # fmt: skip
        if d.get("behind_n"):
            for metric, key in (("model_stage_busy_host_us", "busy_host_us"), ("model_stage_exposed_us", "exposed_us")):
                rows.append(row(f"model-{d['label']}", d["C"], metric, d[key], math.nan, d["behind_n"],
                                not d["mismatch"]))  # fmt: skip
    return rows


def write_model_plot(result: ModelResult, env: dict[str, str], path: str | Path) -> None:
    """One panel per (mode, C): per design a TPOT bar split into the block-table stage (hatched, labelled with its
    share) and the rest of the step, microseconds, lower is better; the assumptions below. Graph-mode panels only
    where the graph was measured (a GPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = derived(result)
    cs = [s["C"] for s in result.steps]
    modes = [("eager", "eager_tpot_us", "eager_share")]
    if any(math.isfinite(s["graph_device_us"]) for s in result.steps):
        modes.append(("graph", "graph_tpot_us", "graph_share"))
    width = max(12.0, 6.0 * len(cs))
    fig, axes = plt.subplots(len(modes), len(cs), figsize=(width, 3.4 * len(modes) + 2.4), squeeze=False)
    for mi, (mode, tpot_key, share_key) in enumerate(modes):
        for ci, c in enumerate(cs):
            ax = axes[mi][ci]
            mine = [d for d in rows if d["C"] == c and math.isfinite(d[tpot_key])]
            names = [d["label"] for d in mine]
            stage = [d["stage_us"] for d in mine]
            rest = [d[tpot_key] - d["stage_us"] for d in mine]
            ax.barh(names, rest, color="#9db4d0", label="rest of the step")
            ax.barh(names, stage, left=rest, color="#d0573f", hatch="//", label="block-table stage (host)")
            for y, d in enumerate(mine):
                label = f" stage {d['stage_us']:.0f} us = {100 * d[share_key]:.2f}%\n TPOT {d[tpot_key]:.0f} us"
                ax.text(d[tpot_key], y, label, va="center", fontsize="small")
            ax.invert_yaxis()
            ax.set_xlim(0, max((d[tpot_key] for d in mine), default=1) * 1.45)
            ax.set_xlabel("TPOT, us (lower is better)")
            ax.set_title(f"{mode}, C={c}", fontsize="medium")
            if mi == 0 and ci == 0:
                ax.legend(fontsize="small", loc="lower right")
    sh = result.shape
    title = (
        f"multiwrite {env['multiwrite']} bench --model: {sh.name} ({sh.layers} layers, hidden {sh.hidden}, "
        f"{result.dtype}) on {env['device_name']}, torch {env['torch']}; attention {result.attention}; "
        "TPOT per decode step split into the block-table stage and the rest of the step"
    )
    fig.suptitle(textwrap.fill(title, int(width * 11)), fontsize="medium")
    chars = int(width * 15)
    notes = "\n".join(textwrap.fill(f"{k}: {v}", chars) for k, v in LEGEND.items() if k in {d["variant"] for d in rows})
    notes += "\n" + textwrap.fill(ASSUMPTIONS, chars)
    fig.text(0.01, 0.01, notes, fontsize="x-small", va="bottom", ha="left", family="monospace")
    fig.tight_layout(rect=(0, 0.01 + 0.11 * (notes.count("\n") + 1) / fig.get_figheight(), 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
