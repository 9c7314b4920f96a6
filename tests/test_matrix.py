"""Scenario tests run against every available built-in backend (the `backend` fixture of conftest.py).

The conformance kit's suite (`multiwrite.testing.suite`, the same tests a plugin author runs) is
imported here, so it runs per backend and staging path; below it, scenarios about how multiwrite itself
drives a backend.
"""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables
from multiwrite.testing.suite import *  # noqa: F403  (the kit's tests, collected here)

DTYPES = [torch.int32, torch.int64, torch.float32]


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def test_single_group(staging, backend):
    bt = BlockTables([16], 3, [5], backend.device, backend=backend.name)
    bt.append_block_ids(2, ([4, 9, 11],), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(2, ([12, 13],), overwrite=False)
    bt.append_block_ids(0, ([1],), overwrite=True)
    bt.apply_staged_writes()
    assert host(bt[0].tensor).tolist() == [[1, 0, 0, 0, 0], [0] * 5, [4, 9, 11, 12, 13]]
    assert host(bt.num_blocks_device).tolist() == [[1, 0, 5]]
    # A new request reusing row 2 overwrites from column 0 (stale ids after its count stay, as in vLLM).
    bt.append_block_ids(2, ([7],), overwrite=True)
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[2].tolist() == [7, 9, 11, 12, 13]
    assert bt.num_blocks[0, 2] == 1


def test_multi_group_apply_reaches_backend_as_one_call(staging, backend, monkeypatch):
    bt = BlockTables([16, 32, 8, 16], 4, [4, 4, 4, 4], backend.device, [16, 16, 8, 16], backend=backend.name)
    calls = []
    original = bt.backend.apply
    monkeypatch.setattr(bt.backend, "apply", lambda batches: (calls.append(list(batches)), original(batches))[1])
    for req in range(4):
        bt.append_block_ids(req, ([req + 1], [req + 10], [req + 20, req + 21], [req + 30]), overwrite=True)
    bt.apply_staged_writes()
    assert len(calls) == 1
    assert len(calls[0]) == 1  # one dtype, so one batch
    batch = calls[0][0]
    assert len(batch.tables) == 5  # four groups and num_blocks
    # per request: one write per group, and its new num_blocks column, all in the same backend call
    assert batch.num_writes == 4 * 4 + 4
    assert host(bt.num_blocks_device)[:, 3].tolist() == [1, 2, 2, 1]
    assert host(bt[3].tensor)[:, 0].tolist() == [30, 31, 32, 33]
    bt.apply_staged_writes()  # nothing staged: the backend is not called at all
    assert len(calls) == 1


def test_value_kinds_and_one_dimensional_tensor(backend):
    t = StagedWriteTensor((3, 4), torch.int64, backend.device)
    t.stage_write(0, 0, np.array([1, 2], dtype=np.int16))
    t.stage_write(1, 1, torch.tensor([3, 4, 5]))
    t.stage_write(2, 2, (6, 7))
    t.stage_write(2, 0, iter([8]))
    vec = StagedWriteTensor(5, torch.int32, backend.device, name="vec")
    vec.stage_write_elem(3, 42)
    vec.stage_write_elem(0, -1)
    vec.stage_write_elem(3, 43)
    FusedStagedWriter(backend.device, backend.name).apply([t, vec])
    assert host(t.tensor).tolist() == [[1, 2, 0, 0], [0, 3, 4, 5], [8, 0, 6, 7]]
    assert vec.tensor.shape == (5,)
    assert host(vec.tensor).tolist() == [-1, 0, 0, 43, 0]


def test_replay_of_a_trace_matches_reference(staging, backend):
    from multiwrite.replay import count_mismatches
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    trace = load_trace("tests/data/small_trace.csv")
    block_sizes, kernel = [16, 32, 8], [16, 16, 8]
    widths = max_blocks_per_group(block_sizes, 1024)
    bt = BlockTables(block_sizes, 3, widths, backend.device, kernel, backend=backend.name)
    ref = ReferenceBlockTables(block_sizes, 3, widths, kernel)
    steps = 0
    for calls in replay_steps(trace, block_sizes, concurrency=3, num_steps=60, token_budget=64):
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        bt.apply_staged_writes()
        steps += 1
    assert steps > 10
    assert ref.num_blocks.sum() > 0
    assert count_mismatches(bt, ref) == 0
