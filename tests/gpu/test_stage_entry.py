"""The compiled stage entry on a real GPU (`multiwrite.stage.entry`): an engine's eager gather and slot-mapping calls
(device inputs, nothing applied) and its `prepare_inputs` with staged writes are taken by the entry, not the Python
path, and give what a twin whose every call takes the Python path gives (`check_addresses=True`: the address check is
due at every call, so the entry never takes one): on the current stream, on a side stream behind a busy one, and
captured into a CUDA graph replayed with new inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from tests.gpu.helpers import busy

BLOCK_SIZES, KERNEL_BLOCK_SIZES, WIDTHS = [16, 32, 16], [16, 16, 8], [64, 32, 64]
REQS, TOKENS = 64, 256


def _pair(device):
    made = [BlockTables(BLOCK_SIZES, REQS, WIDTHS, device, KERNEL_BLOCK_SIZES, max_num_batched_tokens=TOKENS,
                        sliding_window_reach=[0, 0, 100], check_addresses=check)  # fmt: skip
            for check in (False, True)]
    rng = np.random.default_rng(5)
    for r in range(REQS):
        ids = [rng.integers(1, 10_000, size=w).tolist() for w in WIDTHS]  # (full rows: every position maps)
        for bt in made:
            bt.append_block_ids(r, ids, True)
    for bt in made:
        bt.apply_staged_writes()
    assert made[0]._mode.entry is not None and made[1]._mode.entry is not None
    return made


def _step(rng, device, dtype):
    n = int(rng.integers(1, REQS + 1))
    idx = torch.tensor(rng.choice(REQS, size=n, replace=False).tolist(), dtype=dtype, device=device)
    lens = rng.integers(1, 4, size=n)
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=dtype, device=device)
    pos = torch.tensor(rng.integers(0, 1000, size=int(lens.sum())).tolist(), dtype=torch.int64, device=device)
    nct = torch.tensor(rng.integers(0, 1000, size=REQS).tolist(), dtype=dtype, device=device)
    return idx, qsl, pos, nct, min(n + int(rng.integers(0, 3)), REQS), int(lens.sum()) + int(rng.integers(0, 4))


@pytest.mark.parametrize("side_stream", [False, True], ids=["current stream", "side stream behind a busy one"])
def test_an_engines_calls_are_the_entrys_and_match_the_python_path(device, monkeypatch, side_stream):
    from multiwrite.backends.triton.plan import TritonPlan  # (imports Triton: only where these tests run)

    ours, twin = _pair(device)
    python_path = []
    original = TritonPlan._stage

    def counting(self, *args):
        python_path.append(self is ours._mode.plan)
        return original(self, *args)

    monkeypatch.setattr(TritonPlan, "_stage", counting)
    rng = np.random.default_rng(11)
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    calls = 0
    for i in range(60):
        idx, qsl, pos, nct, padded, tokens = _step(rng, device, torch.int32 if i % 2 else torch.int64)
        with torch.cuda.stream(stream):
            if side_stream:
                busy(0.002)
            got = [*ours.gather_block_tables(idx, padded, num_computed_tokens=nct),
                   ours.compute_slot_mappings(idx, qsl, pos, tokens)]  # fmt: skip
            want = [*twin.gather_block_tables(idx, padded, num_computed_tokens=nct),
                    twin.compute_slot_mappings(idx, qsl, pos, tokens)]  # fmt: skip
            calls += 2
        stream.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), i
    # (ours on the Python path: the first call of each of its 4 variants, which binds its fast launcher, and the calls
    # at which its address check is due)
    assert sum(python_path) <= 4 + calls // 63 + 1, (sum(python_path), calls)


def test_a_captured_gather_through_the_entry_replays_with_new_inputs(device, monkeypatch):
    from multiwrite.backends.triton.plan import TritonPlan

    ours, twin = _pair(device)
    rng = np.random.default_rng(3)
    idx = torch.zeros(REQS, dtype=torch.int32, device=device)
    for _ in range(3):  # (bind the fast launchers outside the capture)
        ours.gather_block_tables(idx[:8], 8)
        ours.compute_slot_mappings(idx[:8], torch.arange(9, dtype=torch.int32, device=device),
                                   torch.zeros(8, dtype=torch.int64, device=device), 8)  # fmt: skip
    torch.cuda.synchronize(device)
    launches = ours._mode.plan.device.stage_launcher.launches
    graph = torch.cuda.CUDAGraph()
    sub = idx[:16]
    python_path = []
    original = TritonPlan._stage
    monkeypatch.setattr(TritonPlan, "_stage", lambda self, *a: python_path.append(1) or original(self, *a))
    with torch.cuda.graph(graph):
        views = ours.gather_block_tables(sub, 16)
    monkeypatch.undo()
    # (recorded by the entry: one launch, none through the Python path)
    assert ours._mode.plan.device.stage_launcher.launches == launches + 1 and python_path == []
    for _ in range(5):
        sub.copy_(torch.tensor(rng.choice(REQS, size=16, replace=False).tolist(), dtype=torch.int32))
        graph.replay()
        want = twin.gather_block_tables(sub.clone(), 16)
        torch.cuda.synchronize(device)
        for a, b in zip(views, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("place", ["pageable", "pinned", "mixed"])
def test_host_inputs_are_the_python_paths_and_match(device, place):
    """Host inputs of GPU tables (all of them, or one among device inputs) go to the Python path, which copies them:
    the results equal the twin's (the entry once took a host input unread)."""
    ours, twin = _pair(device)
    rng = np.random.default_rng(8)
    for i in range(10):
        idx, qsl, pos, nct, padded, tokens = _step(rng, device, torch.int32)
        host = [t.cpu() for t in (idx, qsl, pos)]
        if place == "pinned":
            host = [t.pin_memory() for t in host]
        if place == "mixed":
            host = [idx, qsl, pos.cpu()] if i % 2 else [idx.cpu(), qsl, pos]
        got = [*ours.gather_block_tables(host[0], padded), ours.compute_slot_mappings(*host, tokens)]
        want = [*twin.gather_block_tables(idx, padded), twin.compute_slot_mappings(idx, qsl, pos, tokens)]
        torch.cuda.synchronize(device)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (place, i)


def _stage_step(rng, tables: list[BlockTables]) -> None:
    """The same random overwrites and appends into each of `tables` (no row written twice: no overlapping writes)."""
    for r in rng.choice(REQS, size=int(rng.integers(0, 12)), replace=False).tolist():
        counts = tables[0].num_blocks[:, r] // np.array([b // k for b, k in zip(BLOCK_SIZES, KERNEL_BLOCK_SIZES)])
        overwrite = rng.random() < 0.3
        sizes = [int(rng.integers(1, w + 1)) if overwrite else int(rng.integers(0, w - c + 1))
                 for w, c in zip(WIDTHS, counts.tolist())]  # fmt: skip
        ids = [rng.integers(1, 10_000, size=n).tolist() for n in sizes]
        for bt in tables:
            bt.append_block_ids(r, ids, overwrite)


@pytest.mark.parametrize("side_stream", [False, True], ids=["current stream", "side stream behind a busy one"])
def test_an_engines_prepare_inputs_with_staged_writes_is_the_entrys_and_matches(device, monkeypatch, side_stream):
    """200 steps of staged writes and `prepare_inputs` (the ring's slots reused many times over, a gather between
    steps): ours through the entry (its Python path, `TritonPlan.prepare`, only where its address check is due), the
    twin through the Python path; the same outputs and tables after every step."""
    from multiwrite.backends.triton.plan import TritonPlan

    ours, twin = _pair(device)
    python_path = []
    original = TritonPlan.prepare
    monkeypatch.setattr(TritonPlan, "prepare", lambda self, step: python_path.append(self is ours._mode.plan)
                        or original(self, step))  # fmt: skip
    rng = np.random.default_rng(17)
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    for i in range(200):
        _stage_step(rng, [ours, twin])
        idx, qsl, pos, nct, padded, tokens = _step(rng, device, torch.int32 if i % 3 else torch.int64)
        with torch.cuda.stream(stream):
            if side_stream and i % 4 == 0:
                busy(0.002)
            got = ours.prepare_inputs(idx, qsl, pos, padded, tokens, num_computed_tokens=nct)
            want = twin.prepare_inputs(idx, qsl, pos, padded, tokens, num_computed_tokens=nct)
            got, want = [*got[0], got[1]], [*want[0], want[1]]
            if i % 5 == 0:
                got.append(ours.gather_block_tables(idx, padded)[0].clone())
                want.append(twin.gather_block_tables(idx, padded)[0].clone())
        stream.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), i
        for a, b in zip(ours.block_tables, twin.block_tables, strict=True):
            assert torch.equal(a.tensor, b.tensor), i
        assert torch.equal(ours.num_blocks_device, twin.num_blocks_device), i
    # (ours on the Python path: the first call of each of its 2 variants with writes, which binds its fast launcher,
    # and the calls at which its address check is due, gathers included)
    assert sum(python_path) <= 2 + 240 // 63 + 1, sum(python_path)
    assert python_path.count(False) >= 150  # (the twin's: every step with something staged)


def test_prepare_inputs_during_a_capture_is_refused_with_nothing_applied(device):
    """Eager tables: a `prepare_inputs` being captured is refused (the entry leaves it to the Python path, which
    raises), the staged writes stay staged and apply at the next call outside the capture."""
    from multiwrite import GraphCaptureError

    ours, twin = _pair(device)
    rng = np.random.default_rng(4)
    _stage_step(rng, [ours, twin])
    while not ours.num_staged_writes:
        _stage_step(rng, [ours, twin])
    idx, qsl, pos, nct, padded, tokens = _step(rng, device, torch.int32)
    staged = ours.num_staged_writes
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="prepare_inputs"):
        with torch.cuda.graph(graph):
            ours.prepare_inputs(idx, qsl, pos, padded, tokens)
    assert ours.num_staged_writes == staged
    got = ours.prepare_inputs(idx, qsl, pos, padded, tokens)
    want = twin.prepare_inputs(idx, qsl, pos, padded, tokens)
    torch.cuda.synchronize(device)
    for a, b in zip([*got[0], got[1]], [*want[0], want[1]], strict=True):
        assert torch.equal(a, b)


def test_vllms_three_calls_with_staged_writes_are_the_entrys_and_match(device, monkeypatch):
    """vLLM's pattern, 200 steps: staged writes, `apply_staged_writes()`, a gather and the slot mappings; ours through
    the entry (the apply's Python path, `TritonPlan.apply`, only where the address check is due), the twin through the
    Python path; the same outputs and tables after every step."""
    from multiwrite.backends.triton.plan import TritonPlan

    ours, twin = _pair(device)
    python_path = []
    original = TritonPlan.apply
    monkeypatch.setattr(TritonPlan, "apply", lambda self: python_path.append(self is ours._mode.plan) or original(self))
    rng = np.random.default_rng(29)
    for i in range(200):
        _stage_step(rng, [ours, twin])
        idx, qsl, pos, nct, padded, tokens = _step(rng, device, torch.int32)
        got, want = [], []
        for bt, out in ((ours, got), (twin, want)):
            bt.apply_staged_writes()
            out.extend([*bt.gather_block_tables(idx, padded, num_computed_tokens=nct),
                        bt.compute_slot_mappings(idx, qsl, pos, tokens)])  # fmt: skip
            out[:] = [t.clone() for t in out]
        torch.cuda.synchronize(device)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), i
        for a, b in zip(ours.block_tables, twin.block_tables, strict=True):
            assert torch.equal(a.tensor, b.tensor), i
    # (ours on the Python path: the first apply of each variant (binding), and the calls whose address check is due)
    assert sum(python_path) <= 2 + 600 // 63 + 1, sum(python_path)
    assert python_path.count(False) >= 150
