"""Probe (GPU): the device-writes kernel's work split for `multiwrite.sglang.write_cache_indices`, in one run with
SGLang's own extend writer as the control. Not a test and not part of the library: it patches the runner's knobs
(`_TILES["long"]`, `MAX_SPLITS`, the program budget, warps)
between measurements, with `bench --sglang`'s timing (`multiwrite.bench.sglang._time`) and its batches (the trace's
prompt lengths as prefixes). Every variant's table is compared with SGLang's before it is timed.

Usage (the device tool's H200): MULTIWRITE_SGLANG_SRC=.sglang-src python scripts/probe_extend_split.py [steps]
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import numpy as np
import torch

import multiwrite.backends.triton.device_writes as dw
from multiwrite.bench import sglang as sb
from multiwrite.sglang.upstream import load_upstream
from multiwrite.workload import MAX_PROMPT_TOKENS, load_trace

#: (name, (block_w, block_l), max_splits, split budget: programs per SM, warps)
VARIANTS = [
    ("1x1024 b4 (the default)", (1, 1024), 1024, 4, 4),
    ("1x1024 b4 w8", (1, 1024), 1024, 4, 8),
    ("1x1024 b2 w8", (1, 1024), 1024, 2, 8),
    ("1x1024 b1 w8", (1, 1024), 1024, 1, 8),
    ("1x2048 b2 w8", (1, 2048), 1024, 2, 8),
    ("1x1024 b4 (again)", (1, 1024), 1024, 4, 4),
]


def runner() -> dw.DeviceWritesRunner:
    return next(o for o in gc.get_objects() if isinstance(o, dw.DeviceWritesRunner))


def configure(r: dw.DeviceWritesRunner, tile, max_splits, per_sm, warps, sms: int) -> None:
    dw._TILES["long"] = tile
    dw.MAX_SPLITS = max_splits
    r.split_budget = per_sm * sms
    if r.launcher.num_warps != warps:
        r.launcher.num_warps = warps
        r.launcher.fire.clear()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    up = load_upstream(Path(os.environ["MULTIWRITE_SGLANG_SRC"]))
    up.settings.attention_backends = ("triton", "triton")
    trace = load_trace()
    rng = np.random.default_rng(25)
    with up.active():
        cases = []
        for bs in (32, 256, 1024):
            width = MAX_PROMPT_TOKENS + sb.MAX_EXTEND
            pools = {impl: up.pool(bs, width, device) for impl in sb.IMPLS}
            ext, _ = sb._calls(up, trace, bs, width, device, rng, pools, None, 3)
            cases.append((f"bs {bs}", pools, ext))
        cases.append(long_rows(up, device))
        r = None
        for name, pools, ext in cases:
            _, d = sb._time(ext["sglang"], steps, 20, device, lambda k: None)
            print(f"{name}: sglang device {d.median_us:.2f} us (p99 {d.p99_us:.2f})", flush=True)
            for vname, tile, ms, per_sm, warps in VARIANTS:
                if r is None:
                    ext["multiwrite"](0)
                    r = runner()
                configure(r, tile, ms, per_sm, warps, sms)
                for pool in pools.values():
                    pool.req_to_token.zero_()
                ext["sglang"](0)
                ext["multiwrite"](0)
                equal = torch.equal(pools["sglang"].req_to_token, pools["multiwrite"].req_to_token)
                h, d = sb._time(ext["multiwrite"], steps, 20, device, lambda k: None)
                print(f"  {vname:24} device {d.median_us:6.2f} "
                      f"(p99 {d.p99_us:6.2f}) host {h.median_us:7.1f} equal {equal}", flush=True)
            _, d = sb._time(ext["sglang"], steps, 20, device, lambda k: None)
            print(f"{name}: sglang device again {d.median_us:.2f} us", flush=True)


def long_rows(up, device):
    """Four requests, prefixes of 100K, 50K, 10 and 0 tokens, extends of 256."""
    from multiwrite.sglang.writes import write_cache_indices

    prefix = np.array([100_000, 50_000, 10, 0])
    extend = np.full(4, 256)
    rows = np.arange(1, 5)
    cpu = [torch.from_numpy(a.astype(np.int64)) for a in (rows, prefix, prefix + extend, extend)]
    dev = [t.to(device) for t in cpu]
    rng = np.random.default_rng(5)
    pre = [torch.from_numpy(rng.integers(0, 2**31 - 1, int(p))).to(device) for p in prefix]
    out = torch.from_numpy(rng.integers(0, 2**31 - 1, int(extend.sum()))).to(device)
    args = (out, dev[0], cpu[0], dev[1], cpu[1], dev[2], cpu[2], dev[3], cpu[3], pre)
    pools = {impl: up.pool(4, 100_512, device) for impl in sb.IMPLS}
    ext = {"sglang": lambda i: up.allocation.write_cache_indices(*args, pools["sglang"]),
           "multiwrite": lambda i: write_cache_indices(*args, pools["multiwrite"])}  # fmt: skip
    return "100K rows", pools, ext


if __name__ == "__main__":
    main()
