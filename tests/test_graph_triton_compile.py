"""The graph-mode consume kernel and the one-launch captured stage (consume + gather + slot mappings,
`backends/triton_graph.py`) compile for NVIDIA and AMD targets, no GPU.

Compiled in a fresh process without TRITON_INTERPRET, with the constants a `BlockTables` uses (ring depth
8, up to 8 tables). Checks that the header is read with a volatile load (the host writes the ring while
graphs are replayed) and that the completion and counter words are written through to the host; and that the
one-launch stage's flag is published with a release and read with an acquire at GPU scope (its memory ordering).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from multiwrite.backends import triton_graph as tg  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGETS = [("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx90a", 64), ("hip", "gfx942", 64), ("hip", "gfx1100", 32)]
SIGNATURE = {
    "desc_addr": "i64", "headers_addr": "i64", "state_addr": "i64", "mirror_addr": "i64", "limit": "i64",
    "num_tables": "i32", "DEPTH": "constexpr", "NT": "constexpr", "BLOCK_W": "constexpr", "BLOCK_L": "constexpr",
}  # fmt: skip
#: (name, DEPTH, NT): a three-group BlockTables (4 tables) with the default ring, and a deep ring of 8 tables
VARIANTS = [("g3", 8, 4), ("deep", 16, 8)]


#: The one-launch captured stage: (name, DEPTH, NT, idx, qsl, positions pointer types, CP_SIZE, CP_INTERLEAVE,
#: HAS_PADDING, DO_GATHER, DO_SLOTS): G3 decode as an engine captures it, a context-parallel one, a gather only.
ONE_VARIANTS = [
    ("one-g3", 8, 4, "*i32", "*i32", "*i64", 1, 1, True, True, True),
    ("one-cp", 16, 8, "*i64", "*i64", "*i32", 4, 2, False, True, True),
    ("one-gather", 8, 4, "*i32", "*i32", "*i64", 1, 1, False, True, False),
]
#: Scalar and address parameters of the one-launch stage (pointer types of the step inputs: per variant).
ONE_SCALARS = {
    "desc_addr": "i64", "headers_addr": "i64", "state_addr": "i64", "mirror_addr": "i64", "limit": "i64",
    "num_tables": "i32", "sync_addr": "i64", "desc_ptr": "*i64", "num_blocks_ptr": "*i32", "nb_stride": "i64",
    "pad_ptr": "*u8", "slot_ptr": "*i64", "slot_stride": "i64", "num_reqs": "i32", "num_reqs_padded": "i32",
    "max_tokens": "i32", "num_positions": "i32", "max_num_reqs": "i32", "cp_rank": "i32",
}  # fmt: skip


def _compile_one(target: GPUTarget, variant: tuple):
    from multiwrite.backends import triton_stage as ts

    _, depth, nt, idx, qsl, pos, cp, interleave, padding, gather, slots = variant
    fn = tg.compilable_consume_and_stage_kernel()
    types = {**ONE_SCALARS, "idx_ptr": idx, "qsl_ptr": qsl, "pos_ptr": pos}
    signature = {p.name: "constexpr" if p.is_constexpr else types[p.name] for p in fn.params}
    constexprs = {
        "DEPTH": depth, "NT": nt, "BLOCK_W": tg.BLOCK_W, "BLOCK_L": tg.BLOCK_L, "CP_SIZE": cp,
        "CP_INTERLEAVE": interleave, "HAS_PADDING": padding, "DO_GATHER": gather, "DO_SLOTS": slots, "BLOCK": ts.BLOCK,
    }  # fmt: skip
    assert list(constexprs) == [p.name for p in fn.params if p.is_constexpr]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": tg.NUM_WARPS, "num_stages": 1})


def _worker() -> None:
    out = {}
    for backend, arch, warp_size in TARGETS:
        for variant in ONE_VARIANTS:
            k = _compile_one(GPUTarget(backend, arch, warp_size), variant)
            binary, isa = ("cubin", "ptx") if backend == "cuda" else ("hsaco", "amdgcn")
            out[f"{arch}-{variant[0]}"] = {
                "binary": base64.b64encode(k.asm[binary]).decode(), "isa": k.asm[isa],
                "warps": k.metadata.num_warps, "warp_size": k.metadata.warp_size,
            }  # fmt: skip
    fn = tg.compilable_consume_kernel()
    assert [p.name for p in fn.params] == list(SIGNATURE)
    for backend, arch, warp_size in TARGETS:
        for name, depth, nt in VARIANTS:
            constexprs = {"DEPTH": depth, "NT": nt, "BLOCK_W": tg.BLOCK_W, "BLOCK_L": tg.BLOCK_L}
            src = triton.compiler.ASTSource(fn=fn, signature=SIGNATURE, constexprs=constexprs)
            k = triton.compile(
                src, target=GPUTarget(backend, arch, warp_size), options={"num_warps": tg.NUM_WARPS, "num_stages": 1}
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


@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
@pytest.mark.parametrize("target", TARGETS, ids=[f"sm_{a}" if b == "cuda" else a for b, a, _ in TARGETS])
def test_consume_kernel_compiles(compiled, target, variant):
    backend, arch, warp_size = target
    k = compiled[f"{arch}-{variant}"]
    assert len(base64.b64decode(k["binary"])) > 0
    assert k["warps"] == tg.NUM_WARPS and k["warp_size"] == warp_size
    isa = k["isa"]
    if backend == "cuda":
        # The header (written by the host between replays) is read with a volatile load on every Triton; the
        # metadata and values ask for .cv, which Triton 3.6 drops (as for the apply kernel; each run is a new
        # launch, and the host writes a slot before publishing it).
        assert "ld.volatile.global" in isa, "the host-written header needs a volatile load"
        assert "st.global.wt" in isa  # the completion token and the consumed count reach the host
        assert "bar.sync" in isa  # rounds and headers are separated by barriers
    else:
        assert "global_store" in isa or "buffer_store" in isa, isa[:2000]


#: AMD: what an acquire at agent (GPU) scope invalidates, per target (the LLVM AMDGPU memory model).
AMD_ACQUIRE = {"gfx90a": "buffer_wbinvl1_vol", "gfx942": "buffer_inv sc1", "gfx1100": "buffer_gl1_inv"}


@pytest.mark.parametrize("variant", [v[0] for v in ONE_VARIANTS])
@pytest.mark.parametrize("target", TARGETS, ids=[f"sm_{a}" if b == "cuda" else a for b, a, _ in TARGETS])
def test_one_launch_stage_compiles_with_its_memory_ordering(compiled, target, variant):
    """The ticket, the release of the consumed flag, the acquiring spin and the finish counter are GPU-scope
    atomics; no table load goes through the non-coherent path, which an acquire does not cover."""
    backend, arch, warp_size = target
    k = compiled[f"{arch}-{variant}"]
    assert len(base64.b64decode(k["binary"])) > 0
    assert k["warps"] == tg.NUM_WARPS and k["warp_size"] == warp_size
    isa = k["isa"]
    if backend == "cuda":
        assert re.search(r"atom\.global\.gpu\.(relaxed\.)?add", isa), "the ticket"
        assert re.search(r"atom\.global\.gpu\.release\.exch", isa), "the consumed flag, published with release"
        assert re.search(r"(ld|atom)\.global\.gpu\.acquire", isa), "the spin on the flag, with acquire"
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add", isa), "the finish counter"
        assert "ld.global.nc" not in isa
        assert "ld.volatile.global" in isa and "st.global.wt" in isa  # the consume's header read, completion token
    else:
        assert "global_atomic_add" in isa and "global_atomic_swap" in isa, isa[:2000]
        assert AMD_ACQUIRE[arch] in isa, "the acquiring spin invalidates the caches the table loads go through"


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
