"""Applies follow the current stream; host state never depends on a read of a busy stream."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor
from multiwrite.reference import ReferenceBlockTables
from multiwrite.replay import count_mismatches
from tests.gpu.helpers import RandomBlockTables, busy, gpu_backend, warm_up


def test_an_apply_lands_on_the_current_non_default_stream(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(7)
    t = StagedWriteTensor((64, 128), torch.int32, device, name="t")
    writer = FusedStagedWriter(device, backend=backend)
    for row in range(64):  # compile and bind both tiles for this table outside the timed window
        t.stage_write(row, 0, [1] * 5)
    writer.apply([t])
    t.stage_write(0, 0, [1])
    writer.apply([t])
    torch.cuda.synchronize(device)
    ref = t.tensor.cpu().numpy().copy()
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s):
        busy(0.3)
        for row in range(64):
            vals = rng.integers(1, 1000, 5)
            t.stage_write(row, 3, vals)
            ref[row, 3:8] = vals
        writer.apply([t])
    early = t.tensor.cpu().numpy()  # the default stream does not wait for s
    s.synchronize()
    assert not np.array_equal(early, ref), "the apply did not wait for its stream's queued work"
    np.testing.assert_array_equal(t.tensor.cpu().numpy(), ref)


def test_two_streams_share_one_backend_ring(device, backend_name):
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    rng = np.random.default_rng(8)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    sets = [RandomBlockTables(device, backend, rng), RandomBlockTables(device, backend, rng)]
    for it in range(2000):
        with torch.cuda.stream(streams[it % 2]):
            if it % 500 == 0:
                busy(0.02)
            sets[it % 2].step()
    for s in streams:
        s.synchronize()
    assert [rb.mismatches() for rb in sets] == [0, 0]


def test_a_clear_after_an_apply_queued_on_a_busy_side_stream(device, backend_name):
    """Apply on a side stream still asleep, clear on the current stream, append: the append goes after the counts of
    the applied writes, from host state alone (no read of the busy stream's results)."""
    backend = gpu_backend(backend_name, ring_depth=2)
    warm_up(device, backend)
    bs, kbs, widths = [16, 32], [16, 16], [10, 6]
    bt = BlockTables(bs, 8, widths, device, kbs, backend=backend)
    ref = ReferenceBlockTables(bs, 8, widths, kbs)

    def both(req, ids, overwrite):
        bt.append_block_ids(req, ids, overwrite)
        ref.append_block_ids(req, ids, overwrite)

    both(0, ([1], [2]), True)  # compile and bind this table's variant outside the window
    bt.apply_staged_writes()
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        both(0, ([3, 4], [5]), False)
        both(1, ([6], [7, 8]), True)
        busy(0.5)
        bt.apply_staged_writes()  # queued behind half a second of sleep
    ref.apply_staged_writes()
    bt.append_block_ids(0, ([99], [98]), False)  # staged, then dropped
    assert not side.query(), "the side stream finished too early for this test to mean anything"
    bt.clear_staged_writes()  # on the current stream, while the apply above has not run yet
    np.testing.assert_array_equal(bt.num_blocks, ref.num_blocks)  # the counts as of the last apply
    both(0, ([9], [10]), False)
    both(1, ([11], []), False)
    with torch.cuda.stream(side):
        bt.apply_staged_writes()
    side.synchronize()
    assert count_mismatches(bt, ref) == 0
