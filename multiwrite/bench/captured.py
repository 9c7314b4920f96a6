"""`WriteBatch`es captured from the trace, for timing a backend's apply alone (no staging).

`RecordingBackend` is a public `Backend` that copies every batch a `BlockTables` hands it and (unless told to
forward) applies nothing, so only the public plugin API is used: `Backend.apply(batches)` and `WriteBatch(...)`.
A captured batch owns its arrays (no staging `lease`: a backend that lends staging memory copies it into memory
of its own at each apply, as it does for any batch built by hand) and keeps `checked` (multiwrite checked every
write against its table when it was staged). Used by `multiwrite.bench.launch` and `scripts/ncu_kernel_times.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from multiwrite.plugins.backend import Backend, WriteBatch
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import CONFIGS, load_trace, max_blocks_per_group, replay_steps


def own_batch(b: WriteBatch) -> WriteBatch:
    """A copy that stays valid after `Backend.apply` returns (`meta` and `values` may be staging memory)."""
    return WriteBatch(list(b.tables), b.meta.copy(), b.values.copy(), b.may_overlap, b.values_in_order,
                      checked=b.checked)  # fmt: skip


class RecordingBackend(Backend):
    """Records a copy of every `apply`'s batches; applies them through `inner` only if `forward`.

    It lends no staging memory (the default `staging_buffers`), so the batches it receives are plain arrays."""

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


def new_triton_backend(**kw) -> Backend:
    """A fresh `triton-cuda` backend (its own device state: rings, descriptors, launchers); `kw` are its launch
    knobs (`ring_depth`, `launcher`)."""
    from multiwrite.backends.triton.backend import TritonCudaBackend

    return TritonCudaBackend(**kw)


def capture_decode(
    device: torch.device, concurrency: int, steps: int = 120, backend: Backend | None = None
) -> tuple[Backend, list[WriteBatch]]:
    """(backend, batches): the G3 apply of a steady-state trace step (the median number of writes of the last
    50 of `steps` steps) at `concurrency`, and the backend (a fresh `triton-cuda` one by default) to apply it with
    (`backend.apply(batches)`)."""
    bs, kbs = CONFIGS["G3"]
    backend = backend or new_triton_backend()
    rec = RecordingBackend(backend)
    bt = BlockTables(bs, concurrency, max_blocks_per_group(bs), device, kbs, backend=rec)
    for calls in replay_steps(load_trace(), bs, concurrency, steps):
        for req, ids, ow in calls:
            bt.append_block_ids(req, ids, ow)
        bt.apply_staged_writes()
    recent = sorted(rec.captured[-50:], key=lambda batches: batches[0].num_writes)
    return backend, recent[len(recent) // 2]


def capture_burst(
    device: torch.device, requests: int = 256, ids_per_group: int = 1024, backend: Backend | None = None
) -> tuple[Backend, list[WriteBatch], int]:
    """(backend, batches, bytes): the prefill burst of `multiwrite bench` (G3; `requests` new requests x 3
    groups x `ids_per_group` manager ids, all overwrites) as one apply, and its kernel-id bytes."""
    bs, kbs = CONFIGS["G3"]
    backend = backend or new_triton_backend()
    rec = RecordingBackend(backend)
    bt = BlockTables(bs, requests, [ids_per_group] * 3, device, kbs, backend=rec)
    n = ids_per_group
    for r in range(requests):
        ids = [np.arange(1 + (g * requests + r) * n, 1 + (g * requests + r + 1) * n) for g in range(3)]
        bt.append_block_ids(r, ids, True)
    bt.apply_staged_writes()
    nbytes = requests * ids_per_group * sum(bt.kernel_blocks_per_block) * 4
    return backend, rec.captured[0], nbytes


def launches_per_apply(batches: Sequence[WriteBatch]) -> int:
    """Kernel launches one `backend.apply(batches)` of a Triton backend makes: one per batch with values."""
    return sum(1 for b in batches if b.values.shape[0])


def describe(batches: Sequence[WriteBatch]) -> dict:
    """Writes, values, batches and whether any may overlap: what a captured apply holds."""
    return {
        "writes": sum(b.num_writes for b in batches),
        "values": sum(int(b.values.shape[0]) for b in batches),
        "batches": len(batches),
        "may_overlap": any(b.may_overlap for b in batches),
    }
