"""Workers on threads that interleave as often as Python allows."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def run_interleaved(worker: Callable[[int], None], threads: int = 8) -> None:
    """Run `worker(seed)` for seeds 0..threads-1 on that many threads at once, switching threads as often as
    Python allows (so that their staging and applies interleave), and wait for all of them."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        started = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
        for t in started:
            t.start()
        for t in started:
            t.join()
    finally:
        sys.setswitchinterval(interval)
