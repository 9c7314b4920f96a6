"""`multiwrite.vllm.BlockTables` and CUDA graph captures (simulated on CPU, Triton through its interpreter): a deferred
apply that a capture would have to hold is refused with the way out named and stays due, also when the refusal comes
from a flush; a captured gather zeroes the rows a larger eager gather left, as vLLM's capture bakes them in."""

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


def test_a_capture_that_would_land_a_deferred_apply_is_refused_and_the_apply_stays_due():
    bt = tables()
    bt.append_block_ids(1, [[9]], False)
    bt.apply_staged_writes()
    with simulated_capture() as graph:
        with pytest.raises(GraphCaptureError, match=r"compute_slot_mappings during a CUDA graph capture.*defer_apply"):
            bt.compute_slot_mappings(i64(1), i64(0, 1), i64(0), 1)
        with pytest.raises(GraphCaptureError, match=r"a read of the tables during a CUDA graph capture"):
            _ = bt.block_tables  # (reading the tables flushes first)
    assert graph.launches == []
    assert bt.gather_block_tables(i64(1), 1)[0].tolist() == [[9, 0, 0, 0]]  # still due: this gather lands it
    idx, qsl, pos = i64(1), i64(0, 1), i64(2)  # (persistent inputs: a replay reads them by address)
    with simulated_capture() as graph:  # nothing due any more: the slot mapping is recorded
        slots = bt.compute_slot_mappings(idx, qsl, pos, 1)
    graph.replay()
    assert slots.tolist() == [[9 * 4 + 2]]


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
