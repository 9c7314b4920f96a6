"""Drive two `BlockTables`-like objects through one `engine.Scenario` in lockstep and compare them at every call.

What is compared is what vLLM 0.33 defines (and what its runner reads):

- the block counts on the host after every append;
- the counts on the device and the first `num_blocks` cells of every row of the persistent tables after the apply
  (read at once on every third step, otherwise only after the step's gather and slot mappings, so that an
  implementation may land the apply in their launch);
- of a gather, the first `num_blocks` cells of each batch row, and the rows it clears, in full (`num_reqs` up to the
  larger of `num_reqs_padded` and the previous row count; only up to `num_reqs_padded` with `out=`);
- the whole slot-mapping buffer (persistent or the caller's), the dummy tables and slots;
- that every returned view lies at its persistent (or given) address, the same one for the whole scenario.

Cells past a row's `num_blocks` are not compared: vLLM leaves them stale.

`subject` may also be given the scenario's over-capacity writes (`refusals=True`): each must raise a `RuntimeError`
naming the request, the group and the capacity, and change nothing; `reference` never sees them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.vllm.engine import Scenario

PAD = -1
_GARBAGE = 0x5A5A5A  # what a caller's `out=` buffers hold before a call


def host(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


@dataclass
class Where:
    seed: int
    step: int = -1
    call: str = ""

    def __str__(self) -> str:
        return f"scenario {self.seed}, step {self.step}, {self.call}"


def _equal(a: Any, b: Any, where: Where, what: str) -> None:
    np.testing.assert_array_equal(host(a), host(b), err_msg=f"{where}: {what} differ (subject vs reference)")


def _zero(t: torch.Tensor, where: Where, what: str) -> None:
    assert not host(t).any(), f"{where}: {what} not zeroed: {host(t)}"


def run_lockstep(
    scenario: Scenario,
    subject: Any,
    reference: Any,
    device: torch.device,
    *,
    refusals: bool = False,
    idx_dtype: torch.dtype = torch.int64,
) -> int:
    """Run `scenario` on both objects (built from `scenario.config`), asserting at every call; returns the number
    of calls compared."""
    cfg = scenario.config
    G = cfg.groups
    # the runner's dtypes (int32 query_start_loc and num_computed_tokens, int64 positions) most of the time
    pick = random.Random(scenario.seed)
    qsl_dtype, nct_dtype = (pick.choice([torch.int32, torch.int32, torch.int64]) for _ in range(2))
    pos_dtype = pick.choice([torch.int64, torch.int64, torch.int32])
    where = Where(scenario.seed)
    both = (subject, reference)
    calls = 0
    persistent = [([t.data_ptr() for t in x.input_block_tables], x.slot_mappings.data_ptr()) for x in both]
    dirty = 0  # vLLM's row count of the last gather into the persistent tables or dummy tables

    def counts(x: Any) -> np.ndarray:
        return host(x.num_blocks.np).astype(np.int64).reshape(G, cfg.max_num_reqs)

    def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    for s, step in enumerate(scenario.steps):
        where.step = s
        if step.redirect:
            for x in both:
                x.redirect_writes_to_null_block = True
        for row, ids, overwrite in step.appends:
            where.call = f"append_block_ids({row}, {ids}, overwrite={overwrite})"
            for x in both:
                x.append_block_ids(row, tuple(list(i) for i in ids), overwrite)
            _equal(counts(subject), counts(reference), where, "num_blocks.np")
            calls += 1
        if refusals:
            for row, ids, overwrite, bad in step.rejected:
                where.call = f"append_block_ids({row}, {ids}, overwrite={overwrite}) (past group {bad}'s row)"
                before = counts(subject).copy()
                try:
                    subject.append_block_ids(row, tuple(list(i) for i in ids), overwrite)
                except RuntimeError as e:
                    msg = str(e)
                    width = cfg.max_num_blocks_per_group[bad]
                    for word, value in (("request", row), ("group", bad), ("", width)):
                        assert word in msg and re.search(rf"\b{value}\b", msg), f"{where}: {msg!r} lacks {value}"
                else:
                    raise AssertionError(f"{where}: accepted")
                _equal(counts(subject), before, where, "num_blocks.np after a refused write")
                calls += 1
        where.call = "apply_staged_writes()"
        for x in both:
            x.apply_staged_writes()
            if step.redirect:
                x.redirect_writes_to_null_block = False
        calls += 1
        n_ref = counts(reference)

        def applied_state(n_ref: np.ndarray = n_ref) -> None:
            if G:
                _equal(host(subject.num_blocks.gpu), host(reference.num_blocks.gpu), where, "num_blocks.gpu")
            for g in range(G):
                mask = np.arange(cfg.max_num_blocks_per_group[g])[None, :] < n_ref[g][:, None]
                tables = [host(x.block_tables[g].gpu) * mask for x in both]
                _equal(tables[0], tables[1], where, f"block_tables[{g}].gpu (first num_blocks cells of each row)")

        # Most steps read nothing of the subject between the apply and the gather (an apply may land in the gather's
        # launch); every third step reads the applied state at once (which must then be in place).
        if s % 3 == 2:
            applied_state()

        if step.dummy is not None:
            n, t = step.dummy
            where.call = f"get_dummy_block_tables({n}), get_dummy_slot_mappings({t})"
            for x, (ptrs, slot_ptr) in zip(both, persistent):
                got = x.get_dummy_block_tables(n)
                assert len(got) == G, f"{where}: {len(got)} tables"
                for g, view in enumerate(got):
                    assert tuple(view.shape) == (n, cfg.max_num_blocks_per_group[g]), f"{where}: {view.shape}"
                    assert n == 0 or view.data_ptr() == ptrs[g], f"{where}: dummy table {g} not at its address"
                    _zero(x.input_block_tables[g][: max(n, dirty)], where, f"dummy rows of group {g}")
                slots = x.get_dummy_slot_mappings(t)
                assert tuple(slots.shape) == (G, t), f"{where}: dummy slots {tuple(slots.shape)}"
                assert (host(x.slot_mappings) == PAD).all(), f"{where}: slot_mappings not all PAD"
                assert G == 0 or t == 0 or slots.data_ptr() == slot_ptr, f"{where}: dummy slots moved"
            dirty = n
            calls += 2

        if step.gather is not None:
            gat = step.gather
            where.call = f"gather_block_tables({gat})"
            idx = tensor(gat.idx_mapping, idx_dtype)
            nct = None if gat.num_computed_tokens is None else tensor(gat.num_computed_tokens, nct_dtype)
            results = []
            for x, (ptrs, _) in zip(both, persistent):
                kwargs: dict[str, Any] = {"num_computed_tokens": nct}
                outs = None
                if gat.out_rows is not None:
                    outs = tuple(
                        torch.full((gat.out_rows, w), _GARBAGE, dtype=torch.int32, device=device)
                        for w in cfg.max_num_blocks_per_group
                    )
                    kwargs["out"] = outs
                    kwargs["out_ptrs"] = torch.tensor([o.data_ptr() for o in outs], dtype=torch.uint64, device=device)
                got = x.gather_block_tables(idx, gat.num_reqs_padded, **kwargs)
                assert isinstance(got, tuple) and len(got) == G, f"{where}: returned {type(got)} of {len(got)}"
                targets = outs if outs is not None else x.input_block_tables
                for g, view in enumerate(got):
                    w = cfg.max_num_blocks_per_group[g]
                    assert tuple(view.shape) == (gat.num_reqs_padded, w), f"{where}: group {g} {tuple(view.shape)}"
                    assert view.dtype == torch.int32, f"{where}: group {g} {view.dtype}"
                    assert gat.num_reqs_padded == 0 or view.data_ptr() == targets[g].data_ptr(), (
                        f"{where}: group {g}'s view is not at its table's address"
                    )
                    if outs is None:
                        assert targets[g].data_ptr() == ptrs[g], f"{where}: input_block_tables[{g}] moved"
                    last = gat.num_reqs_padded if outs is not None else max(gat.num_reqs_padded, dirty)
                    _zero(targets[g][len(gat.idx_mapping) : last], where, f"cleared rows of group {g}")
                results.append([host(t) for t in targets])
            if gat.out_rows is None:
                dirty = len(gat.idx_mapping)
            for g in range(G):
                for b, r in enumerate(gat.idx_mapping):
                    n = n_ref[g, r]
                    _equal(results[0][g][b, :n], results[1][g][b, :n], where, f"group {g} batch row {b} (row {r})")
            calls += 1

        if step.slots is not None:
            sl = step.slots
            where.call = f"compute_slot_mappings({sl})"
            buffers = []
            for x, (_, slot_ptr) in zip(both, persistent):
                kwargs = {}
                buf = x.slot_mappings
                if sl.out_tokens is not None:
                    buf = torch.full((G, sl.out_tokens), _GARBAGE, dtype=torch.int64, device=device)
                    kwargs["out"] = buf
                got = x.compute_slot_mappings(
                    tensor(sl.idx_mapping, idx_dtype),
                    tensor(sl.query_start_loc, qsl_dtype),
                    tensor(sl.positions, pos_dtype),
                    sl.num_tokens_padded,
                    **kwargs,
                )
                assert tuple(got.shape) == (G, sl.num_tokens_padded), f"{where}: returned {tuple(got.shape)}"
                assert got.dtype == torch.int64, f"{where}: returned {got.dtype}"
                assert G == 0 or sl.num_tokens_padded == 0 or got.data_ptr() == buf.data_ptr(), f"{where}: moved"
                if sl.out_tokens is None:
                    assert buf.data_ptr() == slot_ptr, f"{where}: slot_mappings moved"
                buffers.append(host(buf))
            _equal(buffers[0], buffers[1], where, "slot-mapping buffers (whole)")
            calls += 1
        where.call = "after the step"
        applied_state()
    return calls
