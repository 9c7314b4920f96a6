"""The Triton device-writes kernel through Triton's interpreter (CPU tables): its scan over several blocks
(flags published or missing), the scan state across launches (the epoch advancing when flags were used, the flags
cleared when it wraps), more sets than the launch's arguments hold, a simulated CUDA graph
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


@pytest.fixture
def small_scan_blocks(monkeypatch):
    """Scan blocks of 128 writes (1024 in use), so that the interpreter runs the flags' look-back on small sets."""
    from multiwrite.backends.triton import device_writes as runner_module

    monkeypatch.setattr(runner_module, "SCAN_W", 128)


def _long_set(n, seed, longest=20, may_overlap=False):
    """`n` writes of 0..`longest` values into distinct rows of a (n, longest + 5) table, flat int64 values."""
    rng = np.random.default_rng(seed)
    ln = rng.integers(0, longest + 1, n)
    if seed % 2:
        ln[rng.integers(0, n, n // 3)] = 0  # empty writes between
    st = rng.integers(0, 5, n)
    r = rng.permutation(n)
    values = torch.from_numpy(rng.integers(-(2**40), 2**40, int(ln.sum()) + 3))
    return DeviceWrites(torch.tensor(r), torch.tensor(st, dtype=torch.int32), torch.tensor(ln), values=values,
                        host=HostCopies(r, st, ln), may_overlap=may_overlap)  # fmt: skip


@pytest.mark.parametrize("n,seed,longest", [(130, 0, 20), (700, 1, 20), (1000, 2, 4), (385, 3, 0), (129, 4, 9)])
@pytest.mark.parametrize("same_rows", [False, True], ids=["parallel", "ordered"])
def test_sets_of_several_scan_blocks_match_the_reference(small_scan_blocks, n, seed, longest, same_rows):
    """Flat sets of more than one scan block: each tile's offset is the sum of every earlier write's length, whether
    the flags of the earlier blocks were published (prefixes, sums) or missing (summed by the tile that needs them):
    the interpreter's 8 programs take the tiles 0, 8, 16, ..., so most tiles find the blocks before them unsummed.
    Medium tiles (4 writes), short tiles (128), writes of 0 values between; int64 values into an int64 table; a
    second set after the first (its own blocks), into other rows (a parallel launch) or the same ones (an ordered
    launch: one program, in order, the later write wins)."""
    table = torch.full((2 * n, longest + 5), -1, dtype=torch.int64)
    first, second = _long_set(n, seed, longest, None), _long_set(n, seed + 10, longest)
    rows = torch.tensor(np.random.default_rng(seed).permutation(n)) + (0 if same_rows else n)
    second = DeviceWrites(rows, second.starts, second.lengths, values=second.values,
                          host=HostCopies(rows.numpy(), *second.host_arrays[1:]), may_overlap=None)  # fmt: skip
    for _ in range(2):  # the second call reads the flags the first left (an earlier epoch)
        table.fill_(-1)
        apply_device_writes(table, [first, second], backend="triton-cuda")
        expected = apply_device_writes_reference(np.full(tuple(table.shape), -1, np.int64), [first, second])
        np.testing.assert_array_equal(table.numpy(), expected)


def test_the_epoch_advances_only_when_flags_were_used_and_its_wrap_clears_them(small_scan_blocks):
    from multiwrite.backends.triton.kernels.device_writes import EPOCH_MAX, STATE_WORDS

    runner = _runner()
    table = torch.zeros((300, 25), dtype=torch.int64)
    small, big = _long_set(100, 5), _long_set(300, 6)
    epochs = [int(s[2]) for s in runner.states]
    apply_device_writes(table, small, backend="triton-cuda")  # one scan block: no flags, no slot, no epoch
    assert [int(s[2]) for s in runner.states] == epochs
    for state in runner.states:
        state[2] = EPOCH_MAX.value
        state[STATE_WORDS.value :] = (3 << 40) | 5  # the prefixes of epoch 1 from long ago: must not survive the wrap
    for _ in runner.states:
        table.zero_()
        apply_device_writes(table, big, backend="triton-cuda")
        np.testing.assert_array_equal(table.numpy(), apply_device_writes_reference(np.zeros((300, 25), np.int64),
                                                                                   [big]))  # fmt: skip
    assert [int(s[2]) for s in runner.states] == [1] * len(runner.states)
    assert all(not s[STATE_WORDS.value :].any() for s in runner.states), "the wrap did not clear the flags"
    table.zero_()
    apply_device_writes(table, big, backend="triton-cuda")  # epoch 1 again: the flags of epoch 1 before are gone
    np.testing.assert_array_equal(table.numpy(), apply_device_writes_reference(np.zeros((300, 25), np.int64), [big]))
    assert sorted(int(s[2]) for s in runner.states)[-1] == 2


@pytest.mark.parametrize("host", [True, False], ids=["host-copies", "device-only"])
def test_one_per_row_tensor_travels_in_the_descriptor_and_takes_no_slot(host):
    """SGLang's extend of one request: a per-row set of one tensor (its address inline when its size was checked on
    the host) and a flat set: nothing of the launch is in host memory, so no staging slot is taken; without host
    copies its address (and size) go through the slot as for any number of tensors."""
    runner = _runner()
    table = torch.full((4, 10), -1, dtype=torch.int32)
    prefix = torch.arange(100, 106)
    r, st, ln = np.array([2]), np.array([0]), np.array([6])
    copies = (lambda *a: HostCopies(*a)) if host else (lambda *a: None)
    sets = [DeviceWrites(torch.tensor(r), torch.tensor(st), torch.tensor(ln), sources=[prefix], host=copies(r, st, ln),
                         may_overlap=False),
            DeviceWrites(torch.tensor(r), torch.tensor(ln), torch.tensor([3]), values=torch.tensor([7, 8, 9]),
                         host=copies(r, ln, np.array([3])), may_overlap=False)]  # fmt: skip
    slot, launches = runner.ring.next, runner.launcher.launches
    apply_device_writes(table, sets, backend="triton-cuda")
    assert table[2].tolist() == [100, 101, 102, 103, 104, 105, 7, 8, 9, -1]
    assert (table[[0, 1, 3]] == -1).all()
    assert runner.launcher.launches == launches + 1
    assert (runner.ring.next == slot) == host, "a slot taken (or not) against the launch's host memory"


def _per_row_set(seed):
    rng = np.random.default_rng(seed)
    r, ln = rng.permutation(6)[:3], rng.integers(1, 8, 3)
    st = np.zeros(3, np.int64)
    src = [torch.from_numpy(rng.integers(0, 99, int(x))) for x in ln]
    return DeviceWrites(torch.tensor(r), torch.tensor(st), torch.tensor(ln), sources=src, may_overlap=False)


@pytest.mark.parametrize("failure", ["launch", "copy", "token"])
def test_a_failed_launch_or_copy_leaves_every_slot_free(monkeypatch, failure):
    """The slot of a call whose address table goes through the mirror is released by the copy, not the kernel: a
    launch that raises after the copy, a copy that raises before it is queued, or an interrupt just as the slot's
    token advanced (found by a review: the slot stayed taken) leaves the slot free, the table as it was, and the
    ring's other slots usable (every slot is taken again once afterwards; a slot left taken would stall there,
    RingStallError)."""
    from multiwrite.staging.arena import Lease

    runner = _runner()
    table = torch.full((6, 10), -1, dtype=torch.int32)
    target = {"launch": (runner.launcher, "launch"), "copy": (torch.Tensor, "copy_"),
              "token": (Lease, "next_token")}[failure]  # fmt: skip
    real = getattr(*target)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            if failure == "token":
                real(*args, **kwargs)  # the token advances, then the interrupt arrives
            raise RuntimeError("launch refused") if failure == "launch" else KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(*target, refuse)
    slot = runner.ring.next
    with pytest.raises(RuntimeError if failure == "launch" else KeyboardInterrupt):
        apply_device_writes(table, _per_row_set(1), backend="triton-cuda")
    monkeypatch.setattr(*target, real)
    assert (table == -1).all()
    assert runner.ring.leases[slot].released()
    for k in range(runner.ring.depth + 1):
        w = _per_row_set(k)
        table.fill_(-1)
        apply_device_writes(table, w, backend="triton-cuda")
        expected = apply_device_writes_reference(np.full((6, 10), -1, np.int32), [w])
        np.testing.assert_array_equal(table.numpy(), expected, err_msg=f"call {k}")


def test_more_sets_than_the_arguments_hold_read_their_descriptors_from_memory():
    """Three sets (descriptors in the staging slot, not the launch's arguments), of every source kind."""
    from multiwrite.backends.triton.kernels.device_writes import ARG_SETS_MAX

    table = torch.full((60, 12), -1, dtype=torch.int32)
    rng = np.random.default_rng(7)
    rows = rng.permutation(60)
    sets = []
    for k in range(ARG_SETS_MAX + 1):
        r = rows[20 * k : 20 * k + 20]
        ln = rng.integers(0, 12, 20)
        st = np.zeros(20, np.int64)
        if k == 1:
            src = [torch.from_numpy(rng.integers(0, 99, int(x))) for x in ln]
            sets.append(DeviceWrites(torch.tensor(r), torch.tensor(st), torch.tensor(ln), sources=src,
                                     host=HostCopies(r, st, ln)))  # fmt: skip
        else:
            v = torch.from_numpy(rng.integers(0, 99, int(ln.sum())).astype(np.int32))
            sets.append(DeviceWrites(torch.tensor(r), torch.tensor(st), torch.tensor(ln), values=v,
                                     host=HostCopies(r, st, ln)))  # fmt: skip
    apply_device_writes(table, sets, backend="triton-cuda")
    expected = apply_device_writes_reference(np.full((60, 12), -1, np.int32), sets)
    np.testing.assert_array_equal(table.numpy(), expected)


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
