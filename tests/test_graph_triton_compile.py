"""The graph-mode consume kernel (`backends/triton_graph.py`) compiles for NVIDIA and AMD targets, no GPU.

Compiled in a fresh process without TRITON_INTERPRET, with the constants a `BlockTables` uses (ring depth
8, up to 8 tables). Checks that the header entry is read with plain loads (volatile ones are not coalesced)
and that the completion and counter words are written through to the host.
"""

from __future__ import annotations

import base64
import json
import os
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
    "LAUNCH_DEPENDENTS": "constexpr",
}  # fmt: skip
#: (name, DEPTH, NT, LAUNCH_DEPENDENTS): a three-group BlockTables (4 tables) with the default ring, a deep ring of
#: 8 tables, and the g3 kernel that lets the captured stage kernel start early (`GraphStage.pdl`: sm_90 and newer)
VARIANTS = [("g3", 8, 4, False), ("deep", 16, 8, False), ("g3-pdl", 8, 4, True)]


def _targets(variant: str) -> list[tuple]:
    """The targets a variant is built for: programmatic dependent launch is NVIDIA sm_90+ only."""
    return [t for t in TARGETS if not variant.endswith("pdl") or (t[0] == "cuda" and t[1] >= 90)]


def _worker() -> None:
    out = {}
    fn = tg.compilable_consume_kernel()
    assert [p.name for p in fn.params] == list(SIGNATURE)
    for name, depth, nt, dependents in VARIANTS:
        for backend, arch, warp_size in _targets(name):
            constexprs = {
                "DEPTH": depth, "NT": nt, "BLOCK_W": tg.BLOCK_W, "BLOCK_L": tg.BLOCK_L, "LAUNCH_DEPENDENTS": dependents,
            }  # fmt: skip
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


@pytest.mark.parametrize(
    ("target", "variant"),
    [(t, v[0]) for v in VARIANTS for t in _targets(v[0])],
    ids=[f"{'sm_' if t[0] == 'cuda' else ''}{t[1]}-{v[0]}" for v in VARIANTS for t in _targets(v[0])],
)
def test_consume_kernel_compiles(compiled, target, variant):
    backend, arch, warp_size = target
    k = compiled[f"{arch}-{variant}"]
    assert len(base64.b64decode(k["binary"])) > 0
    assert k["warps"] == tg.NUM_WARPS and k["warp_size"] == warp_size
    isa = k["isa"]
    if backend == "cuda":
        # The header entry and its inline batch are read with plain loads asking for .cv (which Triton 3.6 drops):
        # each run is a new launch reading entries published before it was issued; one read while the host
        # writes it is caught by the inline checksum and read again. No volatile load: those are not coalesced.
        assert "ld.volatile.global" not in isa
        assert "st.global.wt" in isa  # the completion token and the consumed count reach the host
        assert "bar.sync" in isa  # rounds and headers are separated by barriers
        # The early start of the captured stage kernel: asked for exactly in the variant built for it.
        assert ("griddepcontrol.launch_dependents" in isa) == variant.endswith("pdl")
    else:
        assert "global_store" in isa or "buffer_store" in isa, isa[:2000]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
