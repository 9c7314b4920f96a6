"""`multiwrite.vllm.BlockTables` and CUDA graph captures (simulated on CPU, Triton through its interpreter), without
graph mode: a replay right after `apply_staged_writes()` reads the tables with its writes (the apply lands at once, as
vLLM's); an apply during a capture is refused and changes nothing; a captured gather zeroes the rows a larger eager
gather left, as vLLM's capture bakes them in."""

from __future__ import annotations

import pytest
import torch

from multiwrite import GraphCaptureError
from multiwrite.capture import simulated_capture
from multiwrite.vllm import BlockTables


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def tables() -> BlockTables:
    return BlockTables([4], 4, 8, [4], torch.device("cpu"), backend="triton-cuda")


def test_a_replay_after_an_apply_reads_the_tables_with_its_writes():
    """Issue 23, item 3 (a): the apply was deferred into the next eager gather or slot mapping, so a replay right
    after `apply_staged_writes()` read the tables without the step's writes (vLLM's: with them)."""
    bt = tables()
    bt.append_block_ids(1, [[9, 8]], True)
    bt.apply_staged_writes()
    idx, qsl, pos = i64(1), i64(0, 2), i64(2, 5)  # (persistent inputs: a replay reads them by address)
    bt.gather_block_tables(idx, 1)  # eager first (as vLLM's warm-up runs before its captures)
    with simulated_capture() as graph:
        (gathered,) = bt.gather_block_tables(idx, 1)
        slots = bt.compute_slot_mappings(idx, qsl, pos, 2)
    graph.replay()
    assert gathered.tolist() == [[9, 8, 0, 0]] and slots.tolist() == [[9 * 4 + 2, 8 * 4 + 1]]
    for step, (first, second) in enumerate([(3, 7), (5, 2)]):
        bt.append_block_ids(1, [[first, second]], True)
        bt.apply_staged_writes()
        graph.replay()  # no eager gather or slot mapping between the apply and the replay
        assert gathered.tolist() == [[first, second, 0, 0]], step
        assert slots.tolist() == [[first * 4 + 2, second * 4 + 1]], step


def test_an_apply_during_a_capture_without_graph_mode_is_refused_and_changes_nothing():
    bt = tables()
    bt.append_block_ids(1, [[9]], True)
    with simulated_capture() as graph:
        with pytest.raises(GraphCaptureError, match="apply_staged_writes"):
            bt.apply_staged_writes()
    assert graph.launches == [] and bt.core.num_staged_writes > 0
    bt.apply_staged_writes()
    assert bt.gather_block_tables(i64(1), 1)[0].tolist() == [[9, 0, 0, 0]]


def test_a_captured_gather_zeroes_the_rows_a_larger_gather_left():
    bt = tables()
    for r in range(4):
        bt.append_block_ids(r, [[r + 1, r + 5]], False)
    bt.apply_staged_writes()
    bt.gather_block_tables(i64(0, 1, 2), 3)
    idx = i64(3)
    with simulated_capture() as graph:
        bt.gather_block_tables(idx, 2)
    graph.replay()
    assert bt.input_block_tables[0][:3].tolist() == [[4, 8, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
