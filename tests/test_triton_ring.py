"""Waiting for a ring slot never hangs silently (issue 8): a warning after `wait_warn_s`, then a device sync
and `RingStallError` if the slot's completion token never arrives; never a silent reuse of a slot that a
(captured) kernel may still read. Checked through Triton's interpreter on CPU with simulated tokens, and
the kernel's own masking of cells outside a table (defence in depth, issue 8 "resize done right").
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch

from multiwrite import WriteBatch

triton_kernel = pytest.importorskip("multiwrite.backends.triton_kernel")
if not triton_kernel.INTERPRETED:  # pragma: no cover - a GPU machine
    pytest.skip("these tests drive the kernel through Triton's interpreter on CPU", allow_module_level=True)

CPU = torch.device("cpu")


def _writer(depth: int = 1, **kw) -> triton_kernel.TritonWriter:
    return triton_kernel.TritonWriter(CPU, triton_kernel.cuda_launch_params(), ring_depth=depth, **kw)


def _launch_lost(ring, i: int) -> int:
    """Slot `i` as if a kernel had been launched on it whose completion token never arrives."""
    return ring.next_token(i)


def test_a_token_that_never_arrives_warns_then_raises_without_freeing_the_slot():
    w = _writer(depth=1, wait_timeout_s=0.3, wait_warn_s=0.05)
    ring = w._ring
    i = ring.take(1, 1)
    token = _launch_lost(ring, i)
    t0 = time.perf_counter()
    with pytest.warns(triton_kernel.RingWaitWarning) as caught, pytest.raises(triton_kernel.RingStallError) as info:
        ring.take(1, 1)
    waited = time.perf_counter() - t0
    assert 0.3 <= waited < 5.0
    warning = str(caught[0].message)
    for part in ("slot 0 of the shared ring (depth 1)", "writer on cpu", "waited 0.", "captured into a CUDA graph"):
        assert part in warning, part
    msg = str(info.value)
    assert "slot 0 of the shared ring" in msg and f"token {token}" in msg and "never released" in msg
    assert ring.done[i] != token  # not force-freed: a later take waits (and fails) again
    with pytest.warns(triton_kernel.RingWaitWarning), pytest.raises(triton_kernel.RingStallError):
        ring.take(1, 1)


def test_a_late_token_is_waited_for_with_one_warning():
    w = _writer(depth=1, wait_timeout_s=5.0, wait_warn_s=0.05)
    ring = w._ring
    i = ring.take(1, 1)
    token = _launch_lost(ring, i)
    timer = threading.Timer(0.25, lambda: ring.done.__setitem__(i, token))  # the "kernel" finishes late
    timer.start()
    try:
        with pytest.warns(triton_kernel.RingWaitWarning) as caught:
            assert ring.take(1, 1) == i
    finally:
        timer.join()
    assert len([c for c in caught if issubclass(c.category, triton_kernel.RingWaitWarning)]) == 1
    assert w.waits == 1


def test_a_short_wait_is_silent():
    w = _writer(depth=1, wait_timeout_s=5.0, wait_warn_s=2.0)
    ring = w._ring
    i = ring.take(1, 1)
    token = _launch_lost(ring, i)
    timer = threading.Timer(0.02, lambda: ring.done.__setitem__(i, token))
    timer.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", triton_kernel.RingWaitWarning)
            ring.take(1, 1)
    finally:
        timer.join()


def test_apply_on_a_stuck_lent_slot_raises_instead_of_reusing_it():
    """Through a real apply: the arena's next slot is held by a launch that never completed."""
    w = _writer(depth=1, wait_timeout_s=0.2, wait_warn_s=0.05)
    lent = w.lend(np.int32)
    meta, values, _, _ = lent.acquire(4, 8)
    table = torch.zeros(2, 4, dtype=torch.int32)
    meta[0] = (0, 1, 0, 2, 0)
    values[:2] = (5, 6)
    w.apply([WriteBatch([table], meta[:1], values[:2], False, True, lent)])
    assert table.tolist() == [[0, 0, 0, 0], [5, 6, 0, 0]]
    _launch_lost(lent.ring, lent.current)  # as if a second launch on the slot had been captured
    with pytest.warns(triton_kernel.RingWaitWarning), pytest.raises(triton_kernel.RingStallError, match="lent"):
        lent.acquire(4, 8)


@pytest.mark.parametrize("num_values", [17, 300])  # the decode tile (values preloaded) and the general tile
def test_the_kernel_writes_nothing_outside_a_tables_current_shape(num_values):
    """Defence in depth: writes that run past the row, start past it, or name a row past the table (as a
    write staged for a larger table would) change no cell outside the table, here a view inside a larger
    canary buffer."""
    w = _writer(depth=2)
    buf = torch.full((6, 10), -1, dtype=torch.int32)
    table = buf[1:4, 2:6]  # 3 x 4 view, row stride 10: cells right of each row belong to the canary
    table.zero_()
    writes = [  # (row, start, length)
        (0, 2, 5),  # runs 3 cells past the row's end
        (1, 4, 2),  # starts at the row's end
        (2, 0, 4),  # fits exactly
        (3, 0, 4),  # the row after the last one
        (5, 1, 2),  # far past the last row
    ]
    meta, offset = [], 0
    lengths = [n for _, _, n in writes]
    lengths[-1] += num_values - sum(lengths)  # pad the last (out-of-table) write to reach the tile size
    for (row, start, _), n in zip(writes, lengths):
        meta.append((0, row, start, n, offset))
        offset += n
    values = np.arange(100, 100 + offset, dtype=np.int32)
    w.apply([WriteBatch([table], np.asarray(meta, np.int32), values, False, True)])
    expect = np.full((6, 10), -1, dtype=np.int64)
    expect[1:4, 2:6] = 0
    expect[1, 4:6] = [100, 101]  # write 0: only the 2 cells inside the row
    expect[3, 2:6] = [107, 108, 109, 110]  # write 2 (values after write 0's 5 and write 1's 2)
    np.testing.assert_array_equal(buf.numpy(), expect)
