"""The trace-replay workload through `BlockTables`, checked against the reference: what `multiwrite replay`
(`multiwrite.cli.replay`) runs, and what the conformance kit replays through a backend. Its timed step
(`timed_step`) is the one `multiwrite bench --launch` times too."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.environment import synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.tables.block_tables import BlockTables
from multiwrite.workload import StagedCall, Trace, max_blocks_per_group, replay_steps

#: Added to a block id to make the decoy that an overlapping write replaces (fits int32 after expansion).
DECOY_OFFSET = 500_000


@dataclass
class ReplayResult:
    """What a replay did and measured.

    Attributes:
        step_us / apply_us: host time per step with at least one write, microseconds: staging plus
            `apply_staged_writes`, and `apply_staged_writes` alone.
        mismatches: cells (tables, host and device `num_blocks`) that differed from the reference,
            summed over every check.
        overlapping_writes: decoy calls that a later call of the same step overwrote (`overlap_rate`).
    """

    backend: str
    device: torch.device
    steps: int = 0
    writes: int = 0
    block_ids: int = 0
    checks: int = 0
    mismatches: int = 0
    step_us: list[float] = field(default_factory=list)
    apply_us: list[float] = field(default_factory=list)
    overlapping_writes: int = 0


def count_mismatches(tables: BlockTables, reference: ReferenceBlockTables) -> int:
    """Cells where `tables` (device tables, host and device num_blocks) differ from `reference`."""
    bad = 0
    for g, t in enumerate(tables.block_tables):
        bad += int(np.count_nonzero(t.tensor.cpu().numpy() != reference.tables[g]))
    bad += int(np.count_nonzero(tables.num_blocks != reference.num_blocks))
    bad += int(np.count_nonzero(tables.num_blocks_device.cpu().numpy() != reference.num_blocks))
    return bad


def timed_step(
    tables: BlockTables, calls: Iterable[StagedCall], clock: Callable[[], float]
) -> tuple[float, float, float]:
    """Stage a step's `calls` into `tables` (one `append_block_ids` each), then `apply_staged_writes()`: `clock()`
    read before the staging, between it and the apply, and after the apply (the device is not synchronized)."""
    t0 = clock()
    for req, ids, overwrite in calls:
        tables.append_block_ids(req, ids, overwrite)
    t1 = clock()
    tables.apply_staged_writes()
    return t0, t1, clock()


def run_replay(
    trace: Trace,
    block_sizes: Sequence[int],
    kernel_block_sizes: Sequence[int] | None,
    concurrency: int,
    num_steps: int,
    device: torch.device,
    backend: str | None = None,
    check_every: int = 50,
    on_step: Callable[[], None] | None = None,
    overlap_rate: float = 0.0,
    tables_class: type[BlockTables] = BlockTables,
) -> ReplayResult:
    """Replay `num_steps` scheduler steps of `trace` through `BlockTables` on `device`.

    Every `check_every` steps (0: only at the end) and after the last step the tables are compared with
    `ReferenceBlockTables` fed the same calls. Host times are taken with `time.perf_counter`; the device
    is synchronized after each step, outside the timed region. With `overlap_rate > 0` the steps go
    through `with_overlaps` (overlapping writes within a step, which only "later wins" gets right).
    `tables_class` builds the tables (a subclass of `BlockTables`: the conformance kit passes
    `multiwrite.testing.staging.block_tables_class(staging)` to replay through one staging path).

    Raises:
        BackendUnavailableError: the backend cannot run on `device`.
    """
    widths = max_blocks_per_group(block_sizes)
    tables = tables_class(block_sizes, concurrency, widths, device, kernel_block_sizes, backend=backend)
    reference = ReferenceBlockTables(block_sizes, concurrency, widths, kernel_block_sizes)
    result = ReplayResult(tables.backend.NAME, tables.device)
    ks = tables.kernel_blocks_per_block
    clock = time.perf_counter
    steps: Iterable[list[StagedCall]] = replay_steps(trace, block_sizes, concurrency, num_steps)
    if overlap_rate > 0:
        steps = with_overlaps(steps, overlap_rate, result)
    for step, calls in enumerate(steps, start=1):
        t0, t1, t2 = timed_step(tables, calls, clock)
        synchronize(tables.device)
        if calls:
            result.step_us.append((t2 - t0) * 1e6)
            result.apply_us.append((t2 - t1) * 1e6)
        for req, ids, overwrite in calls:
            reference.append_block_ids(req, ids, overwrite)
            result.block_ids += sum(len(x) * k for x, k in zip(ids, ks))
        result.writes += len(calls)
        result.steps = step
        if check_every and step % check_every == 0:
            result.mismatches += count_mismatches(tables, reference)
            result.checks += 1
        if on_step is not None:
            on_step()
    if not check_every or result.steps % check_every:
        result.mismatches += count_mismatches(tables, reference)
        result.checks += 1
    return result


def with_overlaps(
    steps: Iterable[list[StagedCall]], rate: float, result: ReplayResult | None = None, seed: int = 0
) -> Iterator[list[StagedCall]]:
    """The same steps with overlapping writes: a request preempted and re-admitted within one step.

    Every admission (`overwrite=True`) and a `rate` share of the appends (fixed `seed`) become two
    calls: a decoy overwrite of the request's whole row (its ids + `DECOY_OFFSET`), then the overwrite
    with its real ids from column 0. The tables must end exactly as without the decoys, which holds only
    where the later write wins (in the ids and in `num_blocks`). Counts decoys in
    `result.overlapping_writes`.
    """
    rng = np.random.default_rng(seed)
    held: dict[int, list[list[int]]] = {}
    for calls in steps:
        out: list[StagedCall] = []
        for req, ids, overwrite in calls:
            row = [list(x) for x in ids] if overwrite else [h + list(x) for h, x in zip(held[req], ids)]
            held[req] = row
            if overwrite or rng.random() < rate:
                out.append((req, [[b + DECOY_OFFSET for b in g] for g in row], True))
                out.append((req, row, True))
                if result is not None:
                    result.overlapping_writes += 1
            else:
                out.append((req, ids, overwrite))
        yield out


def replay_memory(block_sizes: Sequence[int], kernel_block_sizes: Sequence[int], concurrency: int) -> tuple[int, int]:
    """(host bytes, device bytes) a replay allocates, about: int32 device tables and `num_blocks`; on the
    host the int64 reference, its `num_blocks`, the staging stamps and one table copied back per check."""
    widths = max_blocks_per_group(block_sizes)
    cells = [w * (bs // kbs) for w, bs, kbs in zip(widths, block_sizes, kernel_block_sizes)]
    groups = len(block_sizes)
    device = concurrency * (sum(cells) + groups) * 4
    host = concurrency * (sum(cells) * 8 + groups * 8 + (groups + 1) * 8 + max(cells) * 5)
    return host, device
