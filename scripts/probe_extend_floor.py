"""Probe (GPU): how fast can the bs-256 extend write of `bench --sglang` be at all on this device? A minimal Triton
kernel that does the job and nothing else (no checks, no faults, no staging slot: rows, lengths and the prefix
tensors' addresses already in device memory, not counted), one program per request (or `S` per request), timed
the way `bench --sglang` times (`multiwrite.bench.sglang._time`), beside SGLang's writer and ours on the same
batches, every table compared with SGLang's. Not part of the library.

Usage (the device tool's H200): MULTIWRITE_SGLANG_SRC=.sglang-src python scripts/probe_extend_floor.py [steps]
"""

# ruff: noqa: B023  (the closures are called within the iteration that binds them)
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from multiwrite.bench import sglang as sb
from multiwrite.sglang.upstream import load_upstream
from multiwrite.workload import MAX_PROMPT_TOKENS, load_trace


@triton.jit
def minimal_kernel(table, stride, rows_p, prefix_p, extend_p, addr_p, out_p, n, counter, done,
                   HANDBACK: tl.constexpr, BLOCK: tl.constexpr, NPOW: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    k = tl.program_id(1)
    s = tl.num_programs(1)
    row = tl.load(rows_p + i)
    plen = tl.load(prefix_p + i)
    src = tl.load(addr_p + i).to(tl.pointer_type(tl.int64))
    dst = table + row * stride
    lanes = tl.arange(0, BLOCK)
    for c in range(k * BLOCK, plen, s * BLOCK):
        m = c + lanes < plen
        v = tl.load(src + c + lanes, mask=m)
        tl.store(dst + c + lanes, v.to(tl.int32), mask=m)
    j = tl.arange(0, NPOW)
    off = tl.sum(tl.load(extend_p + j, mask=j < i, other=0))
    elen = tl.load(extend_p + i)
    for c in range(k * BLOCK, elen, s * BLOCK):
        m = c + lanes < elen
        v = tl.load(out_p + off + c + lanes, mask=m)
        tl.store(dst + plen + c + lanes, v.to(tl.int32), mask=m)
    if HANDBACK:
        old = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        last = old == n * s - 1
        tl.store(done, old + 1, mask=last)
        tl.atomic_xchg(counter, 0, mask=last)


@triton.jit
def empty_kernel(x):
    pass


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    device = torch.device("cuda", 0)
    up = load_upstream(Path(os.environ["MULTIWRITE_SGLANG_SRC"]))
    up.settings.attention_backends = ("triton", "triton")
    trace = load_trace()
    rng = np.random.default_rng(25)
    width = MAX_PROMPT_TOKENS + sb.MAX_EXTEND
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    done = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    with up.active():
        for bs in (256, 1024):
            pools = {impl: up.pool(bs, width, device) for impl in sb.IMPLS}
            mine = up.pool(bs, width, device)
            ext, _ = sb._calls(up, trace, bs, width, device, rng, pools, None, 3)
            batches = [sb._extend_args(trace, k, bs, device, rng) for k in range(3)]
            addrs = [torch.tensor([t.data_ptr() for t in b[9]], dtype=torch.int64, device=device) for b in batches]
            npow = triton.next_power_of_2(bs)

            def minimal(i, block, warps, splits, handback):
                b = batches[i % 3]
                minimal_kernel[(bs, splits)](mine.req_to_token, mine.req_to_token.stride(0), b[1], b[3], b[7],
                                             addrs[i % 3], b[0], bs, counter, done, HANDBACK=handback, BLOCK=block,
                                             NPOW=npow, num_warps=warps)  # fmt: skip

            _, d = sb._time(lambda i: empty_kernel[(1,)](counter), steps, 20, device, lambda k: None)
            print(f"bs {bs}: empty launch device {d.median_us:.2f} us", flush=True)
            _, d = sb._time(ext["sglang"], steps, 20, device, lambda k: None)
            print(f"bs {bs}: sglang device {d.median_us:.2f} us", flush=True)
            _, d = sb._time(ext["multiwrite"], steps, 20, device, lambda k: None)
            print(f"bs {bs}: ours (library defaults) device {d.median_us:.2f} us", flush=True)
            for block, warps, splits, handback in [(1024, 4, 1, 0), (1024, 4, 1, 1), (2048, 8, 1, 0),
                                                   (2048, 8, 1, 1), (1024, 4, 2, 0), (1024, 4, 4, 0),
                                                   (512, 4, 1, 0), (4096, 8, 1, 0), (1024, 8, 1, 0),
                                                   (2048, 4, 2, 1)]:  # fmt: skip
                mine.req_to_token.zero_()
                pools["sglang"].req_to_token.zero_()
                up.allocation.write_cache_indices(*batches[0], pools["sglang"])  # (the minimal kernel's batch)
                minimal(0, block, warps, splits, handback)
                equal = torch.equal(pools["sglang"].req_to_token, mine.req_to_token)
                _, d = sb._time(lambda i: minimal(i, block, warps, splits, handback), steps, 20, device,
                                lambda k: None)  # fmt: skip
                print(f"  minimal block {block} warps {warps} splits {splits} handback {handback}: device "
                      f"{d.median_us:.2f} (p99 {d.p99_us:.2f}) equal {equal}", flush=True)


if __name__ == "__main__":
    main()
