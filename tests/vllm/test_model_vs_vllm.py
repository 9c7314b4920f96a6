"""The harness checked on vLLM alone: vLLM 0.33's `BlockTables` against this room's sequential model
(tests/vllm/model.py) on random engine-shaped scenarios. A difference here is a fault of the model, the scenario
generator or the stand-ins, not of multiwrite; these need the oracle (`tox -e vllm`)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.vllm.engine import scenario
from tests.vllm.lockstep import run_lockstep
from tests.vllm.model import ModelBlockTables

SCENARIOS = int(os.environ.get("MULTIWRITE_VLLM_SCENARIOS", "0")) or (800 if torch.cuda.is_available() else 100)


@pytest.mark.parametrize("chunk", range(4))
def test_vllm_matches_the_model(oracle, device, chunk):
    calls = 0
    for seed in range(chunk, SCENARIOS, 4):
        sc = scenario(10_000 + seed)
        theirs = oracle.make(device=device, **sc.config.kwargs())
        model = ModelBlockTables(device=device, **sc.config.kwargs())
        idx_dtype = torch.int32 if seed % 3 == 0 else torch.int64
        calls += run_lockstep(sc, model, theirs, device, idx_dtype=idx_dtype)
    assert calls > 0
