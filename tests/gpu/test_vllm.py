"""On a real GPU: vLLM 0.33's uses of the tables. `compute_slot_mappings` and a gather captured in a CUDA graph on
tables without graph mode (vLLM's speculator does this) replay against the tables as eager applies leave them, queued
behind a busy stream, also right after `multiwrite.vllm.BlockTables.apply_staged_writes()`; that class's three calls
equal the core's torch stage step after step, with dummy entries and unsharded groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.vllm import BlockTables as VllmBlockTables
from tests.gpu.helpers import busy


def new_tables(kind: str, device, backend_name: str):
    """Tables of two groups (block sizes 16 and 8, 4 rows of 4 blocks, 8 tokens) without graph mode: the core's
    `BlockTables`, or `multiwrite.vllm.BlockTables`."""
    if kind == "vllm":
        return VllmBlockTables([16, 8], 4, 8, [4, 4], device, backend=backend_name)
    return BlockTables([16, 8], 4, [4, 4], device, backend=backend_name, max_num_batched_tokens=8)


@pytest.mark.parametrize("busy_s", [0.01, 0.0], ids=["behind-a-busy-stream", "right-after-the-apply"])
@pytest.mark.parametrize("kind", ["core", "vllm"])
def test_a_gather_and_slot_mapping_captured_without_graph_mode_read_the_tables_at_each_replay(
    device, backend_name, kind, busy_s
):
    """A gather and `compute_slot_mappings` captured in one graph on tables without graph mode; each step an eager
    apply, then the replay, queued behind a busy stream or right after the apply, with no eager gather or slot
    mapping between them: the replay reads the tables with that step's writes. (Issue 23, item 3 (a):
    `multiwrite.vllm.BlockTables` deferred the apply into the next eager gather or slot mapping, so a replay right
    after `apply_staged_writes()` read the tables without that step's writes; vLLM's class, and this one now, applies
    at once.)"""
    bt = new_tables(kind, device, backend_name)
    bt.append_block_ids(2, ([1], [2]), True)
    bt.apply_staged_writes()
    idx = torch.tensor([2, -1], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 5, 0], dtype=torch.int64, device=device)
    bt.gather_block_tables(idx[:1], 1)  # eager first: compiles outside the capture
    bt.compute_slot_mappings(idx, qsl, pos, 4)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = bt.gather_block_tables(idx[:1], 1)
        slots = bt.compute_slot_mappings(idx, qsl, pos, 4)
    for step, (a, b) in enumerate([(5, 6), (7, 9), (11, 3)]):
        bt.append_block_ids(2, ([a], [b]), True)
        bt.apply_staged_writes()
        if busy_s:
            busy(busy_s)  # the replay queues behind a busy stream, after the eager apply
        graph.replay()
        torch.cuda.synchronize(device)
        assert slots.tolist() == [[a * 16 + 3, a * 16 + 5, -1, -1], [b * 8 + 3, b * 8 + 5, -1, -1]], step
        assert gathered[0].tolist() == [[a, 0, 0, 0]] and gathered[1].tolist() == [[b, 0, 0, 0]], step


def test_vllms_calls_equal_the_core_on_the_torch_stage_over_many_steps(device, backend_name):
    """`multiwrite.vllm.BlockTables` (apply, gather, slot mappings: the Triton launches) against the core's
    `prepare_inputs` on torch-generic (the torch stage), step after step, with dummy entries, a group without slot
    mappings, and two unsharded groups, one of block size 10 that `cp_interleave` 4 does not divide (issue 23, item 7:
    a Mamba group, whose block size vLLM sets to `max_model_len`)."""
    rng = np.random.default_rng(18)
    sizes, widths = [16, 32, 8, 10], [8, 4, 16, 6]
    G, R, T = len(sizes), 16, 64
    kwargs = dict(cp_size=2, cp_rank=1, cp_interleave=4, slot_mapping_enabled=[True, False, True, True],
                  dcp_sharded=[True, True, False, False])  # fmt: skip
    ours = VllmBlockTables(sizes, R, T, widths, device, backend=backend_name, **kwargs)
    torch_stage = BlockTables(sizes, R, widths, device, backend="torch-generic", max_num_batched_tokens=T, **kwargs)
    held = np.zeros((G, R), dtype=np.int64)
    for step in range(200):
        for _ in range(int(rng.integers(0, 6))):
            r, overwrite = int(rng.integers(0, R)), bool(rng.integers(0, 2))
            ids = []
            for g, width in enumerate(widths):
                start = 0 if overwrite else held[g, r]
                n = int(rng.integers(0, width - start + 1))
                ids.append(rng.integers(0, 1000, n).tolist())
                held[g, r] = start + n if (n or overwrite) else held[g, r]
            ours.append_block_ids(r, ids, overwrite)
            torch_stage.append_block_ids(r, ids, overwrite)
        n = int(rng.integers(1, R + 1))
        rows = rng.permutation(R)[:n]
        rows[rng.random(n) < 0.1] = -1
        idx = torch.tensor(rows, dtype=torch.int64, device=device)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        pos = torch.tensor([int(rng.integers(0, 40)) for _ in range(n)], dtype=torch.int64, device=device)
        padded = n + int(rng.integers(0, R - n + 1))
        ours.apply_staged_writes()
        gathered = [g.clone() for g in ours.gather_block_tables(idx, padded)]
        slots = ours.compute_slot_mappings(idx, qsl, pos, n + 1).clone()
        want_gathered, want_slots = torch_stage.prepare_inputs(idx, qsl, pos, padded, n + 1)
        for a, b in zip(gathered, want_gathered):
            assert torch.equal(a, b), step
        assert torch.equal(slots, want_slots), step
        for a, b in zip(ours.input_block_tables, torch_stage.input_block_tables):
            assert torch.equal(a, b), step
        for a, b in zip(ours.block_tables, torch_stage.block_tables):
            assert torch.equal(a.gpu, b.tensor), step
