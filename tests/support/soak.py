"""The soak: many applies on one backend, and bounds on what may grow meanwhile."""

from __future__ import annotations

import torch

from multiwrite import select_backend

#: The bounds `soak` asserts (growth from the warm-up snapshot to the end).
SOAK_FINALIZER_GROWTH = 4  # weakref.finalize registrations
SOAK_OBJECTS_PER_TYPE_GROWTH = 100  # live gc-tracked objects of any one type
SOAK_CACHE_BOUND = 64  # entries of any one container of the backend (or of an object one of them holds)
SOAK_MEMORY_GROWTH = 32 << 20  # bytes of `memory()`


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def _containers(backend) -> dict[str, int]:
    """The length of every dict/list/set attribute of `backend`, and of the objects its dicts hold (a Triton
    backend's per-device state: descriptor cache, retiring rings, shared rings)."""
    out = {}
    for name, value in vars(backend).items():
        if isinstance(value, (dict, list, set)):
            out[name] = len(value)
        if isinstance(value, dict):
            for key, held in value.items():
                for inner, v in getattr(held, "__dict__", {}).items():
                    if isinstance(v, (dict, list, set)):
                        out[f"{name}[{key}].{inner}"] = len(v)
    return out


def _soak_snapshot(backend, memory) -> dict:
    import gc
    import weakref
    from collections import Counter

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # launched kernels done: staging memory of dead arenas is released, then freed
    gc.collect()
    gc.collect()
    return {
        "finalizers": len(weakref.finalize._registry),  # type: ignore[attr-defined]  # CPython's registry
        "objects": Counter(type(o).__name__ for o in gc.get_objects()),
        "caches": _containers(backend),
        "memory": memory(),
    }


def soak(backend: str, device, applies: int, memory=rss_bytes) -> dict:
    """Run `applies` applies on `backend`; return the growth found, raising AssertionError past a bound.

    Each step: two requests appended to a long-lived `BlockTables` (overwritten when a row is full), then its apply;
    every other step a long-lived `StagedWriteTensor` written and applied, every 10th step together with a
    short-lived one of a shape of its own (a new table set); every 500th step a short-lived `BlockTables` applied
    once. Snapshots (after `gc.collect()`) after the first tenth of the applies and at the end: live
    `weakref.finalize` registrations, live objects per type, every container of the backend, `memory()`.
    """
    from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor

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
            first = _soak_snapshot(instance, memory)
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
    last = _soak_snapshot(instance, memory)
    growth = {
        "finalizers": last["finalizers"] - first["finalizers"],
        "objects": {k: v for k, v in (last["objects"] - first["objects"]).items() if v > SOAK_OBJECTS_PER_TYPE_GROWTH},
        "caches": {k: v for k, v in last["caches"].items() if v > SOAK_CACHE_BOUND},
        "memory": last["memory"] - first["memory"],
    }
    assert growth["finalizers"] <= SOAK_FINALIZER_GROWTH, growth
    assert not growth["objects"], growth
    assert not growth["caches"], growth
    assert growth["memory"] <= SOAK_MEMORY_GROWTH, growth
    return growth
