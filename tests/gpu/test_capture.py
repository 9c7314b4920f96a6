"""CUDA graph capture is refused before anything is recorded (issue 8, fault 1), on a real GPU."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from multiwrite.errors import GraphCaptureError

from .gpu_helpers import RandomBlockTables, RandomTensors, gpu_backend, warm_up


def _ring_wait_warning() -> type[Warning]:
    from multiwrite.backends.triton_kernel import RingWaitWarning  # (needs Triton: imported in the test)

    return RingWaitWarning


def _tokens(bt) -> list[int]:
    return list(bt._arena.lender.ring.tokens)


def test_apply_and_clear_inside_a_capture_are_refused_and_change_nothing(device, backend_name, tmp_path):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(5)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    rb.step()  # the BlockTables now stages into a lent ring: a captured launch would read it by address
    rt.step()
    torch.cuda.synchronize(device)
    rb.stage_step()
    rt.stage_step()
    staged = rb.bt._arena.num_writes, [t.num_staged_writes for t in rt.tabs]
    host_counts = rb.bt.num_blocks.copy()
    before = [t.tensor.clone() for t in rb.bt.block_tables] + [t.tensor.clone() for t in rt.tabs]
    tokens, shared_tokens = _tokens(rb.bt), list(backend.writer(device)._ring.tokens)
    marker = torch.zeros(8, device=device)
    graphs = []
    for call in (rb.bt.apply_staged_writes, rb.bt.clear_staged_writes, lambda: rt.writer.apply(rt.tabs)):
        g = torch.cuda.CUDAGraph()
        if hasattr(g, "enable_debug_mode"):
            g.enable_debug_mode()
        with pytest.raises(GraphCaptureError, match="graph capture"):
            with torch.cuda.graph(g):
                marker.add_(1)  # something legitimately captured around the refused call
                call()
        graphs.append(g)
        assert (rb.bt._arena.num_writes, [t.num_staged_writes for t in rt.tabs]) == staged
        np.testing.assert_array_equal(rb.bt.num_blocks, host_counts)
        assert _tokens(rb.bt) == tokens and list(backend.writer(device)._ring.tokens) == shared_tokens
    for i, g in enumerate(graphs):
        path = tmp_path / f"graph{i}.dot"
        try:
            g.debug_dump(str(path))
        except RuntimeError:  # no debug dump on this CUDA or torch: the replay below still decides
            continue
        if path.exists():
            assert "_write_kernel_fn" not in path.read_text()
    for g in graphs:  # a replay runs what was captured, and none of ours
        g.replay()
    torch.cuda.synchronize(device)
    assert marker.tolist() == [float(len(graphs))] * 8  # capturing ran nothing; each replay added 1
    after = [t.tensor for t in rb.bt.block_tables] + [t.tensor for t in rt.tabs]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # The writes refused during capture are still staged and land exactly when applied eagerly; the ring
    # then wraps several times without waiting for a token that a captured launch would never deliver.
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ring_wait_warning())
        rb.bt.apply_staged_writes()
        rt.writer.apply(rt.tabs)
        for _ in range(10):
            rb.step()
            rt.step()
        torch.cuda.synchronize(device)
    assert rb.mismatches() == 0 and rt.mismatches() == 0


def test_a_graph_of_other_work_never_replayed_does_not_hurt(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(6)
    rb, rt = RandomBlockTables(device, backend, rng), RandomTensors(device, backend, rng)
    x = torch.ones(1 << 16, device=device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2  # never replayed
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ring_wait_warning())
        for _ in range(50):
            rb.step()
            rt.step()
    torch.cuda.synchronize(device)
    assert rb.mismatches() == 0 and rt.mismatches() == 0
    del g, y
