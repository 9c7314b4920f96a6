"""Issue 8's soak in CI: 100,000 applies per native CPU backend over long- and short-lived tables.

Bounds (asserted by `soak_util.soak`, growth from a snapshot after the first 10% of applies to the end):
at most 4 more `weakref.finalize` registrations, at most 100 more live objects of any one Python type,
no backend container (cache) longer than 64 entries, at most 32 MiB more resident memory. Measured on
the 2-core CI machine: about 5 s for compiled-cpu and 20 s for torch-cpu. Triton's interpreter needs
about 30 ms an apply, so interpreted backends get 150 applies (about 5 s each); the GPU run uses `soak`
with 100,000 applies and pinned-memory checks.
"""

from __future__ import annotations

from soak_util import soak


def test_soak_resources_stay_flat(backend):
    interpreted = backend.device.type == "cpu" and backend.name.startswith("triton")
    growth = soak(backend.name, backend.device, 150 if interpreted else 100_000)
    assert growth["finalizers"] <= 4
