"""The Triton device-writes kernel through Triton's interpreter (CPU tables): its scan state across launches (the
ticket and count back to 0, the epoch advancing, the flags cleared when the epoch wraps), a simulated CUDA graph
capture replayed with changed device inputs at the captured addresses, and a torch backend refusing a capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import DeviceWrites, GraphCaptureError, HostCopies, apply_device_writes, select_backend
from multiwrite.capture import simulated_capture
from multiwrite.reference import apply_device_writes_reference

CPU = torch.device("cpu")


def _runner():
    from multiwrite.backends.triton.backend import CUDA

    return CUDA.device_writes_runner(CPU)


def _set(n=40, seed=0, host=True):
    rng = np.random.default_rng(seed)
    r = rng.choice(50, n, replace=False)
    ln = rng.integers(0, 9, n)
    st = rng.integers(0, 9, n)
    w = DeviceWrites(torch.tensor(r), torch.tensor(st), torch.tensor(ln), values=torch.arange(int(ln.sum())),
                     host=HostCopies(r, st, ln) if host else None, may_overlap=False)  # fmt: skip
    return w


def test_the_scan_state_is_left_ready_and_the_epoch_wraps_clearing_the_flags():
    from multiwrite.backends.triton.kernels.device_writes import EPOCH_MAX, STATE_WORDS

    runner = _runner()
    table = torch.zeros((50, 17), dtype=torch.int32)
    w = _set()
    apply_device_writes(table, w, backend="triton-cuda")
    epochs = [int(s[2]) for s in runner.states]
    assert all(int(s[0]) == 0 and int(s[1]) == 0 for s in runner.states), "ticket or count left non-zero"
    for state in runner.states:
        state[2] = EPOCH_MAX.value
        state[STATE_WORDS.value :] = (3 << 40) | 5  # flags of epoch 1 from long ago: they must not survive the wrap
    for _ in runner.states:
        table.zero_()
        apply_device_writes(table, w, backend="triton-cuda")
        np.testing.assert_array_equal(table.numpy(), apply_device_writes_reference(np.zeros((50, 17), np.int32), [w]))
    assert [int(s[2]) for s in runner.states] == [1] * len(runner.states) and min(epochs) >= 1
    assert all(not s[STATE_WORDS.value :].any() for s in runner.states), "the wrap did not clear the flags"
    apply_device_writes(table, w, backend="triton-cuda")
    assert sorted(int(s[2]) for s in runner.states)[-1] == 2


def test_a_captured_launch_replays_with_the_device_inputs_of_each_replay():
    """Captured once (simulated capture: the launch is recorded, not run), replayed after the rows, lengths and values
    changed in place: each replay writes what the device inputs hold then; eager calls in between (which reuse the
    ring's slots) do not disturb the captured descriptors."""
    table = torch.zeros((8, 6), dtype=torch.int64)
    rows, starts, lengths = torch.tensor([1, 4, 6]), torch.tensor([0, 2, 1]), torch.tensor([2, 3, 1])
    values = torch.arange(100, 106)
    prefix_a, prefix_b = torch.tensor([7, 7, 7], dtype=torch.int32), torch.tensor([8, 8], dtype=torch.int32)
    flat = DeviceWrites(rows, starts, lengths, values=values, may_overlap=False)
    from multiwrite import addresses_of

    addrs = addresses_of([prefix_a, prefix_b], CPU)
    per_row = DeviceWrites(torch.tensor([0, 7]), torch.tensor([0, 3]), torch.tensor([3, 2]), sources=addrs,
                           source_dtype=torch.int32, may_overlap=False)  # fmt: skip
    with simulated_capture() as graph:
        apply_device_writes(table, [flat, per_row], backend="triton-cuda")
    assert not table.any() and len(graph.launches) == 1
    for step in range(3):
        rows.copy_(torch.tensor([[1, 4, 6], [2, 3, 5], [6, 1, 4]][step]))
        lengths.copy_(torch.tensor([[2, 3, 1], [0, 6, 4], [1, 1, 1]][step]))
        starts.copy_(torch.tensor([[0, 2, 1], [0, 0, 2], [5, 0, 3]][step]))
        values.copy_(torch.arange(6) + 10 * step)
        table.zero_()
        for i in range(_runner().ring.depth + 1):  # every slot of the ring rewritten in between
            apply_device_writes(torch.zeros((50, 17), dtype=torch.int64), _set(3, i, host=False), backend="triton-cuda")
        graph.replay()
        expected = apply_device_writes_reference(np.zeros((8, 6), np.int64), [flat, per_row])
        np.testing.assert_array_equal(table.numpy(), expected, err_msg=f"replay {step}")
        assert table[0, :3].tolist() == [7, 7, 7] and table[7, 3:5].tolist() == [8, 8]


@pytest.mark.parametrize("name", ["torch-generic", "torch-cpu", "compiled-cpu"])
def test_the_torch_backends_refuse_a_capture_they_cannot_replay(name):
    if name == "compiled-cpu" and "compiled-cpu" != select_backend(CPU, name).NAME:
        pytest.skip("compiled-cpu unavailable")
    table = torch.zeros((2, 2), dtype=torch.int32)
    w = DeviceWrites(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), values=torch.tensor([3]))
    with simulated_capture(), pytest.raises(GraphCaptureError, match="cannot be captured"):
        apply_device_writes(table, w, backend=name)
    assert not table.any()
