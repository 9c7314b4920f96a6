"""A capture checks the addresses of graph-mode tables whatever the setting (docs/lifecycle.md): a CUDA graph keeps
the addresses it recorded for good, so a table or output re-pointed with `tensor.data = other` is refused at the
capture (`TableMovedError`), before anything is recorded, also when the countdown of the preamble is far from its
check. Triton's interpreter on CPU, captures simulated."""

from __future__ import annotations

import re

import pytest
import torch

from multiwrite import BlockTables, TableMovedError
from multiwrite.capture import simulated_capture
from multiwrite.tables.block_tables import CHECK_ADDRESSES_ENV
from tests.support.tables import host

I32 = torch.int32
#: persistent inputs (a replay reads them as they are then): one request row 0 with no tokens at the capture, its
#: two tokens (positions 0 and 17) written in before the replay
IDX, QSL, POS = torch.tensor([0], dtype=I32), torch.tensor([0, 0], dtype=I32), torch.tensor([0, 17])

#: each call a capture records, the name its refusal gives it, and the tensor re-pointed
CALLS = {
    "apply_staged_writes": (lambda bt: bt.apply_staged_writes(), "BlockTables.apply_staged_writes (captured)",
                            lambda bt: bt[1].tensor, "group 1"),
    "prepare_inputs": (lambda bt: bt.prepare_inputs(IDX, QSL, POS, 1, 4), "BlockTables.prepare_inputs (captured)",
                       lambda bt: bt.num_blocks_device, "num_blocks"),
    "gather_block_tables": (lambda bt: bt.gather_block_tables(IDX, 1), "a captured gather or slot-mapping call",
                            lambda bt: bt.input_block_tables[0], r"input_block_tables\[0\]"),
    "compute_slot_mappings": (lambda bt: bt.compute_slot_mappings(IDX, QSL, POS, 4),
                              "a captured gather or slot-mapping call", lambda bt: bt.slot_mappings, "slot_mappings"),
}  # fmt: skip


@pytest.mark.parametrize("call", list(CALLS))
def test_a_capture_refuses_a_re_pointed_tensor_before_recording_anything(monkeypatch, call):
    monkeypatch.delenv(CHECK_ADDRESSES_ENV, raising=False)
    QSL.zero_()
    bt = BlockTables([16, 32], 4, [4, 2], "cpu", [16, 16], backend="triton-cuda", cuda_graphs=True,
                     max_num_batched_tokens=4)  # fmt: skip
    assert not bt.checks_addresses
    bt.append_block_ids(0, ([1, 2], [3]), True)
    fn, name, get, what = CALLS[call]
    t = get(bt)
    saved = t.data
    t.data = torch.full_like(t, 7)
    with simulated_capture() as graph:
        with pytest.raises(TableMovedError, match=rf"^{re.escape(name)}: {what} of a BlockTables was re-pointed to "
                                                  "other memory"):  # fmt: skip
            fn(bt)
    assert graph.launches == [] and bt.graph.recordings == [] and bt.num_staged_writes == 3
    t.data = saved
    with simulated_capture() as graph:
        out = fn(bt)
    assert graph.launches
    if call in ("gather_block_tables", "compute_slot_mappings"):  # (the stage alone: the apply is eager)
        bt.apply_staged_writes()
    bt.commit_staged_writes()
    QSL.copy_(torch.tensor([0, 2], dtype=I32))
    graph.replay()
    assert bt.num_staged_writes == 0
    assert host(bt[0].tensor)[0].tolist() == [1, 2, 0, 0] and host(bt[1].tensor)[0].tolist() == [6, 7, 0, 0]
    if call == "gather_block_tables":
        assert [host(g).tolist() for g in out] == [[[1, 2, 0, 0]], [[6, 7, 0, 0]]]
    if call == "compute_slot_mappings":  # token 0 at position 0, token 1 at 17: kernel block column 1
        assert host(out).tolist() == [[16, 2 * 16 + 1, -1, -1], [6 * 16, 7 * 16 + 1, -1, -1]]
