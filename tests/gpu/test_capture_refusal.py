"""On a real GPU: work that cannot be captured in a CUDA graph is refused during `torch.cuda.graph(...)` before anything
is recorded or changed; a graph of other work that is never replayed does not hold up the staging rings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from multiwrite import GraphCaptureError, RingWaitWarning
from tests.gpu.helpers import RandomBlockTables, RandomTensors, gpu_backend, warm_up


def test_apply_and_clear_inside_a_capture_are_refused_and_change_nothing(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(5)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    rb.step()  # the BlockTables now stages into a lent ring: a captured launch would read it by address
    rt.step()
    torch.cuda.synchronize(device)
    rb.stage_step()
    rt.stage_step()
    staged = [t.num_staged_writes for t in rb.bt.block_tables], [t.num_staged_writes for t in rt.tabs]
    host_counts = rb.bt.num_blocks.copy()
    before = [t.tensor.clone() for t in rb.bt.block_tables] + [t.tensor.clone() for t in rt.tabs]
    marker = torch.zeros(8, device=device)
    graphs = []
    for call in (rb.bt.apply_staged_writes, rb.bt.clear_staged_writes, lambda: rt.writer.apply(rt.tabs)):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(GraphCaptureError, match="graph capture"):
            with torch.cuda.graph(g):
                marker.add_(1)  # something legitimately captured around the refused call
                call()
        graphs.append(g)
        assert ([t.num_staged_writes for t in rb.bt.block_tables], [t.num_staged_writes for t in rt.tabs]) == staged
        np.testing.assert_array_equal(rb.bt.num_blocks, host_counts)
    for g in graphs:  # a replay runs what was captured, and none of ours
        g.replay()
    torch.cuda.synchronize(device)
    assert marker.tolist() == [float(len(graphs))] * 8
    after = [t.tensor for t in rb.bt.block_tables] + [t.tensor for t in rt.tabs]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # The refused writes are still staged and land exactly when applied eagerly; the rings then wrap several times
    # without waiting for a token that a captured launch would never store.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        rb.bt.apply_staged_writes()
        rt.writer.apply(rt.tabs)
        for _ in range(10):
            rb.step()
            rt.step()
        torch.cuda.synchronize(device)
    assert rb.mismatches() == 0 and rt.mismatches() == 0


def test_an_eager_prepare_inputs_inside_a_capture_is_refused_and_applies_nothing(device):
    from multiwrite import BlockTables

    bt = BlockTables([16], 2, [4], device, max_num_batched_tokens=8)
    bt.append_block_ids(0, ([3],), overwrite=True)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match=r"BlockTables\.prepare_inputs on cuda.*during CUDA graph capture"):
        with torch.cuda.graph(graph):
            bt.prepare_inputs(idx, qsl, pos, 1, 1)
    assert bt[0].num_staged_writes == 1
    gathered, slots = bt.prepare_inputs(idx, qsl, pos, 1, 1)
    assert gathered[0][0, 0].item() == 3 and slots[0, 0].item() == 48


def test_a_graph_of_other_work_never_replayed_does_not_hold_up_the_rings(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(6)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    x = torch.ones(1 << 16, device=device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2  # never replayed
    with warnings.catch_warnings():
        warnings.simplefilter("error", RingWaitWarning)
        for _ in range(50):
            rb.step()
            rt.step()
    torch.cuda.synchronize(device)
    assert rb.mismatches() == 0 and rt.mismatches() == 0
    del g, y
