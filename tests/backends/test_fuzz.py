"""The differential fuzz on every built-in backend: random batches of writes, clears, resizes (setter and `set_`),
partial applies and BlockTables appends against `multiwrite.reference`, refusals included; with the engine's apply
arguments (iterators, a table listed twice, two tables over one memory) too. 10,000 batches natively (2,000 with the
engine's arguments); Triton's interpreter runs a batch in about 75 ms, so interpreted backends get 100.
`MULTIWRITE_FUZZ_BATCHES=N` sets the count for every backend."""

from __future__ import annotations

import os

import pytest

from tests.support.fuzz import run_fuzz

SEED = 20240808


@pytest.mark.parametrize("engine_args", [False, True], ids=["plain", "engine arguments"])
def test_random_batches_equal_the_reference(backend, engine_args):
    forced = os.environ.get("MULTIWRITE_FUZZ_BATCHES")
    batches = int(forced) if forced else 100 if backend.interpreted else 2_000 if engine_args else 10_000
    stats = run_fuzz(backend.name, backend.device, batches, SEED, engine_args=engine_args)
    assert all(count > 0 for count in stats.values()), stats  # every kind of operation exercised, refusals included
