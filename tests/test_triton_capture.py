"""CUDA graph capture is refused before anything changes (issue 8, fault 1), checked on CPU.

The capture probe (`multiwrite.capture._is_capturing`, torch's `cudaStreamIsCapturing`) is replaced by one
that reports a capture; for CPU tables the writer's check is pointed at a CUDA device so that the probe is
consulted. Real captures run in tests/gpu/test_capture.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multiwrite.block_tables as block_tables_module
import multiwrite.writer as writer_module
from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite import capture as capture_module
from multiwrite.errors import ForkedCudaError, GraphCaptureError
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference


@pytest.fixture
def capturing(monkeypatch):
    """While the returned switch is on, every apply/clear sees a capturing CUDA stream."""
    state = {"on": False}
    real = capture_module.refuse_capture
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: state["on"])
    monkeypatch.setattr(capture_module, "_get_device", lambda: 0)

    def as_if_cuda(device, what):
        real(torch.device("cuda", 0), what)

    monkeypatch.setattr(writer_module, "refuse_capture", as_if_cuda)
    monkeypatch.setattr(block_tables_module, "refuse_capture", as_if_cuda)
    return state


def _ring_tokens(tables_backend, device):
    """Every token of the Triton writer's rings (shared and lent), or None for other backends."""
    writer_of = getattr(tables_backend, "writer", None)
    if writer_of is None:
        return None
    w = writer_of(device)
    return list(w._ring.tokens), [list(r.tokens) for r in w._retiring]


def test_refuse_capture_names_the_operation_and_what_to_do(monkeypatch):
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: True)
    monkeypatch.setattr(capture_module, "_get_device", lambda: 0)
    with pytest.raises(GraphCaptureError) as info:
        capture_module.refuse_capture(torch.device("cuda", 0), "FusedStagedWriter.apply")
    msg = str(info.value)
    assert "FusedStagedWriter.apply on cuda:0" in msg
    assert "graph capture" in msg and "staged writes stay staged" in msg
    assert "outside torch.cuda.graph" in msg and "BlockTables(..., cuda_graphs=True)" in msg
    assert isinstance(info.value, RuntimeError)
    # Not capturing, or not a CUDA device: nothing raised (the probe is not even consulted for CPU).
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: False)
    capture_module.refuse_capture(torch.device("cuda", 0), "x")
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: 1 / 0)
    capture_module.refuse_capture(torch.device("cpu"), "x")


def test_block_tables_apply_and_clear_during_capture_change_nothing(backend, staging, capturing):
    bt = BlockTables([16, 32], 6, [5, 4], backend.device, [16, 16], backend=backend.name)
    ref = ReferenceBlockTables([16, 32], 6, [5, 4], [16, 16])
    first = [(0, ([1, 2], [3]), True), (3, ([4], []), True)]
    for req, ids, ow in first:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    bt.apply_staged_writes()  # binds the lent ring (Triton) and the fast path: the capture hits it next
    second = [(0, ([5], [6, 7]), False), (3, ([8, 9], [10]), False), (0, ([11], []), False)]
    for req, ids, ow in second:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    staged = bt._arena.num_writes
    host_counts = bt.num_blocks.copy()
    tables_before = [t.tensor.clone() for t in bt.block_tables]
    device_counts = bt.num_blocks_device.clone()
    tokens = _ring_tokens(bt.backend, bt.device)
    capturing["on"] = True
    for call in (bt.apply_staged_writes, bt.clear_staged_writes):
        with pytest.raises(GraphCaptureError):
            call()
        assert bt._arena.num_writes == staged  # still staged
        np.testing.assert_array_equal(bt.num_blocks, host_counts)  # the clear restored nothing either
        for t, before in zip(bt.block_tables, tables_before):
            assert torch.equal(t.tensor, before)
        assert torch.equal(bt.num_blocks_device, device_counts)
        assert _ring_tokens(bt.backend, bt.device) == tokens  # no slot was taken, no token issued
    capturing["on"] = False
    bt.apply_staged_writes()  # the same writes, applied eagerly afterwards, land exactly
    for g, t in enumerate(bt.block_tables):
        np.testing.assert_array_equal(t.tensor.cpu().numpy(), ref.tables[g])
    np.testing.assert_array_equal(bt.num_blocks_device.cpu().numpy(), ref.num_blocks)


@pytest.mark.parametrize("path", ["first apply", "repeat fast path"])
def test_fused_writer_apply_during_capture_changes_nothing(backend, capturing, path):
    a = StagedWriteTensor((4, 8), torch.int32, backend.device, name="a")
    b = StagedWriteTensor((3, 5), torch.float32, backend.device, name="b")
    writer = FusedStagedWriter(backend.device, backend=backend.name)
    ref_a, ref_b = np.zeros((4, 8)), np.zeros((3, 5))
    if path == "repeat fast path":
        a.stage_write(1, 0, [1, 2])
        b.stage_write(2, 1, [0.5])
        writer.apply([a, b])
        apply_writes_reference(ref_a, [(1, 0, [1, 2])])
        apply_writes_reference(ref_b, [(2, 1, [0.5])])
    a.stage_write(0, 2, [7, 8, 9])
    a.stage_write(0, 3, [5])  # overlaps the previous write: staging order must survive the refusal
    b.stage_write(1, 0, [1.5, 2.5])
    apply_writes_reference(ref_a, [(0, 2, [7, 8, 9]), (0, 3, [5])])
    apply_writes_reference(ref_b, [(1, 0, [1.5, 2.5])])
    before = a.tensor.clone(), b.tensor.clone()
    capturing["on"] = True
    with pytest.raises(GraphCaptureError):
        writer.apply([a, b])
    assert (a.num_staged_writes, b.num_staged_writes) == (2, 1)
    assert torch.equal(a.tensor, before[0]) and torch.equal(b.tensor, before[1])
    capturing["on"] = False
    writer.apply([a, b])
    np.testing.assert_array_equal(a.tensor.cpu().numpy(), ref_a)
    np.testing.assert_array_equal(b.tensor.cpu().numpy(), ref_b)
    assert (a.num_staged_writes, b.num_staged_writes) == (0, 0)


def test_a_forked_cuda_child_gets_a_clear_error(monkeypatch):
    """After a fork from a parent that initialized CUDA, every CUDA probe raises ForkedCudaError."""
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: False)  # (the real probe is restored afterwards)
    monkeypatch.setattr(capture_module, "_get_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    capture_module._after_fork_in_child()  # a fork from a parent without CUDA: nothing changes
    capture_module.refuse_capture(torch.device("cuda", 0), "apply")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    capture_module._after_fork_in_child()
    with pytest.raises(ForkedCudaError, match="forked after its parent initialized CUDA.*'spawn'"):
        capture_module.refuse_capture(torch.device("cuda", 0), "apply")
    capture_module.refuse_capture(torch.device("cpu"), "apply")  # CPU tables still work in the child
