"""Graph mode's captured stage: `prepare_inputs`, `gather_block_tables` and `compute_slot_mappings` of a
`BlockTables(..., cuda_graphs=True)` recorded once (a simulated capture), then replayed over persistent input buffers
rewritten in place before each replay, as an engine's are: every replay reads the inputs as they are then, and its
gathered rows and slot mappings equal `multiwrite.reference`. Triton's interpreter on CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.capture import simulated_capture
from multiwrite.errors import GraphCaptureError, StageInputError
from multiwrite.reference import ReferenceBlockTables, compute_slot_mappings_reference, gather_block_tables_reference
from multiwrite.workload import load_trace, max_blocks_per_group, replay_schedule
from tests.graph.model import BS, CPU, KBS
from tests.support.tables import host

TRACE = Path(__file__).resolve().parents[1] / "data" / "small_trace.csv"  # requests of at most 308 tokens
#: table rows; the schedule uses rows < CONCURRENCY; NUM_REQS batch entries padded to REQS; TOKENS tokens
REQS, CONCURRENCY, NUM_REQS, TOKENS = 10, 8, 8, 64


class Buffers:
    """Persistent step inputs: NUM_REQS batch entries (unused ones name row 0 with zero tokens), TOKENS tokens."""

    def __init__(self):
        self.idx = torch.zeros(NUM_REQS, dtype=torch.int32)
        self.qsl = torch.zeros(NUM_REQS + 1, dtype=torch.int64)
        self.pos = torch.zeros(TOKENS, dtype=torch.int64)
        self.pad = torch.zeros(TOKENS, dtype=torch.bool)

    def load(self, step, rng: np.random.Generator):
        """Write one step's inputs in place; returns them as lists (idx, qsl, pos, is_padding)."""
        n = len(step.rows)
        idx = list(step.rows) + [0] * (NUM_REQS - n)
        tokens = list(step.tokens) + [0] * (NUM_REQS - n)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        T = int(qsl[-1])
        pos = np.zeros(TOKENS, dtype=np.int64)
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


def graph_tables(max_tokens: int | None = TOKENS) -> BlockTables:
    return BlockTables(BS, REQS, max_blocks_per_group(BS, 512), CPU, KBS, backend="triton-cuda", cuda_graphs=True,
                       max_num_batched_tokens=max_tokens)  # fmt: skip


def schedule(steps: int):
    return list(replay_schedule(load_trace(TRACE), BS, CONCURRENCY, steps, token_budget=TOKENS))


def test_a_captured_prepare_inputs_over_trace_steps_equals_the_reference():
    """prepare_inputs captured once; per trace step: stage, commit (or, some steps, an eager apply: the replay then
    applies nothing new), rewrite the inputs in place, replay. Each replay applies exactly that step's batch, then
    gathers and maps the slots from the inputs as they are at the replay, into the persistent outputs."""
    rng = np.random.default_rng(11)
    bt = graph_tables()
    ref = ReferenceBlockTables(BS, REQS, max_blocks_per_group(BS, 512), KBS)
    x = Buffers()
    with simulated_capture() as graph:
        gathered, slots = bt.prepare_inputs(x.idx, x.qsl, x.pos, REQS, TOKENS, is_padding=x.pad)
    assert len(graph.launches) == 2  # the consume launch and the stage launch
    assert bt.graph.ring.published == 0 and not bt[0].tensor.any()  # the capture ran nothing
    assert [t.data_ptr() for t in gathered] == [t.data_ptr() for t in bt.input_block_tables]
    assert slots.data_ptr() == bt.slot_mappings.data_ptr() and tuple(slots.shape) == (3, TOKENS)
    want_ibt = [np.zeros(t.shape, dtype=np.int64) for t in bt.input_block_tables]
    eager = 0
    steps = schedule(16)
    for i, step in enumerate(steps):
        for req, ids, overwrite in step.calls:
            bt.append_block_ids(req, ids, overwrite)
            ref.append_block_ids(req, ids, overwrite)
        if i % 5 == 3:
            bt.apply_staged_writes()  # eager, e.g. a prefill outside the graph
            bt.commit_staged_writes()  # (an empty commit: the replay stays paired)
            eager += 1
        else:
            bt.commit_staged_writes()
        ref.apply_staged_writes()
        idx, qsl, pos, pad = x.load(step, rng)
        graph.replay()
        want = gather_block_tables_reference(ref.tables, ref.num_blocks, idx, REQS, want_ibt)
        for g in range(3):
            np.testing.assert_array_equal(host(gathered[g]), want[g], err_msg=f"step {i} group {g}")
        want_slots = compute_slot_mappings_reference(ref.tables, KBS, idx, qsl, pos, TOKENS, pad)
        np.testing.assert_array_equal(host(slots), want_slots, err_msg=f"step {i}")
    assert len(steps) == 16 and eager == 3 and bt.graph.ring.runs == len(steps)


def test_captured_apply_gather_and_slot_mappings_equal_one_captured_prepare_inputs():
    rng = np.random.default_rng(12)
    one, three = graph_tables(), graph_tables()
    x = Buffers()
    with simulated_capture() as g1:
        out1 = one.prepare_inputs(x.idx, x.qsl, x.pos, REQS, TOKENS, x.pad)
    with simulated_capture() as g3:
        three.apply_staged_writes()
        out3 = three.gather_block_tables(x.idx, REQS), three.compute_slot_mappings(x.idx, x.qsl, x.pos, TOKENS, x.pad)
    assert (len(g1.launches), len(g3.launches)) == (2, 3)
    for step in schedule(12)[6:]:  # past the first prefills
        for bt in (one, three):
            for req, ids, overwrite in step.calls:
                bt.append_block_ids(req, ids, overwrite)
            bt.commit_staged_writes()
        x.load(step, rng)
        g1.replay()
        g3.replay()
        for a, b in zip(out1[0], out3[0]):
            assert torch.equal(a, b)
        assert torch.equal(out1[1], out3[1])
        for a, b in zip(one.block_tables, three.block_tables):
            assert torch.equal(a.tensor, b.tensor)
    assert (out1[1] >= 0).any()


def test_a_captured_gather_reads_the_tables_as_the_last_apply_left_them_and_its_index_at_replay():
    bt = graph_tables(max_tokens=None)  # no slot_mappings: the gather alone
    idx = torch.tensor([3, 1], dtype=torch.int64)
    with simulated_capture() as graph:
        gathered = bt.gather_block_tables(idx, 4)
    bt.append_block_ids(1, ([5, 6], [7], [8, 9]), True)
    bt.append_block_ids(3, ([1], [2], [3]), True)
    bt.apply_staged_writes()  # eager
    graph.replay()
    assert gathered[0][:2, :2].tolist() == [[1, 0], [5, 6]] and gathered[1][1, :2].tolist() == [14, 15]
    assert not gathered[0][2:].any()
    idx[0] = 1  # the same tensor, another value: read at the replay
    graph.replay()
    assert gathered[0][0, :2].tolist() == [5, 6]


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_captured_slot_mappings_with_context_parallelism_equal_the_reference(cp_rank):
    """cp_size 2, interleave 2: each replay maps this rank's tokens only, from inputs rewritten between replays."""
    rng = np.random.default_rng(13 + cp_rank)
    widths = [6, 4, 8]
    bt = BlockTables(BS, REQS, widths, CPU, KBS, backend="triton-cuda", cuda_graphs=True,
                     max_num_batched_tokens=TOKENS, cp_size=2, cp_rank=cp_rank, cp_interleave=2)  # fmt: skip
    ref = ReferenceBlockTables(BS, REQS, widths, KBS)
    idx = torch.zeros(4, dtype=torch.int64)
    qsl = torch.zeros(5, dtype=torch.int32)
    pos = torch.zeros(TOKENS, dtype=torch.int32)
    with simulated_capture() as graph:
        slots = bt.compute_slot_mappings(idx, qsl, pos, TOKENS)
    for step in range(3):
        for req in range(REQS):
            ids = [rng.integers(1, 1000, n).tolist() for n in (2, 1, 3)]
            bt.append_block_ids(req, ids, True)
            ref.append_block_ids(req, ids, True)
        bt.apply_staged_writes()
        ref.apply_staged_writes()
        rows = rng.permutation(REQS)[:4]
        tokens = rng.integers(1, 9, 4)
        q = np.concatenate([[0], np.cumsum(tokens)])
        p = np.concatenate([rng.integers(0, 2 * 32, t) for t in tokens])  # inside both ranks' share of 2 blocks
        idx.copy_(torch.from_numpy(rows))
        qsl.copy_(torch.from_numpy(q.astype(np.int32)))
        pos[: p.shape[0]] = torch.from_numpy(p.astype(np.int32))
        graph.replay()
        want = compute_slot_mappings_reference(ref.tables, KBS, rows.tolist(), q.tolist(), p.tolist(), TOKENS,
                                               cp_size=2, cp_rank=cp_rank, cp_interleave=2)  # fmt: skip
        np.testing.assert_array_equal(host(slots), want, err_msg=f"step {step}")
        assert (want >= 0).any() and (want[:, : p.shape[0]] == -1).any()


def test_an_input_off_the_device_is_refused_during_capture_and_nothing_is_recorded():
    bt = graph_tables()
    bt.append_block_ids(0, ([1], [2], [3]), True)
    x = Buffers()
    elsewhere = torch.zeros(NUM_REQS, dtype=torch.int32, device="meta")  # not on the tables' device (cpu here)
    with simulated_capture() as graph:
        with pytest.raises(StageInputError, match=r"prepare_inputs during CUDA graph capture: idx_mapping is on meta.*"
                           r"host->device copy would be captured"):  # fmt: skip
            bt.prepare_inputs(elsewhere, x.qsl, x.pos, REQS, TOKENS)
        with pytest.raises(StageInputError, match="is_padding is on meta"):
            bt.compute_slot_mappings(x.idx, x.qsl, x.pos, TOKENS, elsewhere.bool())
        with pytest.raises(StageInputError, match="num_reqs_padded=2 is less than num_reqs=8"):
            bt.gather_block_tables(x.idx, 2)
    assert graph.launches == [] and bt.graph.recordings == [] and bt.graph.ring.published == 0
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]


def test_clear_staged_writes_is_host_work_a_graph_mode_capture_allows():
    bt = graph_tables()
    bt.append_block_ids(0, ([1], [2], [3]), True)
    bt.commit_staged_writes()
    bt.append_block_ids(0, ([4], [5], [6]), False)
    with simulated_capture() as graph:
        bt.clear_staged_writes()
        bt.apply_staged_writes()
    assert [t.num_staged_writes for t in bt.block_tables] == [0, 0, 0] and bt.num_blocks[:, 0].tolist() == [1, 2, 1]
    graph.replay()
    assert bt[0].tensor[0, :2].tolist() == [1, 0] and bt.num_blocks_device[:, 0].tolist() == [1, 2, 1]


def test_capturing_an_apply_of_tables_without_graph_mode_is_refused_naming_the_flag():
    """A capture cannot hold an eager apply (its staging memory would be replayed): `prepare_inputs` and a gather
    or slot mapping with `apply_staged=True` are refused while writes are staged; nothing is recorded."""
    bt = BlockTables(BS, REQS, [4, 4, 4], CPU, KBS, backend="triton-cuda", max_num_batched_tokens=TOKENS)
    bt.append_block_ids(0, ([1], [2], [3]), True)
    idx, qsl, pos = torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0])
    calls = {
        "prepare_inputs": lambda: bt.prepare_inputs(idx, qsl, pos, 1, 1),
        r"gather_block_tables\(apply_staged=True\)": lambda: bt.gather_block_tables(idx, 1, apply_staged=True),
        r"compute_slot_mappings\(apply_staged=True\)": lambda: bt.compute_slot_mappings(idx, qsl, pos, 1,
                                                                                          apply_staged=True),
    }  # fmt: skip
    with simulated_capture() as graph:
        for name, call in calls.items():
            with pytest.raises(GraphCaptureError, match=rf"^BlockTables\.{name} on cpu during CUDA graph capture.*"
                               r"BlockTables\(\.\.\., cuda_graphs=True\)"):  # fmt: skip
                call()
    assert graph.launches == [] and [t.num_staged_writes for t in bt.block_tables] == [1, 1, 1]


def test_a_gather_and_slot_mapping_captured_without_graph_mode_read_the_tables_at_each_replay():
    """As vLLM 0.33's speculator does: `compute_slot_mappings` (and a gather) captured on tables without graph mode
    record their launches; each replay reads the tables as the eager applies before it left them."""
    bt = BlockTables(BS, REQS, [4, 4, 4], CPU, KBS, backend="triton-cuda", max_num_batched_tokens=TOKENS)
    bt.append_block_ids(0, ([1], [2], [3]), True)
    bt.apply_staged_writes()
    idx, qsl, pos = torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([5])
    with simulated_capture() as graph:
        gathered = bt.gather_block_tables(idx, 2)
        slots = bt.compute_slot_mappings(idx, qsl, pos, 2)
    assert len(graph.launches) == 2 and slots.tolist() == [[-1] * 2] * 3  # recorded, not run
    graph.replay()
    # (group 1: manager block 2 is kernel blocks 4, 5 of 16 tokens)
    assert [g[0, 0].item() for g in gathered] == [1, 4, 3] and slots[:, 0].tolist() == [21, 69, 29]
    bt.append_block_ids(0, ([7], [8], [9]), True)
    bt.apply_staged_writes()
    graph.replay()
    assert [g[0, 0].item() for g in gathered] == [7, 16, 9] and slots[:, 0].tolist() == [117, 261, 77]
