"""On a real GPU: a table re-pointed with `tensor.data = other` (its version counter kept) is what the Triton plan
cannot follow (its descriptors hold the addresses of construction): the check refuses it at every call with
`check_addresses=True`, at the 64th call without, and at a real `torch.cuda.graph` capture whatever the setting,
before anything is launched or recorded; the writes land whole once the table points back."""

from __future__ import annotations

import pytest
import torch

from multiwrite import BlockTables, TableMovedError
from multiwrite.tables.block_tables import CHECK_ADDRESSES_ENV
from multiwrite.tables.mode import ADDRESS_CHECK_PERIOD

I32 = torch.int32


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(CHECK_ADDRESSES_ENV, raising=False)


def tables(device, backend_name, **kw) -> BlockTables:
    return BlockTables([16, 32], 4, [4, 2], device, [16, 16], backend=backend_name, max_num_batched_tokens=4, **kw)


def test_the_kernels_keep_the_old_memory_and_the_check_finds_it_at_the_64th_call_or_at_once(device, backend_name):
    off, on = tables(device, backend_name), tables(device, backend_name, check_addresses=True)
    saved = {}
    for bt in (off, on):
        bt.append_block_ids(0, ([1, 2], [3]), True)
        saved[id(bt)] = bt[0].tensor.data
        bt[0].tensor.data = torch.full((4, 4), 7, dtype=I32, device=device)
    with pytest.raises(TableMovedError, match=r"^BlockTables.apply_staged_writes: group 0 of a BlockTables"):
        on.apply_staged_writes()
    off.apply_staged_writes()  # call 1 of 64: not checked, and what it wrote went to the memory of construction
    torch.cuda.synchronize(device)
    assert saved[id(off)][0].tolist() == [1, 2, 0, 0] and (off[0].tensor == 7).all()
    assert not saved[id(on)].any() and on.num_staged_writes == 3
    for _ in range(ADDRESS_CHECK_PERIOD - 2):
        off.apply_staged_writes()
    with pytest.raises(TableMovedError, match="group 0 of a BlockTables was re-pointed"):
        off.apply_staged_writes()
    on[0].tensor.data = saved[id(on)]
    on.apply_staged_writes()
    torch.cuda.synchronize(device)
    assert on[0].tensor[0].tolist() == [1, 2, 0, 0] and on[1].tensor[0].tolist() == [6, 7, 0, 0]


def test_a_real_capture_refuses_a_re_pointed_output_before_recording_anything(device, backend_name):
    bt = tables(device, backend_name, cuda_graphs=True)
    idx = torch.zeros(1, dtype=I32, device=device)
    qsl = torch.tensor([0, 2], dtype=I32, device=device)
    pos = torch.tensor([0, 17], device=device)
    bt.prepare_inputs(idx, torch.zeros(2, dtype=I32, device=device), pos, 1, 4)  # the eager warm-up (compiles)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    saved = bt.slot_mappings.data
    bt.slot_mappings.data = torch.zeros_like(saved)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(TableMovedError, match=r"^BlockTables.prepare_inputs \(captured\): slot_mappings"):
        with torch.cuda.graph(g):
            bt.prepare_inputs(idx, qsl, pos, 1, 4)
    assert bt.graph.recordings == [] and bt.num_staged_writes == 3
    bt.slot_mappings.data = saved
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gathered, slots = bt.prepare_inputs(idx, qsl, pos, 1, 4)
    bt.commit_staged_writes()
    g.replay()
    torch.cuda.synchronize(device)
    assert [t.tolist() for t in gathered] == [[[1, 2, 0, 0]], [[6, 7, 0, 0]]]
    assert slots.tolist() == [[16, 2 * 16 + 1, -1, -1], [6 * 16, 7 * 16 + 1, -1, -1]]
