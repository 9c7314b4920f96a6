"""The soak of issue 8: many applies over long- and short-lived tables, resource use must stay flat.

`soak(backend, device, applies)` is shared by `tests/test_soak.py` (CPU, in CI) and the GPU run (device
cuda, more applies, `memory=` a function returning allocated and pinned bytes, e.g.
`lambda: torch.cuda.memory_allocated() + pinned_bytes()`); `tests/` is on `sys.path` under pytest,
so `from soak_util import soak` works from `tests/gpu/` too.

What it measures, after a warm-up of `applies // 10` applies and again at the end (both after
`gc.collect()`): live `weakref.finalize` registrations, live Python objects per type (gc-tracked),
the length of every dict/list/set attribute of the backend instance (its caches), and `memory()`.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable

import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.dispatch import select_backend

#: The bounds the soak asserts (growth from the warm-up snapshot to the end).
FINALIZER_GROWTH = 4  # weakref.finalize registrations
OBJECTS_PER_TYPE_GROWTH = 100  # live gc-tracked objects of any one type
CACHE_BOUND = 64  # entries of any one backend container (torch-cpu and compiled-cpu caches hold 64)
MEMORY_GROWTH = 32 << 20  # bytes of `memory()`


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def _snapshot(backend, memory: Callable[[], int]) -> dict:
    gc.collect()
    caches = {k: len(v) for k, v in vars(backend).items() if isinstance(v, (dict, list, set))}
    return {
        "finalizers": len(weakref.finalize._registry),  # type: ignore[attr-defined]
        "objects": Counter(type(o).__name__ for o in gc.get_objects()),
        "caches": caches,
        "memory": memory(),
    }


def soak(backend: str, device: torch.device | str, applies: int, memory: Callable[[], int] = rss_bytes) -> dict:
    """Run `applies` applies on `backend` and return the growth found; raise AssertionError past a bound.

    Each step: two requests appended to a long-lived `BlockTables` (overwritten when a row is full),
    then its apply; every other step a long-lived `StagedWriteTensor` written and applied, every 10th
    step together with a short-lived one of a shape of its own (a new table set each time); every 500th
    step a short-lived `BlockTables` applied once. `applies` counts every apply call (about 1.5 a step).
    """
    device = torch.device(device)
    writer = FusedStagedWriter(device, backend)
    instance = select_backend(device, backend)
    bt = BlockTables([16, 32], 8, [16, 8], device, kernel_block_sizes=[16, 16], backend=backend)
    long_lived = StagedWriteTensor((8, 16), torch.int64, device, name="long")
    counts = [0] * 8
    warmup = max(applies // 10, 1)
    first = None
    done = step = 0
    while done < applies:
        step += 1
        if first is None and done >= warmup:
            first = _snapshot(instance, memory)
        for req in (step % 8, (step * 3 + 1) % 8):
            full = counts[req] >= 16
            bt.append_block_ids(req, ([step % 1000], [step % 500] if step % 2 else []), overwrite=full)
            counts[req] = 1 if full else counts[req] + 1
        bt.apply_staged_writes()
        done += 1
        if step % 2:
            long_lived.stage_write(step % 8, step % 15, [step, -step])
            if step % 10 == 1:
                short = StagedWriteTensor((2, 1 + step % 61), torch.int64, device, name="short")
                short.stage_write(1, 0, [step])
                writer.apply([long_lived, short])
                assert short.tensor[1, 0].item() == step
                del short
            else:
                writer.apply([long_lived])
            done += 1
        if step % 500 == 0:
            other = BlockTables([16], 2, [1 + step % 7], device, backend=backend)
            other.append_block_ids(1, ([step],), overwrite=True)
            other.apply_staged_writes()
            done += 1
            assert other[0].tensor[1, 0].item() == step
            del other
    assert first is not None
    writer.forget()
    last = _snapshot(instance, memory)
    growth = {
        "finalizers": last["finalizers"] - first["finalizers"],
        "objects": {k: v for k, v in (last["objects"] - first["objects"]).items() if v > OBJECTS_PER_TYPE_GROWTH},
        "caches": {k: v for k, v in last["caches"].items() if v > CACHE_BOUND},
        "memory": last["memory"] - first["memory"],
    }
    assert growth["finalizers"] <= FINALIZER_GROWTH, growth
    assert not growth["objects"], growth
    assert not growth["caches"], growth
    assert growth["memory"] <= MEMORY_GROWTH, growth
    assert long_lived.tensor[step % 8 if step % 2 else (step - 1) % 8].abs().max().item() > 0
    return growth
