"""Latency ladder of loads and stores from one Triton program in a captured CUDA graph: a measurement, not a test.

    python scripts/uva_latency.py      # on a GPU machine

Each case is one kernel captured alone in a graph; every replay is queued behind ~50 us of device work
(`torch.cuda._sleep`) so CUDA events time device work only. Prints the median and 10th percentile replay
time per case over 250 replays: an empty kernel, a load from device memory, one to three dependent volatile
one-word loads from pinned host memory (unified virtual addressing), a device load then a host load, a
write-through store to host memory, and a 1024-word host load. Results for the H200 are in
benchmarks/h200-2026-12-01b/uva-latency.txt.
"""

import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def k_empty(dev):
    pass


@triton.jit
def k_dev_load(dev, out):
    v = tl.load(dev)
    tl.store(out, v)


@triton.jit
def k_host_load(host, out):
    v = tl.load(host, volatile=True)
    tl.store(out, v)


@triton.jit
def k_host_load2(host, out):
    a = tl.load(host, volatile=True)
    v = tl.load(host + 1 + (a & 0), volatile=True)
    tl.store(out, v)


@triton.jit
def k_host_load3(host, out):
    a = tl.load(host, volatile=True)
    b = tl.load(host + 1 + (a & 0), volatile=True)
    v = tl.load(host + 2 + (b & 0), volatile=True)
    tl.store(out, v)


@triton.jit
def k_dev_then_host(dev, host, out):
    a = tl.load(dev)
    v = tl.load(host + (a & 0), volatile=True)
    tl.store(out, v)


@triton.jit
def k_host_store(host, out):
    tl.store(host, 1, cache_modifier=".wt")


@triton.jit
def k_host_load_store(host, out):
    v = tl.load(host, volatile=True)
    tl.store(out, v)
    tl.store(host + 8, v, cache_modifier=".wt")


@triton.jit
def k_host_wide(host, out, N: tl.constexpr):
    lanes = tl.arange(0, N)
    v = tl.load(host + lanes, volatile=True)
    tl.store(out + lanes, v)


def time_cases(cases: dict[str, Callable[[], object]], reps: int = 300, warmup: int = 50) -> None:
    """Capture each case alone in a CUDA graph, replay the graphs in turn `reps` times, each queued behind ~50 us
    of device work (so the events time device work only), and print each case's median and 10th percentile
    replay time in us over the rounds after the first `warmup`."""
    for f in cases.values():
        f()  # compiled before any capture
    torch.cuda.synchronize()
    graphs = {}
    for name, f in cases.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs[name] = g
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(reps):
        for name, g in graphs.items():
            torch.cuda._sleep(100_000)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    for name, t in times.items():
        kept = sorted(t[warmup:])
        print(f"{name:24s} median {statistics.median(kept):6.2f} us  p10 {kept[len(kept) // 10]:6.2f}")


def buffers(words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 buffers of `words` words the cases read and write: device input, device output, pinned host."""
    return (
        torch.zeros(words, dtype=torch.int64, device="cuda"),
        torch.zeros(words, dtype=torch.int64, device="cuda"),
        torch.zeros(words, dtype=torch.int64, pin_memory=True),
    )


def main() -> None:
    dev, out, host = buffers(4096)
    cases = {
        "empty": lambda: k_empty[(1,)](dev),
        "dev_load": lambda: k_dev_load[(1,)](dev, out),
        "host_load": lambda: k_host_load[(1,)](host, out),
        "host_load2": lambda: k_host_load2[(1,)](host, out),
        "host_load3": lambda: k_host_load3[(1,)](host, out),
        "dev_then_host": lambda: k_dev_then_host[(1,)](dev, host, out),
        "host_store": lambda: k_host_store[(1,)](host, out),
        "host_load_store": lambda: k_host_load_store[(1,)](host, out),
        "host_wide_1k_int64": lambda: k_host_wide[(1,)](host, out, N=1024, num_warps=4),
        "two_empty": lambda: (k_empty[(1,)](dev), k_empty[(1,)](dev)),
    }
    time_cases(cases)


if __name__ == "__main__":
    main()
