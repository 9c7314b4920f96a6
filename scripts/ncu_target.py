"""Captured `triton-cuda` batches for timing, and the target program that gpu_check's `ncu` part profiles.

As a library (imported by scripts/gpu_check.py): `capture_decode` and `capture_burst` build the
`WriteBatch`es that `BlockTables` hands its backend, through `RecordingBackend` (a public `Backend` that
copies every batch and, unless told to forward, applies nothing), so only the public API is used:
`backend.writer(device)`, `writer.apply(batches)`, `WriteBatch(...)`.

As a program (run under Nsight Compute by gpu_check)::

    ncu --profile-from-start off ... python scripts/ncu_target.py --manifest m.json

it captures decode batches of G3 at C=40 and C=256 from the embedded trace and a prefill burst, warms
everything up (compiles, binds the fast launcher), then, between `cudaProfilerStart` and `cudaProfilerStop`,
applies each captured batch list `--reps` times and launches the empty Triton kernel `--reps` times, each
followed by a synchronize. The manifest lists, in launch order, which launches were made inside that
range, so the parser can map ncu's rows (in launch order) to configurations. Nothing of ours launches
after the range, so the last rows of ncu's output are the measured ones even if the range is ignored.
With `--device cpu` (and TRITON_INTERPRET=1) it runs the same sequence without a profiler (smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np
import torch

from multiwrite import Backend, BlockTables, WriteBatch

#: Configurations measured by the ncu part: (label, concurrency); all G3.
DECODE_CONFIGS = (("decode-G3-C40", 40), ("decode-G3-C256", 256))
G3 = ([16, 32, 8], [16, 16, 8])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def own_batch(b: WriteBatch) -> WriteBatch:
    """A copy that stays valid after `Backend.apply` returns (meta/values may be staging views)."""
    return WriteBatch(list(b.tables), b.meta.copy(), b.values.copy(), b.may_overlap, b.values_in_order)


class RecordingBackend(Backend):
    """Records a copy of every `apply`'s batches; applies them through `inner` only if `forward`."""

    NAME = "recording"

    def __init__(self, inner: Backend, forward: bool = False):
        self.inner = inner
        self.forward = forward
        self.captured: list[list[WriteBatch]] = []

    def priority(self, device: torch.device) -> int:
        return self.inner.priority(device)

    def not_supported_reasons(self, device: torch.device, dtypes=()) -> list[str]:
        return self.inner.not_supported_reasons(device, dtypes)

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        self.captured.append([own_batch(b) for b in batches])
        if self.forward:
            self.inner.apply(batches)


def new_backend(**kw) -> Backend:
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    return TritonCudaBackend(**kw)


def capture_decode(device: torch.device, c: int, bs=G3[0], kbs=G3[1], steps: int = 120):
    """(writer, batches): a decode-like apply of a steady-state trace step (the median number of writes
    of the last 50 steps of `steps`), and the fresh `triton-cuda` writer that applies it."""
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    backend = new_backend()
    rec = RecordingBackend(backend)
    bt = BlockTables(bs, c, max_blocks_per_group(bs), device, kbs, backend=rec)
    for calls in replay_steps(load_trace(), bs, c, steps):
        for req, ids, ow in calls:
            bt.append_block_ids(req, ids, ow)
        bt.apply_staged_writes()
    recent = sorted(rec.captured[-50:], key=lambda batches: batches[0].num_writes)
    batches = recent[len(recent) // 2]
    return backend.writer(batches[0].tables[0].device), batches


def capture_burst(device: torch.device, requests: int = 256, ids_per_group: int = 1024):
    """(writer, batches, bytes): the prefill burst of `multiwrite bench` (G3; `requests` new requests x 3
    groups x `ids_per_group` manager ids, all overwrites) as one apply, and its kernel-id bytes."""
    bs, kbs = G3
    backend = new_backend()
    rec = RecordingBackend(backend)
    bt = BlockTables(bs, requests, [ids_per_group] * 3, device, kbs, backend=rec)
    n = ids_per_group
    for r in range(requests):
        ids = [np.arange(1 + (g * requests + r) * n, 1 + (g * requests + r + 1) * n) for g in range(3)]
        bt.append_block_ids(r, ids, True)
    bt.apply_staged_writes()
    batches = rec.captured[0]
    nbytes = requests * ids_per_group * sum(bt.kernel_blocks_per_block) * 4
    return backend.writer(batches[0].tables[0].device), batches, nbytes


def launches_per_apply(batches: Sequence[WriteBatch]) -> int:
    """Kernel launches one `writer.apply(batches)` makes: one per batch with values."""
    return sum(1 for b in batches if b.values.shape[0])


def describe(batches: Sequence[WriteBatch]) -> dict:
    return {
        "writes": sum(b.num_writes for b in batches),
        "values": sum(int(b.values.shape[0]) for b in batches),
        "batches": len(batches),
        "may_overlap": any(b.may_overlap for b in batches),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--burst-requests", type=int, default=256)
    ap.add_argument("--burst-ids", type=int, default=1024)
    ap.add_argument("--manifest", required=True, help="where to write the launch manifest (JSON)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from multiwrite.bench_triton import empty_kernel

    configs = []
    for label, c in DECODE_CONFIGS:
        writer, batches = capture_decode(device, c)
        configs.append((label, writer, batches))
    writer, batches, nbytes = capture_burst(device, args.burst_requests, args.burst_ids)
    configs.append(("burst-G3", writer, batches))
    dummy = torch.zeros(1, device=device)
    # Warm-up, outside the profiled range: compiles, binds and validates the fast launchers.
    for _ in range(args.warmup):
        for _label, writer, batches in configs:
            writer.apply(batches)
            sync(device)
        empty_kernel[(1,)](dummy)
        sync(device)
    sequence = []
    profiling = device.type == "cuda"
    if profiling:
        torch.cuda.profiler.start()
    try:
        for label, writer, batches in configs:
            for _ in range(args.reps):
                writer.apply(batches)
                sync(device)
            per_apply = launches_per_apply(batches)
            info = {"label": label, "kernel": "write", "launches": args.reps * per_apply, "per_apply": per_apply}
            info.update(describe(batches))
            if label.startswith("burst"):
                info["bytes"] = nbytes
            info["launch_path"] = writer.launch_path
            sequence.append(info)
        for _ in range(args.reps):
            empty_kernel[(1,)](dummy)
            sync(device)
        sequence.append({"label": "empty", "kernel": "empty", "launches": args.reps, "per_apply": 1})
    finally:
        if profiling:
            torch.cuda.profiler.stop()
    with open(args.manifest, "w") as f:
        json.dump({"reps": args.reps, "sequence": sequence}, f, indent=1)
    print(f"ncu_target: {sum(s['launches'] for s in sequence)} measured launches; manifest {args.manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
