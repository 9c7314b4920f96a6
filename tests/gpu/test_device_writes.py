"""Device-sourced writes on a real GPU (`multiwrite.apply_device_writes` on the Triton backend): random sets of every
source kind against the reference, the scan across many tiles with programs running concurrently (the look-back's
waits), a launch captured in a CUDA graph and replayed with changed device inputs at the captured addresses (no host
sync), faults recorded on the device, and rows past 2^31 elements of a large table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import DeviceWriteFaults, DeviceWrites, StagedWriteError, addresses_of, apply_device_writes
from multiwrite.testing.device_writes import draw_sets


@pytest.mark.parametrize("kind", ["values", "tensors", "addresses"])
def test_random_sets_match_the_reference(device, backend_name, kind):
    rng = np.random.default_rng(3)
    for bs in (1, 33, 1024, 4096):
        for host in (True, False):
            table = torch.full((bs + 1, 300), -1, dtype=torch.int32, device=device)
            drawn = draw_sets(rng, (bs + 1, 300), device, bs=bs, kind=kind, host=host, sets=2)
            expected = drawn.reference(table)
            apply_device_writes(table, drawn.sets, backend=backend_name)
            np.testing.assert_array_equal(table.cpu().numpy(), expected, err_msg=f"bs {bs} host {host}")


def test_the_scan_under_concurrent_programs(device, backend_name):
    """16384 writes with nothing known on the host, lengths up to 300: many tiles publish and look back at once."""
    rng = np.random.default_rng(8)
    for rep in range(20):
        table = torch.zeros((16384, 300), dtype=torch.int32, device=device)
        drawn = draw_sets(rng, (16384, 300), device, bs=16384, host=False)
        w = drawn.sets[0]
        drawn.sets[0] = DeviceWrites(w.rows, w.starts, w.lengths, values=w.values, may_overlap=False)
        expected = drawn.reference(table)
        apply_device_writes(table, drawn.sets, backend=backend_name)
        np.testing.assert_array_equal(table.cpu().numpy(), expected, err_msg=f"repetition {rep}")


def test_captured_in_a_cuda_graph_and_replayed_with_new_inputs(device, backend_name):
    """SGLang's decode write (`req_to_token[req_pool_indices, seq_lens] = out_cache_loc`) captured once at bs 64 and
    replayed with new rows, positions and locations copied into the captured tensors; row 0 is the padding row."""
    bs, width = 64, 4096
    table = torch.zeros((bs + 1, width), dtype=torch.int32, device=device)
    rows = torch.zeros(bs, dtype=torch.int64, device=device)
    locs = torch.zeros(bs, dtype=torch.int64, device=device)
    ones = torch.ones(bs, dtype=torch.int64, device=device)
    out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=device)
    faults = DeviceWriteFaults(device)
    w = DeviceWrites(rows, locs, ones, values=out_cache_loc, may_overlap=False, max_length=1)
    apply_device_writes(table, w, backend=backend_name, faults=faults)  # compiles before the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_device_writes(table, w, backend=backend_name, faults=faults)
    rng = np.random.default_rng(1)
    expected = table.cpu().numpy()
    for _ in range(50):
        r = rng.permutation(np.arange(1, bs + 1))
        p = rng.integers(0, width, bs)
        v = rng.integers(0, 2**31 - 1, bs)
        rows.copy_(torch.from_numpy(r), non_blocking=False)
        locs.copy_(torch.from_numpy(p))
        out_cache_loc.copy_(torch.from_numpy(v))
        graph.replay()
        expected[r, p] = v
    np.testing.assert_array_equal(table.cpu().numpy(), expected)
    rows[3] = bs + 7  # a row outside the pool: skipped, recorded
    graph.replay()
    with pytest.raises(StagedWriteError, match="request 3"):
        faults.check()


def test_rows_past_2_to_the_31_elements(device, backend_name):
    """An int32 table of 2100 rows of 2^20 + 64 cells (8.8 GB): row 2047 starts past 2^31 elements."""
    cols = (1 << 20) + 64
    table = torch.zeros((2100, cols), dtype=torch.int32, device=device)
    prefix = torch.arange(5, dtype=torch.int64, device=device) + 40
    rows = torch.tensor([2099, 2048, 1], device=device)
    w = DeviceWrites(rows, torch.tensor([cols - 3, 0, 2], device=device), torch.tensor([3, 2, 1], device=device),
                     values=torch.tensor([1, 2, 3, 4, 5, 6], device=device))  # fmt: skip
    p = DeviceWrites(rows[:1], torch.tensor([10], device=device), torch.tensor([5], device=device),
                     sources=addresses_of([prefix], device), source_dtype=torch.int64)  # fmt: skip
    apply_device_writes(table, [w, p], backend=backend_name)
    assert table[2099, cols - 3 :].tolist() == [1, 2, 3] and table[2048, :2].tolist() == [4, 5]
    assert table[1, 2].item() == 6 and table[2099, 10:15].tolist() == [40, 41, 42, 43, 44]
    assert int(table.sum()) == 21 + 210
    del table


def test_overlapping_writes_land_in_order(device, backend_name):
    rng = np.random.default_rng(4)
    table = torch.zeros((3, 64), dtype=torch.int64, device=device)
    drawn = draw_sets(rng, (3, 64), device, bs=500, overlap=True, host=False, sets=2)
    expected = drawn.reference(table)
    apply_device_writes(table, drawn.sets, backend=backend_name)
    np.testing.assert_array_equal(table.cpu().numpy(), expected)


@pytest.mark.parametrize("on_side_stream", [False, True])
def test_address_tables_copied_behind_a_busy_stream(device, backend_name, on_side_stream):
    """Per-row sources whose address tables go to device memory on the side stream (`SlotMirror`): three times the
    ring's depth of calls queued behind a 20 ms spin, each with tensors and rows of its own, so that the slots (and
    their device copies) are reused while earlier kernels are still queued. One device buffer shared by the slots,
    or a launch not ordered after its copy, lands another call's prefixes. Every fourth call is a scanned flat set
    larger than the last (its slot's scan state and buffer grow while earlier launches on the slot are queued)."""
    rng = np.random.default_rng(11)
    calls, width = 24, 512
    table = torch.full((calls * 4 + 1, width), -1, dtype=torch.int32, device=device)
    expected = table.cpu().numpy()
    sets = []
    for c in range(calls):
        rows = np.arange(c * 4 + 1, c * 4 + 5)
        lengths = rng.integers(0, width, 4)
        prefixes = [rng.integers(0, 2**31 - 1, int(n)) for n in lengths]
        for r, p in zip(rows, prefixes):
            expected[r, : p.size] = p
        sets.append(DeviceWrites(torch.from_numpy(rows).to(device), torch.zeros(4, dtype=torch.int64, device=device),
                                 torch.from_numpy(lengths).to(device), sources=[torch.from_numpy(p).to(device) for p
                                 in prefixes], source_dtype=torch.int64, may_overlap=False))  # fmt: skip
    scanned = []
    for c in range(3, calls, 4):
        n = 1100 + 700 * c
        flat = torch.zeros((n, 300), dtype=torch.int32, device=device)
        drawn = draw_sets(rng, (n, 300), device, bs=n, host=False)
        w = drawn.sets[0]
        drawn.sets[0] = DeviceWrites(w.rows, w.starts, w.lengths, values=w.values, may_overlap=False)
        scanned.append((c, flat, drawn.sets, drawn.reference(flat)))
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device) if on_side_stream else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # about 20 ms of queued work before the calls
        for c, w in enumerate(sets):
            apply_device_writes(table, w, backend=backend_name)
            for _, flat, flat_sets, _ in (s for s in scanned if s[0] == c):
                apply_device_writes(flat, flat_sets, backend=backend_name)
    stream.synchronize()
    np.testing.assert_array_equal(table.cpu().numpy(), expected)
    for c, flat, _, want in scanned:
        np.testing.assert_array_equal(flat.cpu().numpy(), want, err_msg=f"the scanned set after call {c}")


def test_a_new_address_buffer_is_not_a_block_still_used_by_queued_work(device, backend_name):
    """A slot's device buffer, allocated when it grows, must not be a block freed on the current stream while work
    queued there still writes it: a temporary of the 'previous forward' is filled with a decoy address behind a
    50 ms spin and freed on the host, then a call whose address table grows its slot's buffer to that size. Found
    on the H200 by a review of 7fd01c7: the buffer took the freed block and the kernel wrote the decoy's values."""
    from multiwrite.backends.triton.backend import CUDA

    runner = CUDA.device_writes_runner(device)
    warm = DeviceWrites(torch.tensor([1], device=device), torch.tensor([0], device=device),
                        torch.tensor([2], device=device), sources=[torch.arange(2, device=device)], may_overlap=False)
    apply_device_writes(torch.zeros((2, 4), dtype=torch.int32, device=device), warm, backend=backend_name)
    decoy = torch.full((1 << 16,), 4242, dtype=torch.int32, device=device)
    for k in range(4):
        slot = runner.ring.next
        buf = runner.mirror.buffers[slot]
        cap = 64 if buf is None else buf.shape[0]
        n = cap  # 2n words of addresses and sizes: the buffer grows to max(2n + 1, 2 cap)
        size = max(2 * n + 1, 64, 2 * cap)
        table = torch.full((n, 8), -1, dtype=torch.int32, device=device)
        sources = [torch.arange(8, device=device) + 100 * i for i in range(n)]
        w = DeviceWrites(torch.arange(n, device=device), torch.zeros(n, dtype=torch.int64, device=device),
                         torch.full((n,), 8, device=device), sources=sources, source_dtype=torch.int64,
                         may_overlap=False)  # fmt: skip
        torch.cuda.synchronize(device)
        temporary = torch.empty(size, dtype=torch.int64, device=device)
        torch.cuda._sleep(50_000_000)  # the previous forward, still queued
        temporary.fill_(decoy.data_ptr())  # its temporary, written behind the spin and freed on the host
        del temporary
        apply_device_writes(table, w, backend=backend_name)
        torch.cuda.synchronize(device)
        expected = np.arange(8)[None, :] + 100 * np.arange(n)[:, None]
        np.testing.assert_array_equal(table.cpu().numpy(), expected, err_msg=f"call {k}, slot {slot}")
