"""Distinct objects on distinct threads at once, one device, one backend instance (README, thread safety): each thread
owns a `BlockTables` (some writes staged then cleared), two `StagedWriteTensor`s (two arenas of one dtype: a fused
apply merges them, through the Triton backends' shared ring), short-lived tables that fill and evict the backend's
caches, its `FusedStagedWriter` and `apply_writes` (one shared writer per thread); every table must end equal to
its thread's reference. Every built-in backend; through Triton's interpreter few steps (it runs ~50 launches/s)."""

from __future__ import annotations

from multiwrite import select_backend
from tests.backends.thread_work import run_threads


def test_eight_threads_with_their_own_objects_match_their_references(backend):
    be = select_backend(backend.device, backend.name)
    auto = be is select_backend(backend.device)  # then the auto-selected backend, and apply_writes, are used
    assert run_threads(8, 3 if backend.interpreted else 40, backend.device, None if auto else be) == []
