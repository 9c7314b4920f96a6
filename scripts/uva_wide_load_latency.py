"""Latency of wide loads from pinned host memory in a captured CUDA graph: a measurement, not a test.

    python scripts/uva_wide_load_latency.py      # on a GPU machine

As scripts/uva_latency.py (each case a graph of one kernel, replays queued behind device work): wide loads of
64 to 1024 words as volatile, `.cv` and plain loads, one-word volatile and `.cv` loads, a device load followed
by a dependent wide host load, two dependent wide host loads, and the same from write-combined pinned memory
(`cudaHostAlloc` with `cudaHostAllocWriteCombined`, through ctypes). Results for the H200 are in
benchmarks/h200-2026-12-01b/uva-latency-wide.txt.
"""

import ctypes
import glob
import os

import torch
import triton
import triton.language as tl
from uva_latency import buffers, k_empty, time_cases


@triton.jit
def k_wide(host, out, N: tl.constexpr, MODE: tl.constexpr):
    lanes = tl.arange(0, N)
    if MODE == 0:
        v = tl.load(host + lanes, volatile=True)
    elif MODE == 1:
        v = tl.load(host + lanes, cache_modifier=".cv")
    else:
        v = tl.load(host + lanes)
    tl.store(out + lanes, v)


@triton.jit
def k_dev_then_wide(dev, host, out, N: tl.constexpr):
    a = tl.load(dev)
    lanes = tl.arange(0, N)
    v = tl.load(host + a * 0 + lanes, volatile=True)
    tl.store(out + lanes, v)


@triton.jit
def k_wide_then_wide(host, out, N: tl.constexpr):
    lanes = tl.arange(0, N)
    a = tl.load(host + lanes, volatile=True)
    b = tl.sum(a * 0, axis=0)
    v = tl.load(host + N + b + lanes, volatile=True)
    tl.store(out + lanes, v)


@triton.jit
def k_scalar(host, out, MODE: tl.constexpr):
    if MODE == 0:
        v = tl.load(host, volatile=True)
    else:
        v = tl.load(host, cache_modifier=".cv")
    tl.store(out, v)


def wc_alloc(nbytes):
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")) + [
        "libcudart.so"
    ]
    for name in libs:
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    p = ctypes.c_void_p()
    err = rt.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(nbytes), ctypes.c_uint(2 | 4 | 1))
    assert err == 0, err
    return p.value


def main() -> None:
    dev, out, host = buffers(8192)
    cases = {
        "empty": lambda: k_empty[(1,)](dev),
        "wide1k_volatile": lambda: k_wide[(1,)](host, out, N=1024, MODE=0),
        "wide1k_cv": lambda: k_wide[(1,)](host, out, N=1024, MODE=1),
        "wide1k_default": lambda: k_wide[(1,)](host, out, N=1024, MODE=2),
        "wide64_volatile": lambda: k_wide[(1,)](host, out, N=64, MODE=0),
        "wide256_volatile": lambda: k_wide[(1,)](host, out, N=256, MODE=0),
        "scalar_volatile": lambda: k_scalar[(1,)](host, out, MODE=0),
        "scalar_cv": lambda: k_scalar[(1,)](host, out, MODE=1),
        "dev_then_wide512": lambda: k_dev_then_wide[(1,)](dev, host, out, N=512),
        "wide512_then_wide512": lambda: k_wide_then_wide[(1,)](host, out, N=512),
    }
    try:
        addr = wc_alloc(8192 * 8)

        class P:  # triton accepts objects with data_ptr()
            def __init__(s, a):
                s.a = a
                s.dtype = torch.int64

            def data_ptr(s):
                return s.a

        wcp = P(addr)
        cases["wc_wide1k_volatile"] = lambda: k_wide[(1,)](wcp, out, N=1024, MODE=0)
        cases["wc_dev_then_wide512"] = lambda: k_dev_then_wide[(1,)](dev, wcp, out, N=512)
    except Exception as e:
        print("no WC:", repr(e))
    time_cases(cases)


if __name__ == "__main__":
    main()
