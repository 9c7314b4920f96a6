"""Every Triton kernel compiles to machine code for the NVIDIA and AMD targets the backends serve, without a GPU: the
apply kernel (each dtype, both tiles), the stage kernel (with and without the staged writes, context parallelism,
padding, one job or both, and its programmatic-dependent-launch variant) and graph mode's consume kernel, with the
launch parameters and compile-time constants the launchers use. `griddepcontrol` appears in the PDL variants only
(sm_90), and no per-launch parameter is a specialization key (a new batch shape never recompiles).

Compiling needs a process without TRITON_INTERPRET (with it set at import, Triton's own helpers are interpreter
functions): the tests run this file as a worker (`python test_triton_compile.py --worker`), which prints what each
compiled kernel holds as JSON. tox's `triton36` environment runs this file again under Triton 3.6.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import pytest

#: name -> (backend, arch, wavefront as the runtime reports it: 64 on CDNA, 32 by default on RDNA3)
TARGETS = {
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx1100": ("hip", "gfx1100", 32),
}
PDL_TARGETS = ("sm_90",)  # programmatic dependent launch: NVIDIA compute capability 9.0 and newer
DTYPES = ("int32", "int64", "float32")
#: stage kernel variants: (name, IDX, QSL, POS dtypes, CP_SIZE, CP_INTERLEAVE, HAS_PADDING, DO_GATHER, DO_SLOTS,
#: HAS_WRITES, HAS_WINDOW, PDL), as `TritonPlan` launches them (PDL: captured stage launches, never with the writes;
#: HAS_WINDOW: the sliding-window cut, `num_computed_tokens` int32)
STAGE = [
    ("both", "int32", "int64", "int64", 1, 1, False, True, True, False, False, False),
    ("both-writes", "int32", "int32", "int64", 1, 1, False, True, True, True, False, False),
    ("cp-padded-writes", "int64", "int64", "int32", 4, 2, True, True, True, True, False, False),
    ("gather", "int64", "int64", "int64", 1, 1, False, True, False, False, False, False),
    ("gather-window-writes", "int64", "int64", "int64", 1, 1, False, True, False, True, True, False),
    ("slots-cp", "int32", "int32", "int64", 2, 1, True, False, True, False, False, False),
    ("both-pdl", "int32", "int64", "int64", 1, 1, False, True, True, False, False, True),
    ("cp-padded-pdl", "int64", "int64", "int32", 4, 2, True, True, True, False, False, True),
]
#: consume kernel variants: (name, DEPTH, NT, LAUNCH_DEPENDENTS): three groups and the default ring, a deep ring of
#: eight tables, and the variant whose captured stage launch is its programmatic dependent launch
CONSUME = [("g3", 8, 4, False), ("deep", 16, 8, False), ("g3-pdl", 8, 4, True)]
#: device-writes kernel variants as `DeviceWritesRunner` launches them: (table dtype, tile, sets whose descriptors are
#: arguments, the sources' one dtype code or "m" where they differ)
DEVICE_WRITES = [("int32", "short", 1, 1), ("int32", "medium", 2, 1), ("int32", "long", 2, 1),
                 ("int32", "ordered", 2, "m"), ("int64", "long", 0, 0), ("float32", "long", 1, 2),
                 ("int32", "long", 2, "m")]  # fmt: skip


def cases() -> list[tuple[str, str, str]]:
    """(kernel, variant, target) of every compile."""
    out = []
    for target in TARGETS:
        out += [("apply", f"{d}-{tile}", target) for d in DTYPES for tile in ("main", "decode")]
        out += [("stage", v[0], target) for v in STAGE if not v[-1] or target in PDL_TARGETS]
        out += [("consume", v[0], target) for v in CONSUME if not v[-1] or target in PDL_TARGETS]
        out += [("device_writes", f"{d}-{tile}-{a}-{c}", target) for d, tile, a, c in DEVICE_WRITES]
    return out


# -- the worker (runs without TRITON_INTERPRET) --------------------------------------------------------------------
def _params(target: str):
    """The launch parameters the backend of `target` uses (triton-rocm asks the device for its wavefront size)."""
    import types

    import torch

    from multiwrite.backends.triton.backend import TritonCudaBackend, TritonRocmBackend

    backend, _, warp = TARGETS[target]
    if backend == "cuda":
        return TritonCudaBackend().launch_params(torch.device("cuda", 0))
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(warp_size=warp)
    try:
        return TritonRocmBackend().launch_params(torch.device("cuda", 0))
    finally:
        torch.cuda.get_device_properties = real


def _kernel(kernel: str):
    from multiwrite.backends.triton.kernels import apply, consume, device_writes, stage
    from multiwrite.backends.triton.kernels.common import compilable

    mod, fn = {"apply": (apply, apply.apply_kernel_fn), "stage": (stage, stage.stage_kernel_fn),
               "consume": (consume, consume.consume_kernel_fn),
               "device_writes": (device_writes, device_writes.device_writes_kernel_fn)}[kernel]  # fmt: skip
    return mod, compilable(fn, mod.DO_NOT_SPECIALIZE)


def _constants(kernel: str, variant: str, target: str) -> tuple[dict, int]:
    """The compile-time constants and warps of a variant."""
    import triton.language as tl

    mod, _ = _kernel(kernel)
    if kernel == "apply":
        params = _params(target)
        dtype, tile = variant.split("-")
        decode = tile == "decode"
        bw, bl = (params.decode_block_w, params.decode_block_l) if decode else (params.block_w, params.block_l)
        return {"VALUE_DTYPE": getattr(tl, dtype), "BLOCK_W": bw, "BLOCK_L": bl}, params.num_warps
    if kernel == "device_writes":
        from multiwrite.backends.triton.device_writes import _TILES, SCAN_W

        dtype, tile, arg_sets, code = variant.split("-")
        bw, bl = _TILES[tile]
        return {"VALUE_DTYPE": getattr(tl, dtype), "BLOCK_W": bw, "BLOCK_L": bl, "SCAN_W": SCAN_W,
                "ORDERED": tile == "ordered", "ARG_SETS": int(arg_sets),
                "SOURCE": -1 if code == "m" else int(code)}, 4  # fmt: skip
    if kernel == "stage":
        ((_, idx, qsl, pos, cp, interleave, padding, gather, slots, writes, window, pdl),) = (
            v for v in STAGE if v[0] == variant
        )
        return {"IDX_DTYPE": getattr(tl, idx), "QSL_DTYPE": getattr(tl, qsl), "POS_DTYPE": getattr(tl, pos),
                "CP_SIZE": cp, "CP_INTERLEAVE": interleave, "HAS_PADDING": padding, "NCT_DTYPE": tl.int32,
                "HAS_WINDOW": window, "DO_GATHER": gather, "DO_SLOTS": slots, "HAS_WRITES": writes,
                "PDL": pdl}, mod.NUM_WARPS  # fmt: skip
    _, depth, nt, dependents = next(v for v in CONSUME if v[0] == variant)
    return {"DEPTH": depth, "NT": nt, "LAUNCH_DEPENDENTS": dependents}, mod.NUM_WARPS


def _spills(ptx: str, arch: int) -> list[int]:
    """[spill store bytes, spill load bytes] of the PTX, from the ptxas Triton itself uses for its `.target`."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch)
    ptxas = getattr(tool, "path", tool)
    gpu = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stdout + out.stderr)
    return [int(m.group(1)), int(m.group(2))] if m else [-1, -1]


def compile_one(case: tuple[str, str, str]) -> dict:
    """Compile one case; what the tests check about it."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel, variant, target = case
    _, fn = _kernel(kernel)
    constexprs, warps = _constants(kernel, variant, target)
    signature = {p.name: "constexpr" if p.is_constexpr else p.annotation for p in fn.params}
    assert [p.name for p in fn.params if p.is_constexpr] == list(constexprs), "constexprs out of step"
    backend, arch, warp = TARGETS[target]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget(backend, arch, warp), options={"num_warps": warps, "num_stages": 1})
    isa = k.asm["ptx" if backend == "cuda" else "amdgcn"]
    binary = k.asm["cubin" if backend == "cuda" else "hsaco"]
    gdc = sorted(set(re.findall(r"griddepcontrol\.(\w+)", isa)))
    facts = {"binary": len(binary), "warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
             "expected_warps": warps, "griddepcontrol": gdc}  # fmt: skip
    if backend == "cuda":
        facts.update(store="st.global" in isa, load="ld.global" in isa, atomic="atom.global" in isa,
                     volatile="ld.volatile.global" in isa, write_through="st.global.wt" in isa,
                     barrier="bar.sync" in isa or "barrier.sync" in isa)  # fmt: skip
        if kernel == "apply":
            facts["spills"] = _spills(isa, arch)
        from multiwrite.backends.triton.launcher import driver_param_kinds

        start = isa.index(".entry")
        header = isa[start : isa.index(")", start)]
        facts["ptx_params"] = [int(b) // 8 for b in re.findall(r"\.param\s+\.[bsu](\d+)", header)]
        facts["driver_kinds"] = list(driver_param_kinds(k, len(constexprs)))
    else:
        facts.update(store=bool(re.search(r"\b(global|buffer|flat)_store", isa)),
                     atomic=bool(re.search(r"\b(global|buffer|flat)_atomic", isa)),
                     spills=[max([int(x) for x in re.findall(rf"\.{w}_spill_count:\s+(\d+)", isa)] or [-1])
                             for w in ("vgpr", "sgpr")])  # fmt: skip
    return facts


def specialization_keys(kernel: str, target: str, specialize: bool) -> int:
    """How many JIT cache keys (compiled variants) Triton's binder gives for twelve launches of one variant whose
    per-launch arguments vary (1, multiples of 16 and not, large addresses): 1 when nothing specializes. With
    `specialize`, the same kernel without its DO_NOT_SPECIALIZE list (the check's teeth)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    mod, fn = _kernel(kernel)
    if specialize:
        fn = triton.runtime.JITFunction(fn.fn)
    variant = {"apply": "int32-main", "stage": "both-writes", "consume": "g3",
               "device_writes": "int32-long-2-1"}[kernel]  # fmt: skip
    constexprs, warps = _constants(kernel, variant, target)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget(*TARGETS[target])))
    values = [1, 16, 17, 32, 4104, (1 << 33) + 16, 3, 64 * 1024]
    runtime = [p for p in fn.params if not p.is_constexpr]
    keys = set()
    for i in range(12):
        args = [values[(i * (j + 1) + j) % len(values)] for j in range(len(runtime))]
        _, specialization, options = binder(*args, *constexprs.values(), num_warps=warps, num_stages=1)
        keys.add(compute_cache_key({}, specialization, options))
    return len(keys)


def _worker() -> None:
    todo = cases()
    with ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        compiled = dict(zip(("/".join(c) for c in todo), pool.map(compile_one, todo)))
    keys = {f"{k}/{t}/{s}": specialization_keys(k, t, s) for k in ("apply", "stage", "consume", "device_writes")
            for t in ("sm_90", "gfx942") for s in (False, True)}  # fmt: skip
    print(json.dumps({"compiled": compiled, "keys": keys}))


# -- the tests ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker() -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, capture_output=True,
                          text=True, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = cases()


@pytest.mark.parametrize("kernel, variant, target", CASES, ids=["/".join(c) for c in CASES])
def test_the_kernel_compiles_to_machine_code(worker, kernel, variant, target):
    k = worker["compiled"][f"{kernel}/{variant}/{target}"]
    backend = TARGETS[target][0]
    assert k["binary"] > 0
    assert k["warps"] == k["expected_warps"] and k["warp_size"] == TARGETS[target][2]
    assert k["warps"] * k["warp_size"] <= 1024, "AMD (and NVIDIA) refuse programs of more than 1024 lanes"
    assert k["store"], "no store to global memory"
    pdl = variant.endswith("pdl")
    assert bool(k["griddepcontrol"]) == pdl, f"griddepcontrol {k['griddepcontrol']} (PDL variant: {pdl})"
    if pdl:
        assert k["griddepcontrol"] == (["launch_dependents"] if kernel == "consume" else ["wait"])
    if kernel in ("apply", "device_writes") or variant.endswith("writes"):  # the completion counter
        assert k["atomic"], "no atomic: the staging memory would never be handed back"
    if backend == "cuda":
        assert k["load"]
    if kernel == "consume" and backend == "cuda":
        # Header entries are read with plain loads (volatile ones are not coalesced; a torn read is caught by the
        # inline checksum); the completion token and the counts are written through to the host; barriers keep
        # rounds and headers in order.
        assert not k["volatile"] and k["write_through"] and k["barrier"]
    if kernel == "apply":
        assert k["spills"] == [0, 0], f"register spills {k['spills']}"
    if backend == "cuda":  # the driver launch's layout: the passed arguments in order, then the scratch pointers
        passed = [b for b in k["driver_kinds"] if b]
        assert k["ptx_params"][: len(passed)] == passed and len(passed) > 0
        assert k["ptx_params"][len(passed) :] in ([], [8], [8, 8]), k["ptx_params"]


def test_no_per_launch_parameter_is_a_specialization_key(worker):
    from multiwrite.backends.triton.kernels import apply, consume, device_writes, stage

    for mod, fn in ((apply, apply.apply_kernel_fn), (stage, stage.stage_kernel_fn),
                    (consume, consume.consume_kernel_fn),
                    (device_writes, device_writes.device_writes_kernel_fn)):  # fmt: skip
        import inspect

        params = inspect.signature(fn).parameters.values()
        runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
        assert list(mod.DO_NOT_SPECIALIZE) == runtime, f"{fn.__name__}: DO_NOT_SPECIALIZE is not its runtime parameters"
    for kernel in ("apply", "stage", "consume", "device_writes"):
        for target in ("sm_90", "gfx942"):
            assert worker["keys"][f"{kernel}/{target}/False"] == 1, f"{kernel} on {target} recompiles per launch"
            assert worker["keys"][f"{kernel}/{target}/True"] > 3, "the check has no teeth"


def test_rocm_launch_parameters_follow_the_wavefront_within_1024_lanes(monkeypatch):
    import types

    import torch

    from multiwrite.backends.triton.backend import TritonRocmBackend

    for warp in (32, 64):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, w=warp: types.SimpleNamespace(warp_size=w))
        p = TritonRocmBackend().launch_params(torch.device("cuda", 0))
        assert p.num_warps * warp == 256 and p.block_l % warp == 0 and p.warp_size == warp
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(warp_size=16))
    with pytest.raises(ValueError, match="wavefront size 16"):
        TritonRocmBackend().launch_params(torch.device("cuda", 0))


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
