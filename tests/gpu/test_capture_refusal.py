"""On a real GPU: work that cannot be captured in a CUDA graph (an eager apply or clear, a second consume launch, a
`BlockTables` without `cuda_graphs=True`, a host input) is refused during `torch.cuda.graph(...)` before anything is
recorded or changed; a graph of other work that is never replayed does not hold up the staging rings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, GraphCaptureError, RingWaitWarning, StageInputError
from tests.gpu.captured import BLOCK_SIZES, KERNEL_BLOCK_SIZES
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


def graph_tables_with_inputs(device, backend_name: str):
    """A graph-mode BlockTables of G3 (8 rows, 64 tokens) and device inputs of `prepare_inputs` (idx_mapping,
    query_start_loc, positions), after one eager `prepare_inputs` (the warm-up that compiles its kernels)."""
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name),
                     cuda_graphs=True, max_num_batched_tokens=64)  # fmt: skip
    idx = torch.zeros(8, dtype=torch.int32, device=device)
    qsl, pos = torch.zeros(9, dtype=torch.int32, device=device), torch.zeros(64, dtype=torch.int64, device=device)
    bt.prepare_inputs(idx, qsl, pos, 8, 64)
    return bt, (idx, qsl, pos)


def test_a_second_consume_launch_in_one_capture_is_refused(device, backend_name):
    """apply_staged_writes() and then prepare_inputs() in one torch.cuda.graph capture: the second consume launch is
    refused (GraphCaptureError, found by the driver's capture id), the capture completes, and its replays pair one to
    one with the commits; a second capture records its own consume launch."""
    if torch.version.hip is not None:
        pytest.skip("the capture id is read on NVIDIA only (cuStreamGetCaptureInfo)")
    bt, (idx, qsl, pos) = graph_tables_with_inputs(device, backend_name)
    torch.cuda.synchronize(device)
    g, other = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        bt.apply_staged_writes()
        with pytest.raises(GraphCaptureError, match="already recorded their consume launch"):
            bt.prepare_inputs(idx, qsl, pos, 8, 64)
    with torch.cuda.graph(other):
        bt.prepare_inputs(idx, qsl, pos, 8, 64)
    torch.cuda.synchronize(device)
    for step in range(4):
        bt.append_block_ids(step, ([step + 1], [], []), True)
        bt.commit_staged_writes()
        (g if step % 2 else other).replay()
    torch.cuda.synchronize(device)
    assert bt[0].tensor[:4, 0].tolist() == [1, 2, 3, 4]
    assert (bt.graph.ring.runs, bt.graph.ring.missed, bt.graph.ring.idle_runs) == (4, 0, 0)


def test_a_capture_without_the_flag_is_refused_naming_it(device, backend_name):
    bt = BlockTables(BLOCK_SIZES, 8, [20, 10, 40], device, KERNEL_BLOCK_SIZES, backend=gpu_backend(backend_name))
    bt.append_block_ids(0, ([1], [2], [3]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([4], [5], [6]), True)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match=r"cuda_graphs=True"):
        with torch.cuda.graph(g):
            bt.apply_staged_writes()
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert bt[2].tensor[1, 0].item() == 6


def test_a_host_input_is_refused_during_capture_and_nothing_is_recorded(device, backend_name):
    bt, (_, qsl, pos) = graph_tables_with_inputs(device, backend_name)
    bt.append_block_ids(0, ([1], [2], [3]), True)
    host_idx = torch.zeros(8, dtype=torch.int32).pin_memory()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(StageInputError, match="idx_mapping is on cpu.*host->device copy would be captured"):
        with torch.cuda.graph(g):
            bt.prepare_inputs(host_idx, qsl, pos, 8, 64)
    assert bt.graph.recordings == [] and [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert bt[2].tensor[0, 0].item() == 3
