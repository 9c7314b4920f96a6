"""Graph mode's captured stage (issue 10): `prepare_inputs`, `gather_block_tables` and `compute_slot_mappings`
of a `BlockTables(..., cuda_graphs=True)` recorded in a CUDA graph, run through Triton's interpreter on CPU.

A capture is simulated as in tests/test_graph_mode.py: `is_capturing` is patched to say "capturing" and the
recorded launch (`CapturedStage.launch`) is not run at capture; every "replay" then calls exactly that
recorded launch. The step's inputs live in persistent buffers given at capture and rewritten before each
replay, as an engine's are; every step's gathered rows and slot mappings are compared with
`multiwrite.reference`. Real captures run in tests/gpu/test_graphs.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import multiwrite.block_tables as block_tables_module
from multiwrite import BlockTables
from multiwrite.errors import GraphCaptureError, StageInputError
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import load_trace, max_blocks_per_group, replay_schedule

triton_kernel = pytest.importorskip("multiwrite.backends.triton_kernel")
if not triton_kernel.INTERPRETED:  # pragma: no cover - a GPU machine
    pytest.skip("these tests drive the kernels through Triton's interpreter on CPU", allow_module_level=True)
from multiwrite.backends import triton_graph, triton_stage  # noqa: E402

CPU = torch.device("cpu")
BS, KBS = [16, 32, 8], [16, 16, 8]
#: table rows; the schedule uses rows < CONCURRENCY, the capture NUM_REQS batch entries padded to REQS
REQS, CONCURRENCY, NUM_REQS, TOKENS = 10, 8, 8, 64


def _capture(bt: BlockTables, call):
    """Run `call()` as inside `torch.cuda.graph(...)`: launches are recorded, not run. Returns the call's result
    and the `CapturedStage`s it recorded."""
    before = len(bt._graph.captured)
    ran: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(block_tables_module, "is_capturing", lambda device: True)
        mp.setattr(triton_graph.CapturedStage, "launch", lambda self: ran.append(self))
        out = call()
    recorded = bt._graph.captured[before:]
    assert ran == recorded  # each recorded launch was issued once, at capture
    return out, recorded


def _replay(recorded) -> None:
    """What a replay of the captured graph runs."""
    for captured in recorded:
        captured.launch()


class Buffers:
    """Persistent step inputs: NUM_REQS batch entries (padded with row 0 and zero tokens), TOKENS tokens."""

    def __init__(self):
        self.idx = torch.zeros(NUM_REQS, dtype=torch.int32)
        self.qsl = torch.zeros(NUM_REQS + 1, dtype=torch.int64)
        self.pos = torch.zeros(TOKENS, dtype=torch.int64)
        self.pad = torch.zeros(TOKENS, dtype=torch.bool)

    def load(self, step, rng: np.random.Generator) -> tuple[list[int], list[int], list[int], list[bool]]:
        """Write one step's inputs in place; returns them as lists (idx, qsl, pos, is_padding)."""
        n = len(step.rows)
        idx = list(step.rows) + [0] * (NUM_REQS - n)
        tokens = list(step.tokens) + [0] * (NUM_REQS - n)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        pos = np.zeros(TOKENS, dtype=np.int64)
        T = int(qsl[-1])
        pos[:T] = np.concatenate([np.arange(s, s + t) for s, t in zip(step.starts, step.tokens)] or [np.zeros(0)])
        pos[T:] = rng.integers(0, 1 << 20, TOKENS - T)  # junk past the scheduled tokens: never read as a slot
        pad = np.zeros(TOKENS, dtype=bool)
        pad[T:] = True
        pad[:T] = rng.random(T) < 0.2  # a few scheduled tokens marked as padding too
        self.idx.copy_(torch.tensor(idx, dtype=torch.int32))
        self.qsl.copy_(torch.from_numpy(qsl))
        self.pos.copy_(torch.from_numpy(pos))
        self.pad.copy_(torch.from_numpy(pad))
        return idx, qsl.tolist(), pos.tolist(), pad.tolist()


def _tables(max_tokens: int | None = TOKENS) -> BlockTables:
    return BlockTables(BS, REQS, max_blocks_per_group(BS), CPU, KBS, backend="triton-cuda", cuda_graphs=True,
                       max_num_batched_tokens=max_tokens)  # fmt: skip


def _schedule(steps: int):
    trace = load_trace(Path(__file__).parent / "data" / "small_trace.csv")
    return list(replay_schedule(trace, BS, CONCURRENCY, steps, token_budget=TOKENS))


def test_captured_prepare_inputs_over_trace_steps_equals_the_reference():
    """Capture prepare_inputs once over persistent buffers (padded batch: NUM_REQS entries, REQS rows,
    TOKENS tokens, is_padding), then per step of the trace: stage, commit, rewrite the inputs in place,
    replay. Each replay must apply exactly that step's batch, then gather and compute the slot mappings
    from the inputs as they are at the replay; some steps apply eagerly instead (the replay then consumes
    nothing and reads the tables as the eager apply left them)."""
    rng = np.random.default_rng(11)
    bt = _tables()
    ref = ReferenceBlockTables(BS, REQS, max_blocks_per_group(BS), KBS)
    x = Buffers()
    (gathered, slots), recorded = _capture(
        bt, lambda: bt.prepare_inputs(x.idx, x.qsl, x.pos, REQS, TOKENS, is_padding=x.pad)
    )
    assert len(recorded) == 1 and recorded[0].consume
    assert bt._graph.published == 0 and not bt[0].tensor.any()  # the capture ran nothing
    assert [t.data_ptr() for t in gathered] == [t.data_ptr() for t in bt.input_block_tables]
    assert slots.data_ptr() == bt.slot_mappings.data_ptr() and tuple(slots.shape) == (3, TOKENS)
    want_ibt = [np.zeros(t.shape, dtype=np.int64) for t in bt.input_block_tables]
    eager = checked = 0
    schedule = _schedule(60)  # the small trace's whole run: every request admitted, prefilled, decoded, freed
    for i, step in enumerate(schedule):
        for req, ids, overwrite in step.calls:
            bt.append_block_ids(req, ids, overwrite)
            ref.append_block_ids(req, ids, overwrite)
        if i % 7 == 3:
            bt.apply_staged_writes()  # eager (e.g. a prefill outside the graph): the replay below consumes nothing
            eager += 1
        else:
            bt.commit_staged_writes()
        ref.apply_staged_writes()
        idx, qsl, pos, pad = x.load(step, rng)
        _replay(recorded)
        want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, REQS, want_ibt)
        for g in range(3):
            np.testing.assert_array_equal(gathered[g].numpy(), want[g], err_msg=f"step {i} group {g}")
        want_slots = compute_slot_mappings_reference(ref.tables, KBS, idx, qsl, pos, TOKENS, pad)
        np.testing.assert_array_equal(slots.numpy(), want_slots, err_msg=f"step {i}")
        assert (want_slots >= 0).any() or not step.rows
        checked += 1
    assert checked == len(schedule) >= 20 and eager >= 3
    assert bt._graph.consumed == bt._graph.published and bt._graph.idle_runs == eager


def test_three_captured_calls_equal_one_captured_prepare_inputs():
    """apply_staged_writes + gather_block_tables + compute_slot_mappings captured on one BlockTables, and
    prepare_inputs captured on another, replayed over the same steps: equal outputs and tables every step."""
    rng = np.random.default_rng(12)
    one, three = _tables(), _tables()
    x = Buffers()
    (g1, s1), rec1 = _capture(one, lambda: one.prepare_inputs(x.idx, x.qsl, x.pos, REQS, TOKENS, x.pad))

    applies: list[int] = []

    def three_calls():
        three._graph.launch = applies.append  # the captured apply's launch: recorded, not run
        try:
            three.apply_staged_writes()
            return three.gather_block_tables(x.idx, REQS), three.compute_slot_mappings(x.idx, x.qsl, x.pos, TOKENS,
                                                                                        x.pad)  # fmt: skip
        finally:
            del three._graph.launch

    (g3, s3), rec3 = _capture(three, three_calls)
    assert applies == [-1] and [c.consume for c in rec3] == [False, False]
    for step in _schedule(12):
        for bt in (one, three):
            for req, ids, overwrite in step.calls:
                bt.append_block_ids(req, ids, overwrite)
            bt.commit_staged_writes()
        x.load(step, rng)
        _replay(rec1)
        three._graph.launch(-1)  # the captured apply_staged_writes()
        _replay(rec3)
        for a, b in zip(g1, g3):
            assert torch.equal(a, b)
        assert torch.equal(s1, s3)
        for a, b in zip(one.block_tables, three.block_tables):
            assert torch.equal(a.tensor, b.tensor)
    assert (s1 >= 0).any()


def test_replays_read_the_pinned_descriptors_not_the_module_cache(monkeypatch):
    """The captured stage launches with the descriptors its GraphStage built at construction: the module
    cache (bounded, it may evict) is never consulted at capture or replay, so no host->device copy of new
    descriptors can happen inside a capture and no evicted descriptor is read by a replay."""
    bt = _tables(max_tokens=None)  # no slot_mappings: the gather launch uses the GraphStage's scratch too
    assert bt._graph.stage_desc is not None and bt._graph.stage_scratch is not None
    idx = torch.tensor([3, 1], dtype=torch.int64)
    gathered, recorded = _capture(bt, lambda: bt.gather_block_tables(idx, 4))
    triton_stage._descriptors.clear()

    def refuse(stage):
        raise AssertionError("the module descriptor cache was used by a captured launch")

    monkeypatch.setattr(triton_stage, "_descriptor_table", refuse)
    bt.append_block_ids(1, ([5, 6], [7], [8, 9]), True)
    bt.append_block_ids(3, ([1], [2], [3]), True)
    bt.apply_staged_writes()  # eager apply (the consume kernel only)
    _replay(recorded)
    assert gathered[0][:2, :2].tolist() == [[1, 0], [5, 6]] and gathered[1][1, :2].tolist() == [14, 15]
    assert not gathered[0][2:].any()
    idx[0] = 1  # the same tensor, another value: read at the replay
    _replay(recorded)
    assert gathered[0][0, :2].tolist() == [5, 6]


def test_a_host_tensor_is_refused_during_capture_and_nothing_is_recorded():
    bt = _tables()
    bt.append_block_ids(0, ([1], [2], [3]), True)
    x = Buffers()
    elsewhere = torch.zeros(NUM_REQS, dtype=torch.int32, device="meta")  # not on the tables' device (cpu here)
    with pytest.raises(StageInputError, match=r"prepare_inputs during CUDA graph capture: idx_mapping is on meta.*"
                       r"host->device copy would be captured"):  # fmt: skip
        _capture(bt, lambda: bt.prepare_inputs(elsewhere, x.qsl, x.pos, REQS, TOKENS))
    with pytest.raises(StageInputError, match="is_padding is on meta"):
        _capture(bt, lambda: bt.compute_slot_mappings(x.idx, x.qsl, x.pos, TOKENS, elsewhere.bool()))
    with pytest.raises(StageInputError, match="num_reqs_padded=2 is less than num_reqs=8"):
        _capture(bt, lambda: bt.gather_block_tables(x.idx, 2))
    assert bt._graph.captured == [] and bt._graph.published == 0 and bt._arena.num_writes == 4


def test_outside_a_capture_graph_mode_stage_calls_run_eagerly():
    """Not capturing: prepare_inputs commits, consumes and stages at once; nothing is recorded."""
    bt = _tables()
    bt.append_block_ids(2, ([4, 5], [6], [7]), True)
    gathered, slots = bt.prepare_inputs(torch.tensor([2]), torch.tensor([0, 2]), torch.tensor([15, 16]), 2, 3)
    assert bt._graph.captured == [] and bt._graph.consumed == 1
    assert gathered[0][:, :2].tolist() == [[4, 5], [0, 0]] and gathered[1][0, :2].tolist() == [12, 13]
    # kernel block ids: group 0 [4, 5] (kbs 16), group 1 [12, 13] (block 32 = 2 kernel blocks of 16)
    assert slots[:2].tolist() == [[4 * 16 + 15, 5 * 16 + 0, -1], [12 * 16 + 15, 13 * 16 + 0, -1]]


def test_capture_of_tables_without_graph_mode_is_refused_naming_the_flag(monkeypatch):
    """Tables without cuda_graphs=True refuse a capture of the stage calls with GraphCaptureError naming the flag
    (on CPU no stream can capture: the probe is made to report one)."""
    import multiwrite.capture as capture_module
    import multiwrite.stage as stage_module

    monkeypatch.setattr(stage_module, "refuse_capture", lambda device, what: capture_module._raise(device, what))
    bt = BlockTables(BS, REQS, [4, 4, 4], CPU, KBS, backend="triton-cuda", max_num_batched_tokens=TOKENS)
    bt.append_block_ids(0, ([1], [2], [3]), True)
    idx, qsl, pos = torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0])
    calls = {
        "prepare_inputs": lambda: bt.prepare_inputs(idx, qsl, pos, 1, 1),
        "gather_block_tables": lambda: bt.gather_block_tables(idx, 1),
        "compute_slot_mappings": lambda: bt.compute_slot_mappings(idx, qsl, pos, 1),
    }
    for name, call in calls.items():
        with pytest.raises(GraphCaptureError, match=rf"^BlockTables\.{name} on cpu during CUDA graph capture.*"
                           r"capture .*prepare_inputs\(\).*BlockTables\(\.\.\., cuda_graphs=True\)"):  # fmt: skip
            call()
    assert bt._arena.num_writes == 4  # still staged


def test_a_graph_stage_without_record_stage_refuses_stage_captures(monkeypatch):
    """A backend's graph stage that captures only the apply (no `record_stage`, as a third-party one may be)
    refuses a captured prepare_inputs with GraphCaptureError naming the backend, recording nothing."""
    bt = _tables()
    bt.append_block_ids(0, ([1], [2], [3]), True)
    monkeypatch.delattr(triton_graph.GraphStage, "record_stage")
    x = Buffers()
    with pytest.raises(GraphCaptureError, match=r"prepare_inputs during CUDA graph capture: the graph mode of "
                       r"backend 'triton-cuda' captures apply_staged_writes\(\) only"):  # fmt: skip
        _capture(bt, lambda: bt.prepare_inputs(x.idx, x.qsl, x.pos, REQS, TOKENS))
    assert bt._arena.num_writes == 4 and bt._graph.published == 0


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_captured_slot_mappings_with_context_parallelism_equal_the_reference(cp_rank):
    """cp_size 2, interleave 2: the captured launch carries the tables' context-parallel settings; each replay's
    slots (this rank's tokens only) equal the reference for inputs rewritten in place between replays."""
    rng = np.random.default_rng(13 + cp_rank)
    bt = BlockTables(BS, REQS, [6, 4, 8], CPU, KBS, backend="triton-cuda", cuda_graphs=True,
                     max_num_batched_tokens=TOKENS, cp_size=2, cp_rank=cp_rank, cp_interleave=2)  # fmt: skip
    ref = ReferenceBlockTables(BS, REQS, [6, 4, 8], KBS)
    idx = torch.zeros(4, dtype=torch.int64)
    qsl = torch.zeros(5, dtype=torch.int32)
    pos = torch.zeros(TOKENS, dtype=torch.int32)
    slots, recorded = _capture(bt, lambda: bt.compute_slot_mappings(idx, qsl, pos, TOKENS))
    for step in range(6):
        for req in range(REQS):
            ids = [rng.integers(1, 1000, n).tolist() for n in (2, 1, 3)]
            bt.append_block_ids(req, ids, True)
            ref.append_block_ids(req, ids, True)
        bt.apply_staged_writes()
        ref.apply_staged_writes()
        rows = rng.permutation(REQS)[:4]
        tokens = rng.integers(0, 9, 4)
        q = np.concatenate([[0], np.cumsum(tokens)])
        p = np.concatenate([rng.integers(0, 2 * 32, t) for t in tokens])  # inside both ranks' share of 2 blocks
        idx.copy_(torch.from_numpy(rows))
        qsl.copy_(torch.from_numpy(q.astype(np.int32)))
        pos[: p.shape[0]] = torch.from_numpy(p.astype(np.int32))
        _replay(recorded)
        want = compute_slot_mappings_reference(ref.tables, KBS, rows.tolist(), q.tolist(), p.tolist(), TOKENS,
                                               cp_size=2, cp_rank=cp_rank, cp_interleave=2)  # fmt: skip
        np.testing.assert_array_equal(slots.numpy(), want, err_msg=f"step {step}")
        assert (want >= 0).sum() > 0
