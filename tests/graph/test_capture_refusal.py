"""Work that cannot be captured in a CUDA graph is refused during a capture before anything changes: an eager apply
or clear (tables without graph mode), a writer's apply. Captures are simulated (`multiwrite.capture.simulated_capture`,
which the refusal consults for CPU tables); real captures run in tests/gpu/test_capture_refusal.py. And the fork
guard: CUDA tables in a child forked after CUDA use raise ForkedCudaError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite import capture as capture_module
from multiwrite.capture import simulated_capture
from multiwrite.errors import ForkedCudaError, GraphCaptureError
from multiwrite.reference import ReferenceBlockTables, apply_writes_reference
from tests.support.tables import host


def test_block_tables_apply_and_clear_during_a_capture_change_nothing(backend, staging):
    from multiwrite.testing.staging import block_tables_class

    if backend.device.type != "cpu":
        pytest.skip("a simulated capture is seen by CPU tables only: real captures run in tests/gpu")

    bt = block_tables_class(staging)([16, 32], 6, [5, 4], backend.device, [16, 16], backend=backend.name)
    ref = ReferenceBlockTables([16, 32], 6, [5, 4], [16, 16])
    for req, ids, ow in [(0, ([1, 2], [3]), True), (3, ([4], []), True)]:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    bt.apply_staged_writes()
    for req, ids, ow in [(0, ([5], [6, 7]), False), (3, ([8, 9], [10]), False), (0, ([11], []), False)]:
        bt.append_block_ids(req, ids, ow)
        ref.append_block_ids(req, ids, ow)
    staged = [t.num_staged_writes for t in bt.block_tables]
    counts = bt.num_blocks.copy()
    before = [t.tensor.clone() for t in bt.block_tables], bt.num_blocks_device.clone()
    with simulated_capture() as graph:
        for call, what in ((bt.apply_staged_writes, "apply_staged_writes"), (bt.clear_staged_writes,
                                                                             "clear_staged_writes")):  # fmt: skip
            with pytest.raises(GraphCaptureError, match=rf"BlockTables\.{what} on .* during CUDA graph capture"):
                call()
            assert [t.num_staged_writes for t in bt.block_tables] == staged
            np.testing.assert_array_equal(bt.num_blocks, counts)  # the clear restored nothing either
            assert all(torch.equal(t.tensor, b) for t, b in zip(bt.block_tables, before[0]))
            assert torch.equal(bt.num_blocks_device, before[1])
    assert graph.launches == []
    bt.apply_staged_writes()  # afterwards the same writes land exactly
    for g, t in enumerate(bt.block_tables):
        np.testing.assert_array_equal(host(t.tensor), ref.tables[g])
    np.testing.assert_array_equal(host(bt.num_blocks_device), ref.num_blocks)


def test_a_writer_apply_during_a_capture_is_refused_naming_what_to_do_and_keeps_staging_order():
    a = StagedWriteTensor((4, 8), torch.int32, "cpu", name="a")
    b = StagedWriteTensor((3, 5), torch.float32, "cpu", name="b")
    writer = FusedStagedWriter("cpu", backend="triton-cuda")
    ref_a, ref_b = np.zeros((4, 8)), np.zeros((3, 5))
    a.stage_write(0, 2, [7, 8, 9])
    a.stage_write(0, 3, [5])  # overlaps the previous write: staging order must survive the refusal
    b.stage_write(1, 0, [1.5, 2.5])
    apply_writes_reference(ref_a, [(0, 2, [7, 8, 9]), (0, 3, [5])])
    apply_writes_reference(ref_b, [(1, 0, [1.5, 2.5])])
    with simulated_capture() as graph, pytest.raises(GraphCaptureError) as info:
        writer.apply([a, b])
    msg = str(info.value)
    for part in ("FusedStagedWriter.apply on cpu during CUDA graph capture", "the staged writes stay staged",
                 "outside torch.cuda.graph", "BlockTables(..., cuda_graphs=True)"):  # fmt: skip
        assert part in msg, part
    assert isinstance(info.value, RuntimeError) and graph.launches == []
    assert (a.num_staged_writes, b.num_staged_writes) == (2, 1) and not a.tensor.any() and not b.tensor.any()
    writer.apply([a, b])
    np.testing.assert_array_equal(host(a.tensor), ref_a)
    np.testing.assert_array_equal(host(b.tensor), ref_b)


def test_a_capture_on_another_thread_does_not_refuse_this_one():
    import threading

    t = StagedWriteTensor((2, 4), torch.int32, "cpu")
    t.stage_write(1, 0, [3, 4])
    inside, done = threading.Event(), threading.Event()

    def capturing() -> None:
        with simulated_capture():
            inside.set()
            done.wait(10)

    other = threading.Thread(target=capturing)
    other.start()
    try:
        assert inside.wait(10)
        FusedStagedWriter("cpu", backend="torch-cpu").apply([t])  # this thread is not capturing
    finally:
        done.set()
        other.join()
    assert t.tensor[1].tolist() == [3, 4, 0, 0]


def test_a_child_forked_after_cuda_use_gets_a_clear_error(monkeypatch):
    """White-box (no GPU here): after a fork from a parent that initialized CUDA, every CUDA capture probe raises
    ForkedCudaError naming 'spawn'; from a parent without CUDA nothing changes; CPU tables still work."""
    monkeypatch.setattr(capture_module, "_is_capturing", lambda: False)  # restored afterwards, fork guard or not
    monkeypatch.setattr(capture_module, "_get_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    capture_module._after_fork_in_child()  # a fork from a parent without CUDA: nothing changes
    capture_module.refuse_capture(torch.device("cuda", 0), "apply")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    capture_module._after_fork_in_child()
    for probe in (lambda: capture_module.refuse_capture(torch.device("cuda", 0), "apply"),
                  lambda: capture_module.is_capturing(torch.device("cuda", 0))):  # fmt: skip
        with pytest.raises(ForkedCudaError, match="forked after its parent initialized CUDA.*'spawn'"):
            probe()
    capture_module.refuse_capture(torch.device("cpu"), "apply")  # CPU tables still work in the child
    bt = BlockTables([16], 2, [4], "cpu")
    bt.append_block_ids(1, ([3, 4],), True)
    bt.apply_staged_writes()
    assert bt[0].tensor[1, :2].tolist() == [3, 4]
