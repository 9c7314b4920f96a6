"""The shared Triton kernel compiles to machine code for NVIDIA and AMD targets, without a GPU.

Every dtype variant is compiled with the launch parameters each backend uses (the overlap/rounds path is
the same compiled variant: the number of rounds is a runtime argument). A second test proves that the
arguments the host produces for a hundred different batch shapes map to one JIT cache key per dtype,
through the same binder and cache-key function Triton's JIT uses at launch.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
from multiwrite.backends import triton_kernel as tk  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from multiwrite.staging import META_COLUMNS, SUPPORTED_DTYPES  # noqa: E402

NVIDIA = [80, 90]
#: (arch, wavefront size as the ROCm runtime reports it: 64 on CDNA, 32 by default on RDNA3)
AMD = [("gfx90a", 64), ("gfx942", 64), ("gfx1100", 32)]
DTYPES = [torch.int32, torch.int64, torch.float32]
#: The two tiles the writer launches: the general one, and the one for decode steps (<= 256 values).
TILES = ["main", "decode"]


def _tile(params: tk.LaunchParams, tile: str) -> tk.LaunchParams:
    if tile == "main":
        return params
    return params._replace(block_w=params.decode_block_w, block_l=params.decode_block_l)


def _compile(target: GPUTarget, params: tk.LaunchParams, dtype: torch.dtype):
    fn = tk.compilable_kernel()
    constexprs = {"VALUE_DTYPE": tk.TL_DTYPES[dtype], "BLOCK_W": params.block_w, "BLOCK_L": params.block_l}
    signature = {p.name: "constexpr" if p.is_constexpr else p.annotation for p in fn.params}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": params.num_warps, "num_stages": 1})


def _worker() -> None:
    """Compile every variant and print what the tests check, as JSON (run without TRITON_INTERPRET)."""
    out = {}
    for arch in NVIDIA:
        for dtype, tile in ((d, t) for d in DTYPES for t in TILES):
            k = _compile(GPUTarget("cuda", arch, 32), _tile(tk.cuda_launch_params(), tile), dtype)
            out[f"sm_{arch}-{dtype}-{tile}"] = {
                "binary": base64.b64encode(k.asm["cubin"]).decode(), "isa": k.asm["ptx"],
                "num_warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
            }  # fmt: skip
    for arch, ws in AMD:
        for dtype, tile in ((d, t) for d in DTYPES for t in TILES):
            k = _compile(GPUTarget("hip", arch, ws), _tile(tk.rocm_launch_params(ws), tile), dtype)
            out[f"{arch}-{dtype}-{tile}"] = {
                "binary": base64.b64encode(k.asm["hsaco"]).decode(), "isa": k.asm["amdgcn"],
                "num_warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
            }  # fmt: skip
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{"sm_90-torch.int32": {...}, "gfx942-torch.float32": {...}, ...} from a fresh process.

    Compiling needs a process where TRITON_INTERPRET is unset: with it set at import, Triton's own
    `@jit` helpers (`tl.max`, ...) are interpreter functions and cannot be compiled.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ptxas_spills(ptx: str, arch: int) -> tuple[int, int, str]:
    """(spill store bytes, spill load bytes, ptxas -v log) of the kernel, from the ptxas Triton itself
    uses for `arch`, for the PTX's own `.target` (e.g. `sm_90a`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    gpu = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = out.stdout + out.stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert m, f"no spill line in the ptxas log:\n{log}"
    return int(m.group(1)), int(m.group(2)), log


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("arch", NVIDIA, ids=lambda a: f"sm_{a}")
def test_compiles_for_nvidia(compiled, arch, dtype, tile):
    params = tk.cuda_launch_params()
    k = compiled[f"sm_{arch}-{dtype}-{tile}"]
    assert k["num_warps"] == params.num_warps and k["num_warps"] * k["warp_size"] <= 1024
    cubin = base64.b64decode(k["binary"])
    assert len(cubin) > 0
    ptx = k["isa"]
    assert "st.global" in ptx and "ld.global" in ptx and "atom.global" in ptx
    stores, loads, log = _ptxas_spills(ptx, arch)
    assert (stores, loads) == (0, 0), f"register spills on sm_{arch}:\n{log}"
    cuobjdump = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")  # bundled
    if os.path.exists(cuobjdump):  # the SASS itself stores to global memory
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        assert "STG" in sass, sass[:2000]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("arch,warp_size", AMD, ids=[a for a, _ in AMD])
def test_compiles_for_amd(compiled, arch, warp_size, dtype, tile):
    params = tk.rocm_launch_params(warp_size)
    assert params.num_warps * warp_size <= 1024, "AMD rejects launches above 1024 lanes"
    assert params.block_l % 64 == 0, "column chunks must be whole 64-lane runs"
    k = compiled[f"{arch}-{dtype}-{tile}"]
    assert k["warp_size"] == warp_size and k["num_warps"] == params.num_warps
    assert k["num_warps"] * k["warp_size"] <= 1024
    assert len(base64.b64decode(k["binary"])) > 0
    gcn = k["isa"]
    assert re.search(r"\b(global|buffer|flat)_store", gcn), "no store instruction in the AMD ISA"
    assert re.search(r"\b(global|buffer|flat)_atomic", gcn), "no atomic in the AMD ISA"
    for what in ("vgpr_spill_count", "sgpr_spill_count"):
        counts = [int(x) for x in re.findall(rf"\.{what}:\s+(\d+)", gcn)]
        assert counts and max(counts) == 0, f"{what} {counts} on {arch}"


def test_rocm_params_respect_the_lane_limit():
    for ws in (32, 64):
        p = tk.rocm_launch_params(ws)
        assert p.num_warps * ws <= 1024 and p.block_l % ws == 0
    with pytest.raises(ValueError, match="wavefront size 16"):
        tk.rocm_launch_params(16)


# -- no recompilation as batch shapes vary -------------------------------------------------------------
def _recorded_launches(n_shapes: int = 100, seed: int = 0) -> list[tuple[torch.dtype, tuple]]:
    """The kernel arguments `TritonWriter` produces for `n_shapes` random batches (no kernel runs)."""
    from multiwrite.backend import WriteBatch

    rng = np.random.default_rng(seed)
    writer = tk.TritonWriter(torch.device("cpu"), tk.cuda_launch_params(), ring_depth=3)
    launches: list[tuple[torch.dtype, tuple]] = []

    def record(dtype, grid0, grid1, args):
        launches.append((dtype, args))
        ring = writer._ring
        ring.done[ring.done_addr.index(args[5])] = args[6]  # as the kernel would: the slot is free

    writer._launch_jit = lambda dtype, np_dtype, g0, g1, args: record(dtype, g0, g1, args)
    tables = {d: [torch.zeros(64, 4096, dtype=d), torch.zeros(3, 64, dtype=d).t()] for d in DTYPES}
    for i in range(n_shapes):
        dtype = DTYPES[i % 3]
        w = int(rng.integers(1, 3000)) if i % 10 == 0 else int(rng.integers(1, 60))
        lengths = rng.integers(0, 4 if i % 7 else 1024, w).astype(np.int32)
        meta = np.zeros((w, META_COLUMNS), dtype=np.int32)
        meta[:, 0] = rng.integers(0, 2, w)
        meta[:, 1] = rng.integers(0, 64, w) if i % 4 else np.arange(w) % 64
        meta[:, 3] = lengths
        meta[:, 4] = np.cumsum(lengths) - lengths
        values = rng.integers(0, 2**20, int(lengths.sum())).astype(SUPPORTED_DTYPES[dtype])
        if not values.shape[0]:
            values = np.ones(1, dtype=values.dtype)
        batch = WriteBatch(tables[dtype], meta, values, may_overlap=bool(i % 4))
        writer.apply([batch])
    return launches


def _cache_keys(fn, launches, target: GPUTarget, params: tk.LaunchParams) -> set[str]:
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, make_backend(target))
    keys = set()
    for dtype, args in launches:
        _, specialization, options = binder(
            *args, tk.TL_DTYPES[dtype], params.block_w, params.block_l, num_warps=params.num_warps, num_stages=1
        )
        keys.add(compute_cache_key({}, specialization, options))
    return keys


@pytest.mark.parametrize(
    "target,params",
    [(GPUTarget("cuda", 90, 32), tk.cuda_launch_params()), (GPUTarget("hip", "gfx942", 64), tk.rocm_launch_params(64))],
    ids=["cuda", "hip"],
)
def test_hundred_batch_shapes_compile_one_variant_per_dtype_and_tile(target, params):
    launches = _recorded_launches()
    assert len(launches) == 100
    rounds = {args[-1] for _, args in launches}
    assert 1 in rounds and max(rounds) > 1, "both the parallel and the rounds path must be covered"
    keys = _cache_keys(tk.compilable_kernel(), launches, target, params)
    assert len(keys) <= len(DTYPES), f"{len(keys)} JIT cache keys (variants) for 100 batch shapes"
    # The check has teeth: the same kernel without do_not_specialize compiles many variants.
    specializing = triton.runtime.JITFunction(tk._write_kernel_fn)
    assert len(_cache_keys(specializing, launches, target, params)) > 3 * len(DTYPES)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
