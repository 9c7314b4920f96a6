"""`multiwrite replay`: the trace-replay workload through `BlockTables`, checked against the reference."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from multiwrite.block_tables import BlockTables
from multiwrite.environment import synchronize
from multiwrite.reference import ReferenceBlockTables
from multiwrite.workload import Trace, max_blocks_per_group, replay_steps


@dataclass
class ReplayResult:
    """What a replay did and measured.

    Attributes:
        step_us / apply_us: host time per step with at least one write, microseconds: staging plus
            `apply_staged_writes`, and `apply_staged_writes` alone.
        mismatches: cells (tables, host and device `num_blocks`) that differed from the reference,
            summed over every check.
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


def count_mismatches(tables: BlockTables, reference: ReferenceBlockTables) -> int:
    """Cells where `tables` (device tables, host and device num_blocks) differ from `reference`."""
    bad = 0
    for g, t in enumerate(tables.block_tables):
        bad += int(np.count_nonzero(t.tensor.cpu().numpy() != reference.tables[g]))
    bad += int(np.count_nonzero(tables.num_blocks != reference.num_blocks))
    bad += int(np.count_nonzero(tables.num_blocks_device.cpu().numpy() != reference.num_blocks))
    return bad


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
) -> ReplayResult:
    """Replay `num_steps` scheduler steps of `trace` through `BlockTables` on `device`.

    Every `check_every` steps (0: only at the end) and after the last step the tables are compared with
    `ReferenceBlockTables` fed the same calls. Host times are taken with `time.perf_counter`; the device
    is synchronized after each step, outside the timed region.

    Raises:
        BackendUnavailableError: the backend cannot run on `device`.
    """
    widths = max_blocks_per_group(block_sizes)
    tables = BlockTables(block_sizes, concurrency, widths, device, kernel_block_sizes, backend=backend)
    reference = ReferenceBlockTables(block_sizes, concurrency, widths, kernel_block_sizes)
    result = ReplayResult(tables.backend.NAME, tables.device)
    ks = tables.kernel_blocks_per_block
    clock = time.perf_counter
    for step, calls in enumerate(replay_steps(trace, block_sizes, concurrency, num_steps), start=1):
        t0 = clock()
        for req, ids, overwrite in calls:
            tables.append_block_ids(req, ids, overwrite)
        t1 = clock()
        tables.apply_staged_writes()
        t2 = clock()
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
