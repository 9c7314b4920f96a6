"""The compiled staging paths (`multiwrite/_cstaging.c`): `BlockTables.append_block_ids` and
`append_block_ids_batch` as C callables, the arena's rotation into its lent ring's next slot, graph mode's commit.

Each is checked against the pure-Python path on the same inputs, and for what it must hand to that path: every
call it does not take (keywords it does not know, a non-bool `overwrite`, bad ids), every rotation or commit it
cannot do exactly (a slot still in use or too small, overlapping writes).
"""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest
import torch

import multiwrite.block_tables as block_tables_module
import multiwrite.staging as staging_module
from multiwrite import BlockTables
from multiwrite.errors import StagedWriteError
from multiwrite.reference import ReferenceBlockTables

if block_tables_module._stage_block_ids is None:  # pragma: no cover - depends on the install
    pytest.skip("multiwrite._cstaging is not built (no C compiler at install time)", allow_module_level=True)

BS, KBS, WIDTHS, REQS = [16, 32, 8], [16, 16, 8], [6, 5, 7], 8


def _tables(**kw) -> BlockTables:
    return BlockTables(BS, REQS, WIDTHS, "cpu", KBS, backend=kw.pop("backend", "torch-cpu"), **kw)


def _python_tables(monkeypatch: pytest.MonkeyPatch, **kw) -> BlockTables:
    """Tables built with the compiled `append_block_ids` and graph commit switched off (the lent ring's rotation
    is a module-level choice: the `staging` fixture switches it off)."""
    with monkeypatch.context() as m:
        m.setattr(block_tables_module, "_stage_block_ids", None)
        m.setattr(block_tables_module, "_commit_graph", None)
        bt = _tables(**kw)
    assert type(bt.append_block_ids).__name__ == "method"  # the pure-Python method
    return bt


def _staged(bt: BlockTables) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray]:
    a = bt._arena
    return a.meta[: a.num_writes].copy(), a.values[: a.num_values].copy(), a.may_overlap, bt.num_blocks.copy()


def _random_calls(rng: random.Random, n: int) -> list[tuple[int, list[list[int]], bool]]:
    """Calls that always fit: an overwrite of a few blocks, or an append of at most one block per group."""
    calls = []
    counts = [[0] * len(BS) for _ in range(REQS)]
    for _ in range(n):
        req = rng.randrange(REQS)
        overwrite = rng.random() < 0.3 or max(counts[req]) == 0
        ids = []
        for g, w in enumerate(WIDTHS):
            start = 0 if overwrite else counts[req][g]
            room = w - start
            take = rng.randint(0, min(room, 3 if overwrite else 1))
            ids.append([rng.randrange(1000) for _ in range(take)])
            if overwrite or take:
                counts[req][g] = start + take
        calls.append((req, ids, overwrite))
    return calls


def test_the_compiled_path_is_bound_on_the_object_and_the_method_stays_documented():
    bt = _tables()
    assert type(bt.append_block_ids).__name__ == "Stager"
    assert "req_index" in BlockTables.append_block_ids.__doc__ or "request" in BlockTables.append_block_ids.__doc__
    assert bt.append_block_ids_batch.__self__ is bt.append_block_ids


@pytest.mark.parametrize(
    "form",
    ["positional", "overwrite-keyword", "all-keywords", "numpy-bool", "tuple-groups", "numpy-ids"],
)
def test_every_call_form_stages_what_the_python_path_stages(form, monkeypatch):
    compiled, python = _tables(), _python_tables(monkeypatch)
    for bt in (compiled, python):
        calls = _random_calls(random.Random(7), 40)
        for req, ids, overwrite in calls:
            if form == "positional":
                bt.append_block_ids(req, ids, overwrite)
            elif form == "overwrite-keyword":
                bt.append_block_ids(req, ids, overwrite=overwrite)
            elif form == "all-keywords":
                bt.append_block_ids(overwrite=overwrite, new_block_ids=ids, req_index=req)
            elif form == "numpy-bool":
                bt.append_block_ids(req, ids, np.bool_(overwrite))
            elif form == "tuple-groups":
                bt.append_block_ids(req, tuple(tuple(g) for g in ids), overwrite)
            else:
                bt.append_block_ids(req, [np.asarray(g, dtype=np.int64) for g in ids], overwrite)
    for got, want in zip(_staged(compiled), _staged(python)):
        np.testing.assert_array_equal(got, want)
    compiled.apply_staged_writes()
    python.apply_staged_writes()
    for a, b in zip(compiled.block_tables, python.block_tables):
        assert torch.equal(a.tensor, b.tensor)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((1, [[1], [2], [3]], "no"), {}, StagedWriteError, "overwrite must be a bool"),
        ((1, [[1], [2], [3]], None), {}, StagedWriteError, "overwrite must be a bool"),
        ((1, [[1], [2], [3]], 1), {}, StagedWriteError, "overwrite must be a bool"),
        ((1, [[1], [2], [3]], True), {"extra": 1}, TypeError, "extra"),
        ((1, [[1], [2], [3]], True, 4), {}, TypeError, "positional"),
        ((1, [[1], [2], [3]]), {}, TypeError, "overwrite"),
        ((1, [[1], [2], [3]]), {"req_index": 1, "overwrite": True}, TypeError, "req_index"),
        ((True, [[1], [2], [3]], True), {}, StagedWriteError, "bool"),
        ((REQS, [[1], [2], [3]], True), {}, StagedWriteError, f"outside [0, {REQS})"),
        ((1, [[1], [2]], True), {}, StagedWriteError, "got block ids for 2 KV-cache groups"),
        ((1, [[-1], [2], [3]], True), {}, StagedWriteError, "-1"),
        ((1, [[True], [2], [3]], True), {}, StagedWriteError, "bool"),
        ((1, [[1] * 7, [2], [3]], True), {}, StagedWriteError, "past the row width"),
    ],
)
def test_calls_the_compiled_path_declines_get_the_methods_errors_and_stage_nothing(args, kwargs, error, words):
    bt = _tables()
    bt.append_block_ids(2, [[9], [8], [7]], True)
    before = _staged(bt)
    with pytest.raises(error) as info:
        bt.append_block_ids(*args, **kwargs)
    assert words in str(info.value)
    for got, want in zip(_staged(bt), before):
        np.testing.assert_array_equal(got, want)


def test_a_subclass_that_overrides_append_block_ids_is_called():
    seen = []

    class Logged(BlockTables):
        def append_block_ids(self, req_index, new_block_ids, overwrite):
            seen.append(req_index)
            super().append_block_ids(req_index, new_block_ids, overwrite)

    bt = Logged(BS, REQS, WIDTHS, "cpu", KBS, backend="torch-cpu")
    bt.append_block_ids(3, [[1], [2], [3]], True)
    bt.append_block_ids_batch([4, 5], [[[1], [], []], [[2], [3], [4]]], True)
    assert seen == [3, 4, 5]
    assert bt.num_blocks[:, 3].tolist() == [1, 2, 1] and bt.num_blocks[:, 5].tolist() == [1, 2, 1]


def test_the_compiled_callable_does_not_keep_its_tables_alive():
    bt = _tables()
    append = bt.append_block_ids
    ref = weakref.ref(bt)
    del bt
    gc.collect()
    assert ref() is None
    with pytest.raises(ReferenceError, match="no longer exists"):
        append(0, [[], [], []], "not a bool")  # (a call it hands to the method, which needs the tables)


def test_growing_the_arena_mid_step_keeps_every_staged_write():
    bt, ref = _tables(), ReferenceBlockTables(BS, REQS, WIDTHS, KBS)
    # 64 metadata rows and 1024 values at first: a step of 40 requests x 4 writes outgrows both.
    for i in range(40):
        ids = [[(i * 7 + g) % 900 for _ in range(WIDTHS[g] if i % 2 else 1)] for g in range(3)]
        bt.append_block_ids(i % REQS, ids, True)
        ref.append_block_ids(i % REQS, ids, True)
    bt.apply_staged_writes()
    ref.apply_staged_writes()
    for g, (t, want) in enumerate(zip(bt.block_tables, ref.tables)):
        counts = ref.num_blocks[g]
        got = t.tensor.numpy()
        for r in range(REQS):
            np.testing.assert_array_equal(got[r, : counts[r]], want[r, : counts[r]])
    np.testing.assert_array_equal(bt.num_blocks, ref.num_blocks)


# -- append_block_ids_batch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", ["one-bool", "list", "tuple-of-numpy-bools"])
def test_a_batch_stages_exactly_what_its_calls_stage(flags, monkeypatch):
    calls = _random_calls(random.Random(11), 60)
    reqs, ids, overwrite = [c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls]
    if flags == "one-bool":
        calls = [(r, i, True) for r, i, _ in calls]  # (every call's ids fit from column 0)
        overwrite_arg = True
    elif flags == "list":
        overwrite_arg = overwrite
    else:
        overwrite_arg = tuple(np.bool_(o) for o in overwrite)
    one_by_one, python = _tables(), _python_tables(monkeypatch)
    batched = _tables()
    batched.append_block_ids_batch(reqs, ids, overwrite_arg)
    python.append_block_ids_batch(reqs, ids, overwrite_arg)
    for req, i, o in calls:
        one_by_one.append_block_ids(req, i, o)
    for other in (one_by_one, python):
        for got, want in zip(_staged(batched), _staged(other)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_batch_with_a_bad_call_keeps_the_calls_before_it_and_makes_none_after(path, monkeypatch):
    bt = _tables() if path == "compiled" else _python_tables(monkeypatch)
    good = [[1], [2], [3]]
    with pytest.raises(StagedWriteError, match=f"request row {REQS} is outside") as info:
        bt.append_block_ids_batch([0, 1, REQS, 2], [good, good, good, good], True)
    # The error says which call failed and what stays staged, and keeps the call's own error as its cause.
    assert str(info.value).startswith(
        f"append_block_ids_batch: call 2 of 4 (request row {REQS}) failed; the 2 calls before it stay staged"
    )
    assert isinstance(info.value.__cause__, StagedWriteError) and str(info.value).endswith(str(info.value.__cause__))
    assert bt.num_blocks[:, :3].T.tolist() == [[1, 2, 1], [1, 2, 1], [0, 0, 0]]
    assert bt._arena.num_writes == 8  # two calls x (3 groups + the counts row)


def test_a_batch_failure_keeps_the_type_of_the_calls_error():
    error = TypeError("boom")
    failure = block_tables_module._batch_failure(error, 3, 5, 7)
    assert type(failure) is TypeError and failure.__cause__ is error
    assert str(failure) == (
        "append_block_ids_batch: call 3 of 5 (request row 7) failed; the 3 calls before it stay staged, it and the "
        "calls after it were not staged: boom"
    )
    interrupt = KeyboardInterrupt()  # not an input error: raised as it is
    assert block_tables_module._batch_failure(interrupt, 0, 1, 0) is interrupt


@pytest.mark.parametrize(
    ("reqs", "ids", "overwrite", "words"),
    [
        ([0, 1], [[[1], [2], [3]]], True, "2 request rows, 1 lists of block ids"),
        ([0], [[[1], [2], [3]]], [True, False], "and 2 overwrite flags"),
        ([0], [[[1], [2], [3]]], "yes", "overwrite must be a bool or one bool per call"),
        ([0], [[[1], [2], [3]]], None, "overwrite must be a bool or one bool per call"),
    ],
)
def test_a_batch_whose_lists_disagree_is_refused_before_anything_is_staged(reqs, ids, overwrite, words):
    bt = _tables()
    with pytest.raises(StagedWriteError, match="append_block_ids_batch") as info:
        bt.append_block_ids_batch(reqs, ids, overwrite)
    assert words in str(info.value)
    assert bt._arena.num_writes == 0 and not bt.num_blocks.any()


def test_a_batch_of_other_iterables_goes_through_the_method():
    bt = _tables()
    bt.append_block_ids_batch(np.array([3, 4]), ([[1], [2], [3]], [[4], [5], [6]]), [True, np.bool_(True)])
    assert bt.num_blocks[:, 3].tolist() == [1, 2, 1] and bt.num_blocks[:, 4].tolist() == [1, 2, 1]


# -- the lent ring's rotation and graph mode's commit (Triton backend through the interpreter) ----------------
try:
    from multiwrite.backends import triton_kernel
except ImportError:  # pragma: no cover - no Triton installed
    triton_kernel = None
#: The Triton backend on CPU tensors runs through Triton's interpreter only (on a GPU machine: tests/gpu).
interpreted = pytest.mark.skipif(
    triton_kernel is None or not triton_kernel.INTERPRETED, reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


def _triton_tables(**kw) -> BlockTables:
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    return _tables(backend=TritonCudaBackend(ring_depth=4), **kw)


@interpreted
def test_the_rotation_hands_the_arena_the_next_released_slot():
    bt = _triton_tables()
    bt.append_block_ids(0, [[1], [2], [3]], True)
    bt.apply_staged_writes()  # attaches the lent ring; the arena now stages into slot `current`
    arena, lender = bt._arena, bt._arena.lender
    ring = lender.ring
    for _ in range(2 * ring.depth):  # every slot once through the Python acquire (fills `_Slot.lent`), then in C
        before = lender.current
        bt.append_block_ids(1, [[4], [5], [6]], True)
        bt.apply_staged_writes()
        i = lender.current
        assert i == (before + 1) % ring.depth and ring.next == (i + 1) % ring.depth
        slot = ring.slots[i]
        assert arena.meta_addr == slot.meta_addr and arena.values_addr == slot.values_addr
        assert arena.meta.ctypes.data == slot.meta_addr and arena.values.ctypes.data == slot.values_addr
        assert arena.meta_cap == arena.meta.shape[0] and arena.values_cap == arena.values.shape[0]
        assert arena.meta_bytes.obj is not None and arena.values_flat.format == "i"


@interpreted
def test_the_rotation_declines_a_slot_still_in_use_or_too_small_and_changes_nothing():
    bt = _triton_tables()
    bt.append_block_ids(0, [[1], [2], [3]], True)
    for _ in range(8):
        bt.apply_staged_writes()
        bt.append_block_ids(0, [[1], [2], [3]], True)
    bt.clear_staged_writes()
    arena, lender = bt._arena, bt._arena.lender
    ring = lender.ring
    state = (lender.current, ring.next, arena.meta_addr, arena.values_addr, arena.meta_cap, arena.values_cap)
    j = ring.next
    ring.tokens[j] += 1  # its kernel has not stored the token yet
    assert staging_module._rotate_lent(arena, lender) is False
    ring.tokens[j] -= 1
    saved, ring.slots[j].lent = ring.slots[j].lent, None  # a slot the Python path has not lent yet (or grown)
    assert staging_module._rotate_lent(arena, lender) is False
    ring.slots[j].lent = saved[:6] + (saved[6] - 1, saved[7])  # smaller than what the arena holds now
    arena.meta_cap = saved[6]
    assert staging_module._rotate_lent(arena, lender) is False
    ring.slots[j].lent = saved
    assert (lender.current, ring.next, arena.meta_addr, arena.values_addr, arena.values_cap) == (
        state[0], state[1], state[2], state[3], state[5]
    )
    assert staging_module._rotate_lent(arena, lender) is True and lender.current == j


def _graph_pair(monkeypatch):
    compiled = _triton_tables(cuda_graphs=True)
    from multiwrite.backends.triton_cuda import TritonCudaBackend

    python = _python_tables(monkeypatch, backend=TritonCudaBackend(ring_depth=4), cuda_graphs=True)
    assert compiled._fast_commit is not None and python._fast_commit is None
    return compiled, python


def _header(bt: BlockTables, h: int) -> list[int]:
    from multiwrite.backends.triton_graph import ENTRY_WORDS

    g = bt._graph
    first = (h % g.depth) * ENTRY_WORDS.value
    return g.headers[first : first + 8].tolist()


def test_the_compiled_commit_lays_out_header_entries_as_the_graph_stage_does():
    """The C commit's layout constants are the kernel's: a mismatch would make it silently fall back to Python."""
    pytest.importorskip("triton")
    from multiwrite.backends import triton_graph

    from multiwrite import _cstaging

    assert (_cstaging.GRAPH_ENTRY_WORDS, _cstaging.GRAPH_INLINE_WRITES, _cstaging.GRAPH_INLINE_VALUES,
            _cstaging.GRAPH_INLINE_BIT) == (
        triton_graph.ENTRY_WORDS.value, triton_graph.FEW_WRITES.value, triton_graph.PRELOADED_VALUES.value,
        triton_graph.INLINE_BIT,
    )
    assert triton_graph.GraphStage.C_COMMIT is True


@interpreted
def test_the_compiled_commit_publishes_the_header_the_python_commit_publishes(monkeypatch):
    from multiwrite.backends.triton_graph import inline_checksum

    compiled, python = _graph_pair(monkeypatch)
    calls = _random_calls(random.Random(5), 30)
    for step in range(0, 30, 3):
        for bt in (compiled, python):
            slots_before = (bt._arena.lender.current if bt._arena.lender else None, bt._arena.meta_addr)
            for req, ids, overwrite in calls[step : step + 3]:
                bt.append_block_ids(req, ids, overwrite)
            wrote, n_values = bt._arena.num_writes, bt._arena.num_values
            meta_addr, values_addr, overlap = bt._arena.meta_addr, bt._arena.values_addr, bt._arena.may_overlap
            meta, values = bt._arena.meta[:wrote].copy(), bt._arena.values[:n_values].copy()
            h = bt.commit_staged_writes()
            words = _header(bt, h)
            assert words[0] == h + 1 and words[6] & 0xFFFFFFFF == wrote
            assert not wrote or overlap or words[6] < 0  # inline (the sign bit), unless writes overlap
            if wrote and words[6] < 0:  # decode-sized: the batch travels in its header entry, and the arena
                # keeps its ring slot
                assert words[1:5] == [0] * 4 and (words[6] >> 32) & 0x7FFFFFFF == 1 and words[7] == n_values
                assert words[5] == inline_checksum(meta, values) != 0
                e = h % bt._graph.depth
                np.testing.assert_array_equal(bt._graph.inline_meta[e, :, :wrote], meta.T)
                np.testing.assert_array_equal(bt._graph.inline_values[e, :n_values], values)
                assert bt._arena.meta_addr == slots_before[1] and bt._arena.num_writes == 0
            elif wrote:  # overlapping writes in several rounds: the batch stays in the ring slot
                i = (bt._arena.lender.current - 1) % bt._arena.lender.ring.depth
                ring = bt._arena.lender.ring
                assert words[1:5] == [meta_addr, values_addr, ring.slots[i].bounds_addr, ring.done_addr[i]]
                assert words[5] == ring.tokens[i] and words[7] == n_values
                assert bt._arena.meta_addr != slots_before[1] and bt._arena.num_writes == 0
            bt._graph.launch(-1)  # the replay: consumes exactly this header
        hc, hp = _header(compiled, step // 3), _header(python, step // 3)
        assert (hc[0], hc[5], hc[6], hc[7]) == (hp[0], hp[5], hp[6], hp[7])
        if hc[6] < 0:  # inline: the same entry, addresses included (none)
            e = (step // 3) % compiled._graph.depth
            assert hc == hp
            np.testing.assert_array_equal(compiled._graph.inline_meta[e], python._graph.inline_meta[e])
            np.testing.assert_array_equal(compiled._graph.inline_values[e], python._graph.inline_values[e])
        assert compiled._context_view[block_tables_module._CTX_EPOCH] == python._context_view[
            block_tables_module._CTX_EPOCH
        ]
    for a, b in zip(compiled.block_tables, python.block_tables):
        assert torch.equal(a.tensor, b.tensor)
    np.testing.assert_array_equal(compiled.num_blocks_device.numpy(), python.num_blocks_device.numpy())


@interpreted
def test_the_compiled_commit_takes_the_common_case_and_hands_over_the_rest(monkeypatch):
    bt = _triton_tables(cuda_graphs=True)
    graph = bt._graph
    python_commits = []
    real = graph.commit
    monkeypatch.setattr(graph, "commit", lambda arena: python_commits.append(arena.num_writes) or real(arena))
    bt.append_block_ids(0, [[1], [2], [3]], True)
    bt.commit_staged_writes()  # the first slot the arena rotates into was never lent through Python
    graph.launch(-1)
    for _ in range(graph.ring.depth):
        bt.append_block_ids(1, [[1], [2], [3]], True)
        bt.commit_staged_writes()
        graph.launch(-1)
    n_python = len(python_commits)
    bt.append_block_ids(2, [[4], [5], [6]], True)
    bt.commit_staged_writes()  # common case: compiled
    graph.launch(-1)
    assert len(python_commits) == n_python
    bt.append_block_ids(2, [[4], [5], [6]], True)
    bt.append_block_ids(2, [[7], [8], [9]], False)  # the same rows twice: overlap rounds, the Python commit
    bt.commit_staged_writes()
    graph.launch(-1)
    assert python_commits[-1] == 8 and len(python_commits) == n_python + 1
    assert bt.block_tables[0].tensor[2, :2].tolist() == [4, 7]
    assert bt.block_tables[1].tensor[2, :4].tolist() == [10, 11, 16, 17]


@interpreted
def test_the_compiled_commit_of_a_batch_too_big_for_its_entry_hands_over_the_ring_slot(monkeypatch):
    """A batch of more values than a header entry holds (a prefill) stays in its ring slot: the header points at
    it and the arena rotates, in C once every slot has been lent through Python; every replay applies it."""
    from multiwrite.backends.triton_cuda import TritonCudaBackend
    from multiwrite.backends.triton_graph import PRELOADED_VALUES

    bt = BlockTables([16], 4, [400], "cpu", [16], backend=TritonCudaBackend(ring_depth=4), cuda_graphs=True)
    graph = bt._graph
    python_commits = []
    real = graph.commit
    monkeypatch.setattr(graph, "commit", lambda arena: python_commits.append(arena.num_writes) or real(arena))
    n = PRELOADED_VALUES.value + 44
    for step in range(3 * graph.ring.depth):
        ids = list(range(step * 1000, step * 1000 + n))
        meta_addr, values_addr = bt._arena.meta_addr, bt._arena.values_addr
        bt.append_block_ids(step % 4, [ids], True)
        h = bt.commit_staged_writes()
        words = _header(bt, h)
        assert words[6] >= 0 and words[1:3] == [meta_addr, values_addr] and words[7] > PRELOADED_VALUES.value
        assert bt._arena.meta_addr != meta_addr and bt._arena.num_writes == 0  # rotated into the next slot
        graph.launch(-1)
        assert bt.block_tables[0].tensor[step % 4, :n].tolist() == ids and bt.num_blocks[0, step % 4] == n
    assert len(python_commits) <= graph.ring.depth  # after one ring of slots lent through Python: compiled


# -- attacks on the compiled paths (each verified to fail before its fix) -------------------------------------
def test_the_compiled_callable_refuses_every_call_once_its_tables_are_gone():
    # The C path stores into the tables' host arrays (num_blocks, stamps) by address: once the BlockTables is
    # gone they are freed, so every call, not only those handed to the method, must raise.
    bt = _tables()
    append, batch, arena = bt.append_block_ids, bt.append_block_ids_batch, bt._arena
    del bt
    gc.collect()
    with pytest.raises(ReferenceError, match="no longer exists"):
        append(0, [[1], [2], [3]], True)
    with pytest.raises(ReferenceError, match="no longer exists"):
        batch([0], [[[1], [2], [3]]], True)
    with pytest.raises(ReferenceError, match="no longer exists"):
        batch([], [], True)
    assert arena.num_writes == 0 and arena.num_values == 0


@pytest.mark.parametrize("form", ["all-keywords", "overwrite-keyword"])
def test_a_batch_takes_its_documented_keywords(form, monkeypatch):
    calls = _random_calls(random.Random(3), 20)
    reqs, ids, overwrite = [c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls]
    compiled, python = _tables(), _python_tables(monkeypatch)
    for bt in (compiled, python):
        if form == "all-keywords":
            bt.append_block_ids_batch(overwrite=overwrite, new_block_ids=ids, req_indices=reqs)
        else:
            bt.append_block_ids_batch(reqs, ids, overwrite=overwrite)
    for got, want in zip(_staged(compiled), _staged(python)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        compiled.append_block_ids_batch(reqs, ids, overwrite, extra=1)


class _Shrinking:
    """A request row whose `__index__` empties the batch's list of rows (the Python fallback runs it)."""

    def __init__(self, rows: list, row: int):
        self.rows, self.row = rows, row

    def __index__(self) -> int:
        self.rows.clear()
        return self.row


@pytest.mark.parametrize("flags", ["one-bool", "list"])
def test_a_batch_whose_lists_change_while_staging_stages_what_the_method_stages(flags, monkeypatch):
    results = []
    for bt in (_tables(), _python_tables(monkeypatch)):
        reqs = [0, None, 2, 3]
        reqs[1] = _Shrinking(reqs, 1)
        bt.append_block_ids_batch(reqs, [[[1], [2], [3]]] * 4, True if flags == "one-bool" else [True] * 4)
        results.append(_staged(bt))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    assert results[0][3][:, :4].T.tolist() == [[1, 2, 1], [1, 2, 1], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("compiled", [True, False])
def test_a_rejected_call_leaves_no_stamp_that_would_mark_the_next_call_overlapping(compiled, monkeypatch):
    # Group 0's ids are fine, group 1's id is negative: the call is refused after group 0 was looked at. Its
    # (table, row) stamps must not survive, or the next (valid) call on that row reads as an overlap, which sends
    # the apply into rounds, the graph commit to Python and the direct prepare_inputs to the general path.
    bt = _tables() if compiled else _python_tables(monkeypatch)
    stamps = bt._stamps.copy()
    with pytest.raises(StagedWriteError, match="block id -1 is negative"):
        bt.append_block_ids(1, [[5], [-1], [6]], True)
    np.testing.assert_array_equal(bt._stamps, stamps)
    bt.append_block_ids(1, [[5], [7], [6]], True)
    assert bt._arena.may_overlap is False


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_block_tables_refuses_to_be_copied_or_pickled(how):
    # A copy would share (shallow) or duplicate (deep) the device tables, the pinned staging slots and the compiled
    # staging callable, which stays bound to the original: the copy would stage into the original's arena, and
    # raise ReferenceError once the original is gone. Refused with a clear error instead.
    import copy
    import pickle

    bt = _tables()
    bt.append_block_ids(1, [[1], [2], [3]], True)
    do = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match="BlockTables cannot be copied or pickled"):
        do(bt)
    assert bt._arena.num_writes == 4
