"""The stage kernel (`backends/triton_stage.py`) compiles to machine code for NVIDIA and AMD targets, no GPU.

Variants the launchers produce are compiled: without and with context parallelism, without and with an
`is_padding` mask, int32 and int64 index inputs, both jobs or one; and the one-launch stage (`launch_fused`:
apply + gather + slot mappings) in its plain and its context-parallel, padded variant. Compiling runs in a fresh
process without TRITON_INTERPRET.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from multiwrite.backends import triton_stage as ts  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGETS = [("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx90a", 64), ("hip", "gfx942", 64), ("hip", "gfx1100", 32)]
#: (name, index dtype, position dtype, CP_SIZE, CP_INTERLEAVE, HAS_PADDING, DO_GATHER, DO_SLOTS, PDL); the PDL
#: variants (the captured stage after graph mode's consume kernel) are built for sm_90 and newer only
VARIANTS = [
    ("both", "*i32", "*i64", 1, 1, False, True, True, False),
    ("cp-padded", "*i64", "*i32", 4, 2, True, True, True, False),
    ("gather", "*i32", "*i64", 1, 1, False, True, False, False),
    ("slots", "*i32", "*i64", 2, 1, True, False, True, False),
    ("both-pdl", "*i32", "*i64", 1, 1, False, True, True, True),
    ("cp-padded-pdl", "*i64", "*i32", 4, 2, True, True, True, True),
]


def _built_for(variant: str, target: tuple) -> bool:
    return not variant.endswith("pdl") or (target[0] == "cuda" and target[1] >= 90)


def _signature(idx: str, pos: str) -> dict[str, str]:
    return {
        "desc_ptr": "*i64", "num_blocks_ptr": "*i32", "nb_stride": "i64", "idx_ptr": idx, "qsl_ptr": "*i32",
        "pos_ptr": pos, "pad_ptr": "*u8", "slot_ptr": "*i64", "slot_stride": "i64", "num_reqs": "i32",
        "num_reqs_padded": "i32", "max_tokens": "i32", "num_positions": "i32", "max_num_reqs": "i32",
        "cp_rank": "i32", "CP_SIZE": "constexpr",
        "CP_INTERLEAVE": "constexpr", "HAS_PADDING": "constexpr", "DO_GATHER": "constexpr", "DO_SLOTS": "constexpr",
        "BLOCK": "constexpr", "PDL": "constexpr",
    }  # fmt: skip


#: The one-launch stage (apply + gather + slot mappings): (name, idx, qsl, positions dtypes, CP_SIZE,
#: CP_INTERLEAVE, HAS_PADDING, DO_GATHER, DO_SLOTS), as `triton_stage.launch_fused` produces them.
FUSED_VARIANTS = [
    ("fused", "int32", "int32", "int64", 1, 1, False, True, True),
    ("fused-cp-padded", "int64", "int64", "int32", 4, 2, True, True, True),
]


def _compile_fused(target: GPUTarget, variant: tuple):
    _, idx, qsl, pos, cp, interleave, padding, gather, slots = variant
    fn = ts.compilable_fused_kernel()
    tl = triton.language
    constexprs = {
        "IDX_DTYPE": getattr(tl, idx), "QSL_DTYPE": getattr(tl, qsl), "POS_DTYPE": getattr(tl, pos), "CP_SIZE": cp,
        "CP_INTERLEAVE": interleave, "HAS_PADDING": padding, "DO_GATHER": gather, "DO_SLOTS": slots,
        "BLOCK": ts.BLOCK, "BLOCK_W": ts.APPLY_W, "BLOCK_L": ts.APPLY_L, "SCAN": ts.SCAN_W, "MAX_R": ts.MAX_ROUNDS,
    }  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else p.annotation for p in fn.params}
    assert list(constexprs) == [p.name for p in fn.params if p.is_constexpr]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": ts.NUM_WARPS, "num_stages": 1})


def _worker() -> None:
    out = {}
    fn = ts.compilable_kernel()
    assert [p.name for p in fn.params] == list(_signature("*i32", "*i64"))
    for backend, arch, warp_size in TARGETS:
        for variant in FUSED_VARIANTS:
            k = _compile_fused(GPUTarget(backend, arch, warp_size), variant)
            binary, isa = ("cubin", "ptx") if backend == "cuda" else ("hsaco", "amdgcn")
            out[f"{arch}-{variant[0]}"] = {
                "binary": base64.b64encode(k.asm[binary]).decode(), "isa": k.asm[isa],
                "warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
            }  # fmt: skip
        for name, idx, pos, cp, interleave, padding, gather, slots, pdl in VARIANTS:
            if not _built_for(name, (backend, arch)):
                continue
            constexprs = {"CP_SIZE": cp, "CP_INTERLEAVE": interleave, "HAS_PADDING": padding, "DO_GATHER": gather,
                          "DO_SLOTS": slots, "BLOCK": ts.BLOCK, "PDL": pdl}  # fmt: skip
            src = triton.compiler.ASTSource(fn=fn, signature=_signature(idx, pos), constexprs=constexprs)
            k = triton.compile(
                src, target=GPUTarget(backend, arch, warp_size), options={"num_warps": ts.NUM_WARPS, "num_stages": 1}
            )
            binary, isa = ("cubin", "ptx") if backend == "cuda" else ("hsaco", "amdgcn")
            out[f"{arch}-{name}"] = {
                "binary": base64.b64encode(k.asm[binary]).decode(), "isa": k.asm[isa],
                "warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
            }  # fmt: skip
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CASES = [(t, v[0]) for v in VARIANTS + FUSED_VARIANTS for t in TARGETS if _built_for(v[0], t)]


@pytest.mark.parametrize(
    ("target", "variant"), _CASES, ids=[f"{'sm_' if t[0] == 'cuda' else ''}{t[1]}-{v}" for t, v in _CASES]
)
def test_stage_kernel_compiles(compiled, target, variant):
    backend, arch, warp_size = target
    k = compiled[f"{arch}-{variant}"]
    assert len(base64.b64decode(k["binary"])) > 0
    assert k["warps"] == ts.NUM_WARPS and k["warp_size"] == warp_size
    isa = k["isa"]
    if backend == "cuda":
        assert "st.global" in isa and "ld.global" in isa
        if variant.startswith("fused"):  # the slot guard: the completion counter of the whole grid
            assert "atom.global" in isa
        # The captured stage waits for the consume kernel's stores before it reads the tables: in the PDL
        # variants only (elsewhere the launch order is the stream's).
        assert ("griddepcontrol.wait" in isa) == variant.endswith("pdl")
    else:
        assert "global_store" in isa or "buffer_store" in isa, isa[:2000]
        if variant.startswith("fused"):
            assert "global_atomic" in isa or "buffer_atomic" in isa, isa[:2000]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
