"""The soak on every built-in backend: 100,000 applies (150 through Triton's interpreter) over long- and short-lived
tables; from a snapshot after the first tenth to the end, at most 4 more `weakref.finalize` registrations, at most 100
more live objects of any one type, no container of the backend (or of its per-device state) past 64 entries, at most
32 MiB more resident memory (`tests.support.soak.soak`)."""

from __future__ import annotations

from tests.support.soak import soak


def test_resources_stay_flat(backend):
    growth = soak(backend.name, backend.device, 150 if backend.interpreted else 100_000)
    assert growth["finalizers"] <= 4
