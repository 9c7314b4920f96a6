"""The gather and slot-mapping stage on a real GPU: pinned host inputs, a side stream, capture refusal, and
a replayed trace checked against the reference every step. Run with `pytest tests/gpu` on a CUDA machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, GraphCaptureError
from multiwrite.reference import (
    ReferenceBlockTables,
    compute_slot_mappings_reference,
    gather_block_tables_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]

BLOCK_SIZES, KERNEL_BLOCK_SIZES = [16, 32, 8], [16, 16, 8]


def _decode_batch(ref: ReferenceBlockTables, rows: list[int], rng: np.random.Generator):
    """One decode token per request, at a position inside the blocks every group holds for it."""
    qsl, positions = [0], []
    for req in rows:
        tokens = min(int(ref.num_blocks[g, req]) * kbs for g, kbs in enumerate(KERNEL_BLOCK_SIZES))
        positions.append(int(rng.integers(0, max(tokens, 1))))
        qsl.append(qsl[-1] + 1)
    return qsl, positions


@pytest.mark.parametrize("place", ["pinned", "device"])
@pytest.mark.parametrize("side_stream", [False, True])
def test_trace_of_decode_steps_matches_reference(place, side_stream):
    from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps

    rng = np.random.default_rng(7)
    concurrency = 40
    widths = max_blocks_per_group(BLOCK_SIZES, 1024)
    bt = BlockTables(BLOCK_SIZES, concurrency, widths, "cuda", KERNEL_BLOCK_SIZES, max_num_batched_tokens=512)
    ref = ReferenceBlockTables(BLOCK_SIZES, concurrency, widths, KERNEL_BLOCK_SIZES)
    ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
    trace = load_trace("tests/data/small_trace.csv")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    steps = tokens = 0
    for calls in replay_steps(trace, BLOCK_SIZES, concurrency=concurrency, num_steps=150, token_budget=256):
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        live = [r for r in range(concurrency) if ref.num_blocks[:, r].min() > 0]
        rows = list(rng.permutation(live)[: rng.integers(0, len(live) + 1)]) if live else []
        qsl, positions = _decode_batch(ref, rows, rng)
        padded_reqs, padded_tokens = min(len(rows) + 3, concurrency), len(positions) + 5
        tensors = [torch.tensor(rows, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                   torch.tensor(positions, dtype=torch.int64)]  # fmt: skip
        tensors = [t.pin_memory() if place == "pinned" else t.cuda() for t in tensors]
        with torch.cuda.stream(stream):
            gathered, slots = bt.prepare_inputs(*tensors, padded_reqs, padded_tokens)
        stream.synchronize()
        expected = gather_block_tables_reference(ref.tables, ref.num_blocks, rows, padded_reqs, ref_inputs)
        for g in range(3):
            np.testing.assert_array_equal(gathered[g].cpu().numpy(), expected[g])
        np.testing.assert_array_equal(
            slots.cpu().numpy(),
            compute_slot_mappings_reference(ref.tables, KERNEL_BLOCK_SIZES, rows, qsl, positions, padded_tokens),
        )
        steps += 1
        tokens += len(positions)
    assert steps > 10 and tokens > 50  # the small trace gives ~20 steps, ~80 tokens at this concurrency


def test_capture_is_refused_and_applies_nothing():
    bt = BlockTables([16], 2, [4], "cuda", max_num_batched_tokens=8)
    bt.append_block_ids(0, ([3],), overwrite=True)
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="during CUDA graph capture"):
        with torch.cuda.graph(graph):
            bt.prepare_inputs(idx, qsl, pos, 1, 1)
    assert bt[0].num_staged_writes == 1
    gathered, slots = bt.prepare_inputs(idx, qsl, pos, 1, 1)
    assert gathered[0][0, 0].item() == 3 and slots[0, 0].item() == 48


def test_the_direct_path_serves_eager_decode_steps_and_refuses_a_capture_first():
    """Eager steps with device inputs bind the direct path (backends/triton_direct.py) and it lands each step's
    writes; a capture is then refused before anything is launched or dropped, and the next eager step lands the
    writes the refused call kept staged."""
    bt = BlockTables([16, 32], 4, [4, 4], "cuda", [16, 16], max_num_batched_tokens=8)
    idx = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    pos = torch.tensor([0, 0], dtype=torch.int64, device="cuda")
    for step in range(4):
        bt.append_block_ids(step % 2, ([10 + step], [20 + step]), overwrite=True)
        gathered, slots = bt.prepare_inputs(idx, qsl, pos, 2, 2)
    assert callable(bt._direct)
    assert gathered[0][:, 0].tolist() == [13, 12] and slots[0].tolist() == [13 * 16, 12 * 16]
    bt.append_block_ids(0, ([7, 8], [9]), overwrite=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="BlockTables.prepare_inputs"):
        with torch.cuda.graph(graph):
            bt.prepare_inputs(idx, qsl, pos, 2, 2)
    assert bt._arena.num_writes == 3
    pos = torch.tensor([0, 16], dtype=torch.int64, device="cuda")  # entry 1 (row 0) now reads its second block
    gathered, slots = bt.prepare_inputs(idx, qsl, pos, 2, 2)
    torch.cuda.synchronize()
    assert gathered[0][1, :2].tolist() == [7, 8] and slots[0].tolist() == [13 * 16, 8 * 16]
    assert bt.num_blocks_device.cpu().tolist() == bt.num_blocks.tolist()
