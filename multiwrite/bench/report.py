"""What `multiwrite bench` prints and writes: the terminal tables, the goals of the project's performance
anchors (BENCHMARKS.md), and CSV (the plot is in `bench.plot`)."""

from __future__ import annotations

import csv
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from multiwrite.bench.glossary import TERMS
from multiwrite.bench.launch import LaunchResult
from multiwrite.bench.runner import BenchResult, ConfigResult, Stats
from multiwrite.workload import MAX_PROMPT_TOKENS

VARIANT_ORDER = ("fused", "per-group", "naive")

#: Columns of `--csv`, one row per measurement. Times in microseconds; `bytes` only for burst rows.
CSV_COLUMNS = (
    "timestamp",
    "multiwrite_version",
    "torch_version",
    "triton_version",
    "device",
    "device_name",
    "backend",
    "variant",
    "config",
    "concurrency",
    "metric",
    "median_us",
    "p99_us",
    "n",
    "verified",
    "bytes",
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain-text table: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  " + "  ".join(parts).rstrip()

    return [line(headers), "  " + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _us(s: Stats | None) -> str:
    if s is None or s.n == 0:
        return "-"
    return f"{s.median_us:.1f} ({s.p99_us:.1f})"


def _ratio(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2f}"


def _floors(result: BenchResult) -> list[str]:
    names = [n for n in result.configs[0].variants if n.startswith("floor")] if result.configs else []
    return names


def terminal_report(result: BenchResult) -> str:
    """The full human-readable report of a run, as one string."""
    env = result.env
    how = " (through Triton's interpreter)" if result.interpreted else ""
    out = [
        f"multiwrite bench: {result.backend}{how} on {env['device']} ({env['device_name']}), "
        f"{env['torch_threads']} torch thread{'s' if env['torch_threads'] != '1' else ''}",
        f"  multiwrite {env['multiwrite']}, torch {env['torch']}, triton {env['triton']}, numpy {env['numpy']}, "
        f"python {env['python']}; {result.timestamp}",
        f"  trace {result.trace}, prompts and outputs capped at {MAX_PROMPT_TOKENS} tokens; {result.steps} steps per "
        f"configuration, the first {result.warmup} warm-up",
        "  times in microseconds: median (p99) over the measured steps with at least one write; lower is better",
        "terms:",
        *(textwrap.fill(t, 110, initial_indent="  ", subsequent_indent="      ") for t in TERMS),
    ]
    if result.configs:
        floors = _floors(result)
        keys = [(c.config, str(c.concurrency)) for c in result.configs]
        out += ["", "host time per step, staging + apply (the figure the staging goals judge)"]
        out += format_table(
            ["config", "C", "steps", "writes/step", *VARIANT_ORDER],
            [
                [*k, str(c.steps), f"{c.writes_per_step:g}", *(_us(c.variants[v].step) for v in VARIANT_ORDER)]
                for k, c in zip(keys, result.configs)
            ],
        )
        out += ["", "host time per apply"]
        out += format_table(
            ["config", "C", *VARIANT_ORDER, *floors],
            [
                [*k, *(_us(c.variants[v].apply) for v in (*VARIANT_ORDER, *floors))]
                for k, c in zip(keys, result.configs)
            ],
        )
        if result.gpu:
            out += ["", "device time per apply (CUDA events around the apply, separate pass)"]
            out += format_table(
                ["config", "C", *VARIANT_ORDER, *floors],
                [
                    [*k, *(_us(c.variants[v].device) for v in (*VARIANT_ORDER, *floors))]
                    for k, c in zip(keys, result.configs)
                ],
            )
        floor = result.configs[0].floor
        what = "one empty backend call" if floor == "floor" else f"{floor}, one empty launch"
        out += ["", f"ratios of medians, fused / other (below 1: fused is faster; floor: {what})"]
        if any(c.config == "G1" for c in result.configs):
            out.append(
                "  (G1 has one group: there fused and per-group are the same one-group BlockTables, and their ratio "
                "shows turn order and noise, not design; BENCHMARKS.md, How it times)"
            )
        heads = [f"{m} /{o}" for m in ("apply", "step") for o in ("per-group", "naive", "floor")]
        out += format_table(
            ["config", "C", *heads],
            [
                [
                    *k,
                    *(
                        _ratio(c.ratio(m, o if o != "floor" else c.floor))
                        for m in ("apply", "step")
                        for o in ("per-group", "naive", "floor")
                    ),
                ]
                for k, c in zip(keys, result.configs)
            ],
        )
    b = result.burst
    if b is not None:
        out += [
            "",
            f"prefill burst: G3, {b.requests} requests x 3 groups x {b.ids_per_group} manager block ids, one step of "
            f"overwrites = {b.bytes_written:,} bytes of kernel block ids; {b.apply.n} repetitions",
        ]
        out += format_table(
            ["what", "median (p99) us", "bytes/s"],
            [
                ["staging (host)", _us(b.stage), "-"],
                ["fused apply + synchronize", _us(b.apply), f"{b.apply_bytes_per_s:.3g}"],
                [b.copy_name + (" + synchronize" if result.gpu else ""), _us(b.copy), f"{b.copy_bytes_per_s:.3g}"],
            ],
        )
        out.append(f"  fused / {b.copy_name} bandwidth: {b.apply_bytes_per_s / b.copy_bytes_per_s:.3g}")
    if result.launch is not None:
        out += launch_lines(result.launch)
    if result.stage is not None:
        from multiwrite.bench.stage import stage_lines

        out += stage_lines(result.stage, result.gpu, format_table)
    if result.model is not None:
        from multiwrite.bench.model_report import model_lines

        out += model_lines(result.model, format_table)
    failures = result.failures()
    out.append("")
    if failures:
        out += ["verification: FAILED"] + [f"  MISMATCH {f}" for f in failures]
    else:
        n = sum(1 for c in result.configs for v in c.variants.values() if v.verified)
        n += len(result.launch.same_loop) if result.launch is not None else 0
        n += len(result.stage.rows) if result.stage is not None else 0
        n += len(result.model.rows) + len(result.model.steps) if result.model is not None else 0
        out.append(f"verification: OK, all {n} variant runs" + (" and the burst" if b else "") + " equal the reference")
    head = "goals (BENCHMARKS.md)"
    if result.quick and not result.interpreted:
        head += (
            f": INDICATIVE ONLY: a smaller run ({result.steps} steps per configuration) than the default "
            "`multiwrite bench` (without --quick) that the goals are judged on"
        )
    goals = goal_lines(result)
    if result.stage is not None:
        from multiwrite.bench.stage import stage_goal_lines

        goals += stage_goal_lines(result.stage, result.gpu, result.interpreted)
    out += ["", head] + [f"  {g}" for g in goals]
    return "\n".join(out)


def _find(result: BenchResult, config: str, concurrency: int) -> ConfigResult | None:
    return next((c for c in result.configs if c.config == config and c.concurrency == concurrency), None)


def _verdict(value: float, goal: float, higher_is_better: bool = False) -> str:
    if not math.isfinite(value):
        return "not measured"
    ok = value >= goal if higher_is_better else value <= goal
    if ok:
        return "met"
    return f"missed by {goal / value if higher_is_better else value / goal:.1f}x"


def _fraction(r: float) -> str:
    """0.4 -> "1/2.5 of", 3.0 -> "3.00x"."""
    if not math.isfinite(r) or r <= 0:
        return "? of"
    return f"1/{1 / r:.1f} of" if r < 1 else f"{r:.2f}x"


def goal_lines(result: BenchResult) -> list[str]:
    """One line per goal of the performance anchors (BENCHMARKS.md) that this run's device can judge: the
    value, the goal, met or by how much it is missed. Goals of the other kind of device are named as not measured."""
    if result.interpreted:
        return [
            f"not evaluated for interpreted kernels: {result.backend} ran through Triton's interpreter "
            "(TRITON_INTERPRET=1), whose times are not the kernel's; run on a GPU, or a native CPU backend"
        ]
    lines = []
    if not result.gpu:
        for c_req, goal in ((256, 15), (40, 4)):
            c = _find(result, "G3", c_req)
            if c is None:
                lines.append(f"CPU staging+apply at C={c_req} G3 <= 1/{goal} of the per-write loop: not in this run")
                continue
            r = c.ratio("step", "naive")
            lines.append(
                f"CPU staging+apply at C={c_req} G3 = {_fraction(r)} the per-write loop (naive); "
                f"goal 1/{goal}: {_verdict(r, 1 / goal)}"
            )
        lines.append("GPU goals: not measured on a CPU run")
        return lines
    floor = result.configs[0].floor if result.configs else "floor-triton"
    if result.configs:
        worst = max(result.configs, key=lambda c: c.ratio("apply", c.floor))
        r = worst.ratio("apply", worst.floor)
        met = sum(1 for c in result.configs if c.ratio("apply", c.floor) <= 1.3)
        lines.append(
            f"GPU apply host time <= 1.3x one empty launch ({floor}): met on {met} of {len(result.configs)} "
            f"configurations; worst {r:.2f}x ({worst.config} C={worst.concurrency}): {_verdict(r, 1.3)}"
        )
    c = _find(result, "G3", 40)
    if c is None:
        lines.append("GPU staging+apply at C=40 G3 <= 2x one empty launch: not in this run")
    else:
        r = c.ratio("step", c.floor)
        lines.append(f"GPU staging+apply at C=40 G3 = {r:.2f}x one empty launch; goal <= 2x: {_verdict(r, 2.0)}")
        dev = c.variants["fused"].device
        d = dev.median_us if dev is not None else math.nan
        lines.append(
            f"GPU device time per fused apply at C=40 G3 (decode-dominated steps; CUDA events, launch latency "
            f"included) = {d:.1f} us; goal <= 5 us: {_verdict(d, 5.0)}"
        )
    b = result.burst
    if b is None:
        lines.append("GPU prefill burst >= 0.5x pinned host-to-device copy bandwidth: not in this run")
    else:
        r = b.apply_bytes_per_s / b.copy_bytes_per_s
        lines.append(
            f"GPU prefill burst = {r:.2f}x the {b.copy_name} bandwidth; goal >= 0.5x: {_verdict(r, 0.5, True)}"
        )
    lines.append("CPU goals: not measured on a GPU run")
    return lines


def csv_rows(result: BenchResult) -> list[dict[str, str]]:
    """One dict per measurement, keys `CSV_COLUMNS`: per configuration and variant `step_us`, `apply_us` and
    on GPUs `device_us`; for the burst `burst_stage_us`, `burst_apply_us` and the copy's `burst_copy_us`."""
    env = result.env
    base = {
        "timestamp": result.timestamp,
        "multiwrite_version": env["multiwrite"],
        "torch_version": env["torch"],
        "triton_version": env["triton"],
        "device": env["device"],
        "device_name": env["device_name"],
        "backend": result.backend,
    }

    def row(variant, config, concurrency, metric, s: Stats, verified, nbytes="") -> dict[str, str]:
        return {
            **base,
            "variant": variant,
            "config": config,
            "concurrency": str(concurrency),
            "metric": metric,
            "median_us": f"{s.median_us:.3f}",
            "p99_us": f"{s.p99_us:.3f}",
            "n": str(s.n),
            "verified": verified,
            "bytes": str(nbytes),
        }

    rows = []
    for c in result.configs:
        for v in c.variants.values():
            verified = "n/a" if v.verified is None else str(v.verified).lower()
            for metric, s in (("step_us", v.step), ("apply_us", v.apply), ("device_us", v.device)):
                if s is not None:
                    rows.append(row(v.variant, c.config, c.concurrency, metric, s, verified))
    b = result.burst
    if b is not None:
        ok = str(b.verified).lower()
        rows.append(row("fused", "burst-G3", b.requests, "burst_stage_us", b.stage, ok, b.bytes_written))
        rows.append(row("fused", "burst-G3", b.requests, "burst_apply_us", b.apply, ok, b.bytes_written))
        rows.append(row(b.copy_name, "burst-G3", b.requests, "burst_copy_us", b.copy, "n/a", b.bytes_written))
    if result.stage is not None:
        from multiwrite.bench.stage import stage_csv_rows

        rows += stage_csv_rows(result.stage, base)
    if result.model is not None:
        from multiwrite.bench.model_report import model_csv_rows

        rows += model_csv_rows(result.model, base)
    return rows


def write_csv(result: BenchResult, path: str | Path) -> None:
    """Write `csv_rows(result)` to `path`, with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(result))


def launch_lines(r: LaunchResult) -> list[str]:
    """The `--launch` section of the terminal report."""
    head = "launch (--launch): host time per apply next to one empty Triton launch; median us, lower is better"
    out = ["", head]
    out.append(f"  launch path of the default backend: {r.launch_path or '-'}")
    out.append(
        "  same loop: each step stages, applies, synchronizes, then one empty launch; x: ratio of medians; "
        "launches: kernel launches per apply, as the backend's launchers counted them"
    )
    out += format_table(
        ["config", "C", "launcher", "launches", "apply", "apply p99", "empty", "apply x", "step", "step x"],
        [[x["config"], str(x["C"]), x["launcher"], f"{x['launches_per_apply']:g}", f"{x['apply_us']:.2f}",
          f"{x['apply_p99_us']:.2f}", f"{x['empty_us']:.2f}", f"{x['apply_x_empty']:.2f}", f"{x['step_us']:.2f}",
          f"{x['step_x_empty']:.2f}"] for x in r.same_loop],
    )  # fmt: skip
    out.append("  tight loop: a captured G3 decode apply alone (no staging), a synchronize every 50 calls")
    out += format_table(
        ["config", "C", "writes", "apply", "empty", "apply x"],
        [[x["config"], str(x["C"]), str(x["writes"]), f"{x['apply_us']:.2f}", f"{x['empty_us']:.2f}",
          f"{x['apply_x_empty']:.2f}"] for x in r.tight_loop],
    )  # fmt: skip
    if r.device:
        out.append("  device time, CUDA events around work queued behind a sleep (launch submission excluded), us:")
        out += [f"    {k}: {v:.2f}" for k, v in r.device.items()]
    else:
        out.append("  device time behind a sleep: not measured off a GPU")
    return out
