"""On a real GPU: vLLM 0.33's uses of the tables. `compute_slot_mappings` and a gather captured in a CUDA graph on
tables without graph mode (vLLM's speculator does this) replay against the tables as eager applies leave them, queued
behind a busy stream; `multiwrite.vllm.BlockTables`' deferred apply gives what an apply at once gives, step after step
with dummy entries, sliding windows and unsharded groups."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables
from multiwrite.vllm import BlockTables as VllmBlockTables


def test_a_slot_mapping_captured_without_graph_mode_reads_the_tables_at_each_replay(device, backend_name):
    bt = BlockTables([16, 8], 4, [4, 4], device, backend=backend_name, max_num_batched_tokens=8)
    bt.append_block_ids(2, ([1], [2]), True)
    bt.apply_staged_writes()
    idx = torch.tensor([2, -1], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    pos = torch.tensor([3, 5, 0], dtype=torch.int64, device=device)
    bt.compute_slot_mappings(idx, qsl, pos, 4)  # compiles outside the capture
    bt.gather_block_tables(idx[:1], 1)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = bt.gather_block_tables(idx[:1], 1)
        slots = bt.compute_slot_mappings(idx, qsl, pos, 4)
    for step, (a, b) in enumerate([(5, 6), (7, 9), (11, 3)]):
        bt.append_block_ids(2, ([a], [b]), True)
        bt.apply_staged_writes()
        torch.cuda._sleep(20_000_000)  # the replay queues behind a busy stream, after the eager apply
        graph.replay()
        torch.cuda.synchronize(device)
        assert slots.tolist() == [[a * 16 + 3, a * 16 + 5, -1, -1], [b * 8 + 3, b * 8 + 5, -1, -1]], step
        assert gathered[0][0, 0].item() == a and gathered[1][0, 0].item() == b


def test_the_deferred_apply_equals_an_apply_at_once_over_many_steps(device, backend_name):
    rng = np.random.default_rng(18)
    G, R, T = 3, 16, 64
    kwargs = dict(cp_size=2, cp_rank=1, cp_interleave=4, slot_mapping_enabled=[True, False, True],
                  dcp_sharded=[True, True, False], backend=backend_name)  # fmt: skip
    deferred = VllmBlockTables([16, 32, 8], R, T, [8, 4, 16], device, **kwargs)
    at_once = VllmBlockTables([16, 32, 8], R, T, [8, 4, 16], device, defer_apply=False, **kwargs)
    held = np.zeros((G, R), dtype=np.int64)
    for step in range(200):
        for _ in range(int(rng.integers(0, 6))):
            r, overwrite = int(rng.integers(0, R)), bool(rng.integers(0, 2))
            ids = []
            for g, width in enumerate([8, 4, 16]):
                start = 0 if overwrite else held[g, r]
                n = int(rng.integers(0, width - start + 1))
                ids.append(rng.integers(0, 1000, n).tolist())
                held[g, r] = start + n if (n or overwrite) else held[g, r]
            for bt in (deferred, at_once):
                bt.append_block_ids(r, ids, overwrite)
        n = int(rng.integers(1, R + 1))
        rows = rng.permutation(R)[:n]
        rows[rng.random(n) < 0.1] = -1
        idx = torch.tensor(rows, dtype=torch.int64, device=device)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        pos = torch.tensor([int(rng.integers(0, 8)) for _ in range(n)], dtype=torch.int64, device=device)
        padded = n + int(rng.integers(0, R - n + 1))
        outs = []
        for bt in (deferred, at_once):
            bt.apply_staged_writes()
            gathered = bt.gather_block_tables(idx, padded)
            slots = bt.compute_slot_mappings(idx, qsl, pos, n + 1)
            outs.append(([g.clone() for g in gathered], slots.clone()))
        for a, b in zip(outs[0][0], outs[1][0]):
            assert torch.equal(a, b), step
        assert torch.equal(outs[0][1], outs[1][1]), step
        for a, b in zip(deferred.input_block_tables, at_once.input_block_tables):
            assert torch.equal(a, b), step
