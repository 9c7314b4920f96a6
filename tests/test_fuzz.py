"""Issue 8's differential fuzz, per backend, in CI: random batches against `multiwrite.reference`.

The harness is `fuzz_util.run_fuzz` (shared with the GPU run). Counts: 10,000 batches per native CPU
backend (about 16 s each on the 2-core CI machine). Triton's interpreter runs a batch in about 75 ms
(10,000 would take about 13 minutes per Triton backend), so interpreted backends default to 100
batches; `MULTIWRITE_FUZZ_BATCHES=N` sets the count for every backend (the GPU run uses 10,000).
"""

from __future__ import annotations

import os

from fuzz_util import run_fuzz

SEED = 20240808


def fuzz_batches(backend) -> int:
    """Batches per backend: `$MULTIWRITE_FUZZ_BATCHES`, else 10,000 natively, 100 interpreted."""
    forced = os.environ.get("MULTIWRITE_FUZZ_BATCHES")
    if forced:
        return int(forced)
    interpreted = backend.device.type == "cpu" and backend.name.startswith("triton")
    return 100 if interpreted else 10_000


def test_fuzz_against_reference(backend):
    stats = run_fuzz(backend.name, backend.device, fuzz_batches(backend), SEED)
    # the fuzz must have exercised every kind of operation, refusals included
    assert all(count > 0 for count in stats.values()), stats


def test_fuzz_with_engine_arguments(backend):
    """Iterators, a table listed twice, and two tables over the same memory in the apply arguments."""
    batches = min(fuzz_batches(backend), 2_000)
    run_fuzz(backend.name, backend.device, batches, SEED, engine_args=True)
