"""`multiwrite bench --sglang`: SGLang 0.5.23's page-table writers next to `multiwrite.sglang`'s, per step.

Per batch size: the extend writer (`write_cache_indices`: SGLang's Triton writer on a GPU, its per-request fallback
on a CPU, where its kernel would run through Triton's interpreter) and the decode allocation
(`alloc_for_decode_default` against `multiwrite.sglang.alloc_for_decode`, page size 1, on a stand-in batch whose
allocator hands out fixed slots, so that the two differ only in their page-table work). Prefixes are the trace's
prompt lengths (cut to 8192 tokens), extends its output lengths cut to 256, consecutive trace requests per step.
Host time is the call itself. Device time (GPU) is the GPU's own time for the call's work, the same way for both
implementations: `torch.cuda._sleep` queues a spin longer than the call's host time, then the start event, the call,
the end event, so the call's kernels and copies are queued behind the spin and the events time only their execution
(not the host issuing them). A step whose start event had already run when the call returned (the spin was too
short, or the call waited for the device) is timed again with a spin twice as long; a call that still outruns a
spin of `MAX_SPIN_MS` raises. Kernels are counted once per writer with torch's profiler (GPU). Every pair's tables
are compared after one call each on equal inputs. SGLang's code is loaded from its wheel
(`multiwrite.sglang.upstream`), nothing of it is shipped.
"""

from __future__ import annotations

import csv
import gc
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from multiwrite.bench.runner import Stats
from multiwrite.workload import MAX_PROMPT_TOKENS, Trace

BATCH_SIZES = (1, 32, 256, 1024)
MAX_EXTEND = 256
WRITERS = ("extend", "decode")
IMPLS = ("sglang", "multiwrite")
#: The goals of issue 25 (GPU only): ours at most SGLang's device time at every batch size; the extend at bs 256 at
#: least this many times faster in device time; multiwrite's decode write one launch.
EXTEND_SPEEDUP_AT_256 = 5.0
#: The spin queued before each timed call starts at `SPIN_MS` and doubles while a call outruns it, up to `MAX_SPIN_MS`.
SPIN_MS = 2.0
MAX_SPIN_MS = 256.0

CSV_COLUMNS = ("timestamp", "multiwrite_version", "torch_version", "triton_version", "device", "device_name",
               "sglang_path", "writer", "impl", "bs", "metric", "median_us", "p99_us", "n", "kernels",
               "verified")  # fmt: skip


@dataclass
class Measured:
    """One writer (`extend`, `decode`) of one implementation (`sglang`, `multiwrite`) at one batch size: host and
    (GPU) device time per call, microseconds; kernels per call (GPU); its table equal to the other's."""

    writer: str
    impl: str
    bs: int
    host: Stats
    device: Stats | None
    kernels: int | None
    verified: bool


@dataclass
class SglangResult:
    """A `--sglang` run. `sglang_path`: which SGLang extend writer ran (`triton` or `torch_native`)."""

    timestamp: str
    env: dict[str, str]
    source: str
    sglang_path: str
    steps: int
    warmup: int
    rows: list[Measured] = field(default_factory=list)

    def get(self, writer: str, impl: str, bs: int) -> Measured:
        """The row of `writer`, `impl`, `bs`."""
        return next(r for r in self.rows if (r.writer, r.impl, r.bs) == (writer, impl, bs))

    def batch_sizes(self) -> list[int]:
        """The batch sizes measured, in order."""
        return sorted({r.bs for r in self.rows})

    def ratio(self, writer: str, bs: int, metric: str) -> float:
        """SGLang's median `metric` (`host`, `device`) over multiwrite's: above 1, multiwrite is faster."""
        a, b = getattr(self.get(writer, "sglang", bs), metric), getattr(self.get(writer, "multiwrite", bs), metric)
        if a is None or b is None or not b.median_us > 0:
            return math.nan
        return a.median_us / b.median_us

    def goals(self) -> list[tuple[str, bool | None]]:
        """(goal, met: None where it is not judged: no device time off a GPU)."""
        gpu = all(r.device is not None for r in self.rows)
        out: list[tuple[str, bool | None]] = []
        for writer in WRITERS:
            ok = all(self.ratio(writer, bs, "device") >= 1 for bs in self.batch_sizes()) if gpu else None
            out.append((f"{writer}: multiwrite's device time at most SGLang's at every bs", ok))
        if 256 in self.batch_sizes():
            ok = self.ratio("extend", 256, "device") >= EXTEND_SPEEDUP_AT_256 if gpu else None
            out.append((f"extend at bs 256: at least {EXTEND_SPEEDUP_AT_256:g}x faster in device time", ok))
        kernels = [r.kernels for r in self.rows if (r.writer, r.impl) == ("decode", "multiwrite")]
        out.append(("decode: multiwrite's write is one launch", all(k == 1 for k in kernels) if gpu else None))
        return out

    def failures(self) -> list[str]:
        """Tables that differed, and goals judged and not met."""
        bad = [f"{r.writer} {r.impl} bs {r.bs}: tables differ" for r in self.rows if not r.verified]
        return bad + [g for g, ok in self.goals() if ok is False]


def sglang_source() -> Path:
    """SGLang's files: where `MULTIWRITE_SGLANG_WHEEL`/`_SRC` say, else the wheel `tox -e sglang` caches
    (`$XDG_CACHE_HOME/multiwrite/sglang-0.5.23.whl`). Raises `SglangSourceError` saying how to provide them."""
    from multiwrite.sglang import upstream

    scratch = Path(tempfile.mkdtemp(prefix="multiwrite-sglang-"))
    if not upstream.configured():
        cached = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiwrite"
        wheel = cached / f"sglang-{upstream.VERSION}.whl"
        if wheel.is_file():
            os.environ[upstream.WHEEL_ENV] = str(wheel)
    return upstream.locate_sources(scratch)


def _lengths(trace: Trace, start: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    idx = (start + np.arange(bs)) % len(trace)
    return np.minimum(trace.prompt_tokens[idx], MAX_PROMPT_TOKENS), np.minimum(trace.output_tokens[idx], MAX_EXTEND)


def _extend_args(trace: Trace, step: int, bs: int, device: torch.device, rng: np.random.Generator) -> tuple:
    prefix, extend = _lengths(trace, step * bs, bs)
    rows = np.arange(1, bs + 1, dtype=np.int64)
    cpu = [torch.from_numpy(a.astype(np.int64)) for a in (rows, prefix, prefix + extend, extend)]
    dev = [t.to(device) for t in cpu]
    prefix_tensors = [torch.from_numpy(rng.integers(0, 2**31 - 1, size=int(p))).to(device) for p in prefix]
    out = torch.from_numpy(rng.integers(0, 2**31 - 1, size=int(extend.sum()))).to(device)
    return (out, dev[0], cpu[0], dev[1], cpu[1], dev[2], cpu[2], dev[3], cpu[3], prefix_tensors)


def _cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles // 10)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _time(call: Callable[[int], Any], steps: int, warmup: int, device: torch.device, tick: Callable[[int], Any]
          ) -> tuple[Stats, Stats | None]:  # fmt: skip
    cuda = device.type == "cuda"
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
    cycles_per_ms = _cycles_per_ms(device) if cuda else 0.0
    spin_ms = SPIN_MS
    host, dev = [], []
    clock = time.perf_counter_ns
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for i in range(steps):
            while True:
                if events:
                    torch.cuda._sleep(int(spin_ms * cycles_per_ms))
                    events[0].record()
                t0 = clock()
                call(i)
                t1 = clock()
                if not events:
                    break
                outrun = events[0].query()  # the spin ended before the call was issued: the GPU waited for the host
                events[1].record()
                events[1].synchronize()
                if not outrun:
                    break
                if spin_ms >= MAX_SPIN_MS:
                    raise RuntimeError(f"bench --sglang: a call outran a {MAX_SPIN_MS:g} ms spin on the GPU (it waits "
                                       "for the device?): its device time cannot be told from its host time")
                spin_ms *= 2
            if i >= warmup:
                host.append((t1 - t0) / 1e3)
                if events:
                    dev.append(events[0].elapsed_time(events[1]) * 1e3)
            tick(1)
    finally:
        if was_enabled:
            gc.enable()
    return Stats.of(host), (Stats.of(dev) if cuda else None)


def _kernels(call: Callable[[], Any], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())  # fmt: skip


def measure_sglang(trace: Trace, device: torch.device, batch_sizes: list[int], steps: int, warmup: int,
                   backend: str | None, tick: Callable[[int], Any], timestamp: str, env: dict[str, str],
                   source: Path | None = None) -> SglangResult:  # fmt: skip
    """Measure both writers of both implementations at each batch size of `batch_sizes` for `steps` calls (the
    first `warmup` left out). Raises `SglangSourceError` when SGLang's files cannot be located."""
    from multiwrite.sglang.upstream import load_upstream

    up = load_upstream(source or sglang_source())
    path = "triton" if device.type == "cuda" else "torch_native"
    up.settings.attention_backends = (path, path)
    width = MAX_PROMPT_TOKENS + MAX_EXTEND
    result = SglangResult(timestamp, env, str(up.source), path, steps, warmup)
    rng = np.random.default_rng(25)
    with up.active():
        for bs in batch_sizes:
            pools = {impl: up.pool(bs, width, device) for impl in IMPLS}
            extend_calls, decode_calls = _calls(up, trace, bs, width, device, rng, pools, backend, min(steps, 3))
            for writer, calls in (("extend", extend_calls), ("decode", decode_calls)):
                for pool in pools.values():
                    pool.req_to_token.zero_()
                for call in calls.values():
                    call(0)
                verified = torch.equal(pools["sglang"].req_to_token, pools["multiwrite"].req_to_token)
                for impl in IMPLS:
                    host, dev = _time(calls[impl], steps, warmup, device, tick)
                    kernels = _kernels(lambda c=calls[impl]: c(0), device)
                    result.rows.append(Measured(writer, impl, bs, host, dev, kernels, verified))
            del pools, extend_calls, decode_calls
    return result


def _calls(up: Any, trace: Trace, bs: int, width: int, device: torch.device, rng: np.random.Generator,
           pools: dict[str, Any], backend: str | None, num_batches: int) -> tuple[dict, dict]:  # fmt: skip
    """Per implementation, the extend call of step i (one of `num_batches` batches in turn) and the decode call."""
    from multiwrite.sglang.install import alloc_for_decode
    from multiwrite.sglang.upstream import decode_batch
    from multiwrite.sglang.writes import write_cache_indices

    batches = [_extend_args(trace, k, bs, device, rng) for k in range(num_batches)]
    ours, theirs = pools["multiwrite"], pools["sglang"]
    extend = {
        "sglang": lambda i: up.allocation.write_cache_indices(*batches[i % num_batches], theirs),
        "multiwrite": lambda i: write_cache_indices(*batches[i % num_batches], ours, backend=backend),
    }
    prompt, output = _lengths(trace, 0, bs)
    seq = np.minimum(prompt + output // 2 + 1, width - 1).tolist()
    slots = torch.from_numpy(rng.integers(0, 2**31 - 1, size=bs)).to(device)
    rows = list(range(1, bs + 1))
    theirs_batch, ours_batch = decode_batch(theirs, rows, seq, slots), decode_batch(ours, rows, seq, slots)
    decode = {
        "sglang": lambda i: up.allocation.alloc_for_decode_default(theirs_batch, 1),
        "multiwrite": lambda i: alloc_for_decode(ours_batch, 1),
    }
    return extend, decode


def _us(s: Stats | None) -> str:
    return "-" if s is None or s.n == 0 else f"{s.median_us:.1f} ({s.p99_us:.1f})"


def _x(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}"


def terminal_report(r: SglangResult) -> str:
    """The terminal report: per writer and bs, both implementations' times, the ratios, kernels, the goals."""
    from multiwrite.bench.report import format_table

    env = r.env
    out = ["multiwrite bench --sglang: SGLang 0.5.23's page-table writers next to multiwrite.sglang's",
           f"  device             {env.get('device')} ({env.get('device_name')})",
           f"  versions           multiwrite {env.get('multiwrite')}, torch {env.get('torch')}, "
           f"triton {env.get('triton')}",
           f"  SGLang's code      {r.source} (extend writer: {r.sglang_path})",
           f"  steps              {r.steps} per writer and bs, the first {r.warmup} left out",
           "  prefixes: the trace's prompt lengths (cut to 8192); extends: its output lengths (cut to 256); decode: "
           "page size 1",
           "  times: median (p99) us per call, lower is better; x: SGLang's median over multiwrite's (above 1: "
           "multiwrite faster); kernels: launches per call (GPU)",
           "  device time: the GPU's execution of the call's work, queued behind a spin (torch.cuda._sleep) so that "
           "host time is left out", ""]  # fmt: skip
    rows = []
    for writer in WRITERS:
        for bs in r.batch_sizes():
            s, m = r.get(writer, "sglang", bs), r.get(writer, "multiwrite", bs)
            rows.append([writer, str(bs), _us(s.host), _us(m.host), _x(r.ratio(writer, bs, "host")), _us(s.device),
                         _us(m.device), _x(r.ratio(writer, bs, "device")),
                         f"{'-' if s.kernels is None else s.kernels}/{'-' if m.kernels is None else m.kernels}",
                         "yes" if m.verified else "NO"])  # fmt: skip
    out += format_table(["writer", "bs", "sglang host", "ours host", "host x", "sglang device", "ours device",
                         "device x", "kernels s/o", "equal"], rows)  # fmt: skip
    out.append("")
    out.append("goals (issue 25; judged on a GPU only)")
    for goal, ok in r.goals():
        out.append(f"  {'not judged' if ok is None else 'met' if ok else 'NOT MET':10}  {goal}")
    failures = r.failures()
    out.append(f"result: {'OK' if not failures else 'FAILED: ' + '; '.join(failures)}")
    return "\n".join(out)


def write_csv(r: SglangResult, path: str | Path) -> None:
    """One row per writer, implementation, bs and metric (host, device)."""
    env = r.env
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for m in r.rows:
            for metric in ("host", "device"):
                s = getattr(m, metric)
                if s is None:
                    continue
                w.writerow({"timestamp": r.timestamp, "multiwrite_version": env.get("multiwrite"),
                            "torch_version": env.get("torch"), "triton_version": env.get("triton"),
                            "device": env.get("device"), "device_name": env.get("device_name"),
                            "sglang_path": r.sglang_path, "writer": m.writer, "impl": m.impl, "bs": m.bs,
                            "metric": metric, "median_us": f"{s.median_us:.3f}", "p99_us": f"{s.p99_us:.3f}",
                            "n": s.n, "kernels": "" if m.kernels is None else m.kernels,
                            "verified": m.verified})  # fmt: skip


def write_plot(r: SglangResult, path: str | Path) -> None:
    """Two panels (extend, decode): median time per call against bs, SGLang's and multiwrite's, device time on a
    GPU (host time dashed), host time elsewhere; log scales. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    bss = r.batch_sizes()
    for ax, writer in zip(axes, WRITERS):
        for impl, color in zip(IMPLS, ("tab:red", "tab:blue")):
            for metric, style in (("device", "-"), ("host", "--")):
                ys = [getattr(r.get(writer, impl, bs), metric) for bs in bss]
                if any(y is None for y in ys):
                    continue
                ax.plot(bss, [y.median_us for y in ys], style, marker="o", color=color, label=f"{impl} {metric}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel("median us per call (lower is better)")
        ax.set_title(f"{writer} ({'SGLang ' + r.sglang_path if writer == 'extend' else 'page size 1'})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SGLang 0.5.23 vs multiwrite.sglang on {r.env.get('device_name')}; prefixes: the trace's prompts")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
