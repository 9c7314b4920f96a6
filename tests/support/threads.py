"""Workers on threads that interleave as often as Python allows."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def run_interleaved(worker: Callable[[int, Callable[[], None]], None], threads: int = 8) -> list[str]:
    """Run `worker(seed, ready)` for seeds 0..threads-1 on that many threads at once, switching threads as often as
    Python allows (so that their staging and applies interleave), and wait for all of them. `ready()` returns once
    every thread has called it (a worker calls it when its tables are built, so that the work itself overlaps).

    Returns `thread <seed>: <exception>` for each worker that raised, in seed order (empty when none did); a worker
    that raises before `ready()` breaks it for the others (`threading.BrokenBarrierError`) instead of leaving them
    waiting."""
    barrier = threading.Barrier(threads)
    failures: dict[int, str] = {}

    def run(seed: int) -> None:
        try:
            worker(seed, barrier.wait)
        except Exception as exc:  # noqa: BLE001 - returned with the thread's seed
            failures[seed] = f"thread {seed}: {exc!r}"
            barrier.abort()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        started = [threading.Thread(target=run, args=(seed,)) for seed in range(threads)]
        for t in started:
            t.start()
        for t in started:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    return [failures[seed] for seed in sorted(failures)]
