"""The gather and slot-mapping stage on a real GPU (`prepare_inputs`, one launch): a trace of decode steps with
pinned, pageable or device inputs on the current or a side stream; pageable inputs never synchronize the device;
rows of 131,072 cells; device-input steps whose writes land step after step, a capture refused between them."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, GraphCaptureError
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import load_trace, max_blocks_per_group, replay_steps
from tests.gpu.helpers import busy

BLOCK_SIZES, KERNEL_BLOCK_SIZES = [16, 32, 8], [16, 16, 8]
TRACE = Path(__file__).resolve().parents[1] / "data" / "small_trace.csv"


def _decode_batch(ref: ReferenceBlockTables, rows: list[int], rng: np.random.Generator):
    """One decode token per request, at a position inside the blocks every group holds for it."""
    qsl, positions = [0], []
    for req in rows:
        tokens = min(int(ref.num_blocks[g, req]) * kbs for g, kbs in enumerate(KERNEL_BLOCK_SIZES))
        positions.append(int(rng.integers(0, max(tokens, 1))))
        qsl.append(qsl[-1] + 1)
    return qsl, positions


@pytest.mark.parametrize("place", ["pinned", "pageable", "device"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["current stream", "side stream"])
def test_a_trace_of_decode_steps_matches_the_reference(device, place, side_stream):
    rng = np.random.default_rng(7)
    concurrency = 40
    widths = max_blocks_per_group(BLOCK_SIZES, 1024)
    bt = BlockTables(BLOCK_SIZES, concurrency, widths, device, KERNEL_BLOCK_SIZES, max_num_batched_tokens=512)
    ref = ReferenceBlockTables(BLOCK_SIZES, concurrency, widths, KERNEL_BLOCK_SIZES)
    ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    steps = tokens = 0
    for calls in replay_steps(load_trace(TRACE), BLOCK_SIZES, concurrency=concurrency, num_steps=150,
                              token_budget=256):  # fmt: skip
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        live = [r for r in range(concurrency) if ref.num_blocks[:, r].min() > 0]
        rows = list(rng.permutation(live)[: rng.integers(0, len(live) + 1)]) if live else []
        qsl, positions = _decode_batch(ref, rows, rng)
        padded_reqs, padded_tokens = min(len(rows) + 3, concurrency), len(positions) + 5
        tensors = [torch.tensor(rows, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                   torch.tensor(positions, dtype=torch.int64)]  # fmt: skip
        if place == "pinned":
            tensors = [t.pin_memory() for t in tensors]
        elif place == "device":
            tensors = [t.to(device) for t in tensors]
        with torch.cuda.stream(stream):
            gathered, slots = bt.prepare_inputs(*tensors, padded_reqs, padded_tokens)
        stream.synchronize()
        expected = gather_block_tables_reference(ref.tables, ref.num_blocks, rows, padded_reqs, ref_inputs)
        for g in range(3):
            np.testing.assert_array_equal(gathered[g].cpu().numpy(), expected[g])
        want = compute_slot_mappings_reference(ref.tables, KERNEL_BLOCK_SIZES, rows, qsl, positions, padded_tokens)
        np.testing.assert_array_equal(slots.cpu().numpy(), want)
        steps += 1
        tokens += len(positions)
    assert steps > 10 and tokens > 50  # the small trace gives ~20 steps, ~80 tokens at this concurrency


def test_pageable_inputs_do_not_synchronize_the_device(device):
    """Pageable host inputs go through pinned copies in stream order: the call returns while the stream is still
    busy (no device-wide synchronization), and its results are right once the stream has run."""
    bt = BlockTables([16, 32], 4, [64, 32], device, [16, 16], max_num_batched_tokens=16)
    ref = ReferenceBlockTables([16, 32], 4, [64, 32], [16, 16])
    for r in range(4):
        bt.append_block_ids(r, ([r + 1, r + 5], [r + 9]), True)
        ref.append_block_ids(r, ([r + 1, r + 5], [r + 9]), True)
    idx, qsl, pos = [3, 0, 2], [0, 2, 3, 4], [17, 3, 31, 0]
    args = (torch.tensor(idx), torch.tensor(qsl), torch.tensor(pos), 4, 6)
    bt.prepare_inputs(*args)  # warm-up: compiles and binds the launcher
    torch.cuda.synchronize(device)
    bt.append_block_ids(0, ([], [40]), False)
    ref.append_block_ids(0, ([], [40]), False)
    busy(0.5)
    t0 = time.perf_counter()
    gathered, slots = bt.prepare_inputs(*args)
    returned = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    assert returned < 0.25 and still_busy, f"the call waited for the device ({returned:.3f} s)"
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, 4, [np.zeros(t.shape) for t in ref.tables])
    for g in range(2):
        np.testing.assert_array_equal(gathered[g].cpu().numpy(), want[g])
    np.testing.assert_array_equal(slots.cpu().numpy(),
                                  compute_slot_mappings_reference(ref.tables, [16, 16], idx, qsl, pos, 6))  # fmt: skip


def test_rows_of_131072_cells_land_and_are_gathered_exactly(device):
    """Eight requests with nearly full rows of 131,072 cells (one call each: a prefill of a long context), gathered and
    mapped in one prepare_inputs: every cell exact (each row is 32 programs of 4,096 cells)."""
    width = 131072
    bt = BlockTables([16], 8, [width], device, max_num_batched_tokens=64)
    ref = ReferenceBlockTables([16], 8, [width])
    rng = np.random.default_rng(3)
    for r in range(8):
        ids = rng.integers(1, 2**24, width - 7 * r - 1).tolist()
        bt.append_block_ids(r, (ids,), True)
        ref.append_block_ids(r, (ids,), True)
    idx = list(range(7, -1, -1))
    qsl = list(range(0, 9 * 2, 2))
    pos = [p for r in idx for p in (16 * (width - 7 * r - 2) + 3, 16 * 5000 + 1)]
    gathered, slots = bt.prepare_inputs(torch.tensor(idx, device=device), torch.tensor(qsl, device=device),
                                        torch.tensor(pos, device=device), 8, 16)  # fmt: skip
    torch.cuda.synchronize(device)
    np.testing.assert_array_equal(bt[0].tensor.cpu().numpy(), ref.tables[0])
    zero = [np.zeros(t.shape, np.int64) for t in ref.tables]
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, 8, zero)[0]
    np.testing.assert_array_equal(gathered[0].cpu().numpy(), want)
    want_slots = compute_slot_mappings_reference(ref.tables, [16], idx, qsl, pos, 16)
    np.testing.assert_array_equal(slots.cpu().numpy(), want_slots)


def test_device_input_steps_land_every_step_and_a_capture_between_them_is_refused(device):
    """Eager decode steps with device inputs (the engine's common case) land each step's writes; a capture of the
    same call (tables without graph mode) is refused before anything launches or is dropped; the next eager step
    lands the writes the refused call kept staged, host and device counts equal."""
    bt = BlockTables([16, 32], 4, [4, 4], device, [16, 16], max_num_batched_tokens=8)
    idx = torch.tensor([1, 0], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    pos = torch.tensor([0, 0], dtype=torch.int64, device=device)
    for step in range(4):
        bt.append_block_ids(step % 2, ([10 + step], [20 + step]), overwrite=True)
        gathered, slots = bt.prepare_inputs(idx, qsl, pos, 2, 2)
    torch.cuda.synchronize(device)
    assert gathered[0][:, 0].tolist() == [13, 12] and slots[0].tolist() == [13 * 16, 12 * 16]
    bt.append_block_ids(0, ([7, 8], [9]), overwrite=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match=r"BlockTables\.prepare_inputs"):
        with torch.cuda.graph(graph):
            bt.prepare_inputs(idx, qsl, pos, 2, 2)
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1]
    pos = torch.tensor([0, 16], dtype=torch.int64, device=device)  # entry 1 (row 0) reads its second block now
    gathered, slots = bt.prepare_inputs(idx, qsl, pos, 2, 2)
    torch.cuda.synchronize(device)
    assert gathered[0][1, :2].tolist() == [7, 8] and slots[0].tolist() == [13 * 16, 8 * 16]
    assert bt.num_blocks_device.cpu().tolist() == bt.num_blocks.tolist()
