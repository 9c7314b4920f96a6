"""`multiwrite.vllm.BlockTables` against vLLM 0.33's own class (the oracle, `tox -e vllm`) and against this room's
sequential model (always), in lockstep on random engine-shaped scenarios (tests/vllm/engine.py): new, running,
finished and reused rows, chunked prefill, padding, cp 1/2/4 on every rank with several interleaves, enabled and
sharded flags, -1 requests, sliding windows, `out=`, dummy runs, writes redirected to the null block. Ours also gets
the writes past a row, which it must refuse whole (vLLM would stage part of them, so it never sees them).

`MULTIWRITE_VLLM_SCENARIOS` sets the number of random scenarios per test (default: a few dozen under Triton's
interpreter, hundreds on a GPU). A failure names the scenario's seed, the step and the call.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from tests.vllm.engine import random_config, scenario
from tests.vllm.lockstep import run_lockstep
from tests.vllm.model import ModelBlockTables

GPU = torch.cuda.is_available()
SCENARIOS = int(os.environ.get("MULTIWRITE_VLLM_SCENARIOS", "0")) or (800 if GPU else 160)
CHUNKS = 4
#: Ours on the backend auto-selection picks (None), and on others that run on the test device (a quarter of the
#: scenarios each; on CPU the Triton one runs through the interpreter).
BACKENDS = [None, "torch-generic"] + ([] if GPU else ["torch-cpu", "triton-cuda"])


def ours(device, cfg, backend=None):
    from multiwrite.vllm import BlockTables

    return BlockTables(device=device, **cfg.kwargs(), backend=backend)


def seeds(chunk: int, base: int, n: int = SCENARIOS) -> range:
    return range(base + chunk, base + n, CHUNKS)


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "auto")
def test_matches_vllm_on_engine_steps(oracle, device, backend, chunk):
    calls = 0
    for seed in seeds(chunk, 0 if backend is None else 20_000, SCENARIOS if backend is None else SCENARIOS // 4):
        sc = scenario(seed)
        theirs = oracle.make(device=device, **sc.config.kwargs())
        idx_dtype = torch.int32 if seed % 3 == 0 else torch.int64
        subject = ours(device, sc.config, backend)
        calls += run_lockstep(sc, subject, theirs, device, refusals=True, idx_dtype=idx_dtype)
    assert calls > 0


# every rank of cp 2 and 4, with interleaves 1, 2 and 4 (the block sizes are multiples of 4)
CP_CASES = [(cp, rank, inter) for cp in (2, 4) for rank in range(cp) for inter in (1, 2, 4)]


@pytest.mark.parametrize("cp_size, cp_rank, cp_interleave", CP_CASES)
def test_matches_vllm_under_context_parallelism(oracle, device, cp_size, cp_rank, cp_interleave):
    for k in range(max(2, SCENARIOS // 24)):
        seed = 100_000 + 1000 * cp_size + 100 * cp_rank + 10 * cp_interleave + k
        cfg = random_config(random.Random(seed), groups=1 + k % 3)
        cfg = dataclasses.replace(cfg, cp_size=cp_size, cp_rank=cp_rank, cp_interleave=cp_interleave)
        sc = scenario(seed, config=cfg)
        theirs = oracle.make(device=device, **cfg.kwargs())
        run_lockstep(sc, ours(device, cfg), theirs, device, refusals=True)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_matches_the_model_on_engine_steps(device, chunk):
    """The same comparison without the wheel (the model is itself checked against vLLM: test_model_vs_vllm.py)."""
    for seed in seeds(chunk, 50_000):
        sc = scenario(seed)
        model = ModelBlockTables(device=device, **sc.config.kwargs())
        run_lockstep(sc, ours(device, sc.config), model, device, refusals=True)
