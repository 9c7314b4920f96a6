"""`BlockTables` through its public API: construction, `num_blocks` on the host (as staged) and on the device (as
of the last apply), `clear_staged_writes` restoring the counts from host copies, tables that cannot be replaced or
resized, copies and pickles refused, one backend call per apply, a failing backend or an interrupt with every write
and count kept (and a retry landing them exactly), distinct tables from eight threads, and a long random replay
against `multiwrite.reference.ReferenceBlockTables` on every backend and both staging paths.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from multiwrite import BackendError, BlockTables, FusedStagedWriter, StagedWriteError
from multiwrite.reference import ReferenceBlockTables
from multiwrite.stage.layout import TablesLayout
from multiwrite.testing.staging import block_tables_class
from tests.support.backends import HalfFailingBackend, RecordingBackend
from tests.support.tables import CPU, host, mismatches
from tests.support.threads import run_interleaved

I32, I64 = torch.int32, torch.int64


def small(staging: str = "default", backend=CPU, device="cpu", **kw) -> BlockTables:
    """Two groups of 4 blocks, 4 request rows."""
    return block_tables_class(staging)([16, 16], 4, [4, 4], device, backend=backend, **kw)


# -- construction ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (("16", 4, [10], "cpu"), {}, "BlockTables: block_sizes must be a sequence of integers, got '16'"),
        (([], 4, [], "cpu"), {}, "BlockTables: at least one KV-cache group is needed"),
        (([True], 2, [10], "cpu"), {}, "BlockTables: block_sizes must be integers, got [True]"),
        (([16.7], 2, [4], "cpu"), {}, "BlockTables: block_sizes must be integers, got [16.7]"),
        (([16], 4.0, [10], "cpu"), {}, "BlockTables: max_num_reqs must be an integer, got 4.0"),
        (([16], True, [10], "cpu"), {}, "BlockTables: max_num_reqs must be an integer, got True"),
        (([16], 0, [10], "cpu"), {}, "BlockTables: max_num_reqs must be >= 1, got 0"),
        (([16], 2, [0], "cpu"), {}, "BlockTables: max_num_blocks_per_group must be >= 1, got [0]"),
        (([16], 2, [-1], "cpu"), {}, "BlockTables: max_num_blocks_per_group must be >= 1, got [-1]"),
        (([16, 16], 2, [4], "cpu"), {}, "BlockTables: max_num_blocks_per_group has 1 entries for 2 KV-cache groups"),
        (([16, 32], 2, [4, 4], "cpu", [16]), {}, "BlockTables: kernel_block_sizes has 1 entries for 2 KV-cache groups"),
        (([16, 24], 2, [4, 4], "cpu", [16, 16]), {}, "BlockTables: group 1 block size 24 is not a positive multiple "
                                                     "of its kernel block size 16"),
        (([16, 16], 2, [4, 4], "cpu", [16, 64]), {}, "group 1 block size 16 is not a positive multiple of its kernel "
                                                     "block size 64"),
    ],
)  # fmt: skip
def test_the_constructor_refuses_sizes_that_do_not_fit_and_shows_what_was_passed(args, kwargs, fragment):
    with pytest.raises(StagedWriteError) as info:
        BlockTables(*args, backend=CPU, **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("blocks", "kernel", "fragment"),
    [
        ([2**31], [16], "BlockTables: group 0 row width 2147483648 blocks x 1 kernel blocks = 2147483648 is past "
                        "2**31 - 1"),
        ([2**30], [8], "BlockTables: group 0 row width 1073741824 blocks x 2 kernel blocks = 2147483648 is past"),
    ],
)  # fmt: skip
def test_a_row_width_past_int32_is_refused_before_anything_is_allocated(blocks, kernel, fragment):
    # The check BlockTables runs first (`TablesLayout.build`), on the meta device: were it missing, nothing of the
    # gigabytes would be allocated (BlockTables itself refuses `meta`: no backend serves it).
    with pytest.raises(StagedWriteError) as info:
        TablesLayout.build([16], 2, blocks, torch.device("meta"), kernel)
    assert fragment in str(info.value)


def test_the_sizes_and_tables_are_as_built():
    bt = BlockTables([16, 32, 8], 3, [5, 3, 9], "cpu", [16, 16, 8], backend=CPU)
    assert (bt.num_groups, bt.max_num_reqs, bt.device, bt.backend.NAME) == (3, 3, torch.device("cpu"), CPU)
    assert bt.kernel_blocks_per_block == [1, 2, 1] and bt.max_num_blocks_per_group == [5, 3, 9]
    assert [t.tensor.shape for t in bt.block_tables] == [(3, 5), (3, 6), (3, 9)]
    assert all(t.tensor.dtype == I32 and not t.tensor.any() for t in bt.block_tables)
    assert [t.kernel_blocks_per_block for t in bt.block_tables] == [1, 2, 1] and bt[1] is bt.block_tables[1]
    assert bt.num_blocks.shape == (3, 3) and bt.num_blocks.dtype == np.int32 and bt.num_blocks_device.shape == (3, 3)
    assert bt.slot_mappings is None and bt.cuda_graphs is False and bt.graph is None


# -- num_blocks and clear -------------------------------------------------------------------------------------
def test_num_blocks_is_staged_on_the_host_and_lands_on_the_device_with_the_apply(backend, staging):
    bt = small(staging, backend.name, backend.device)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    assert bt.num_blocks[:, 0].tolist() == [2, 1] and host(bt.num_blocks_device).sum() == 0
    bt.apply_staged_writes()
    assert host(bt.num_blocks_device)[:, 0].tolist() == [2, 1]
    bt.num_blocks_device.fill_(99)  # what a stream still busy with another apply would show: never read
    bt.append_block_ids(0, ([4], [5]), False)
    bt.append_block_ids(2, ([6], []), True)
    assert bt.num_blocks[:, :3].tolist() == [[3, 0, 1], [2, 0, 0]]
    bt.clear_staged_writes()  # from the host copies of the last apply's counts
    assert bt.num_blocks[:, :3].tolist() == [[2, 0, 0], [1, 0, 0]]
    assert [t.num_staged_writes for t in bt.block_tables] == [0, 0]
    bt.clear_staged_writes()  # nothing staged: nothing changes
    assert bt.num_blocks[:, :3].tolist() == [[2, 0, 0], [1, 0, 0]]
    bt.num_blocks_device.zero_()
    bt.append_block_ids(0, ([7], []), False)  # goes after the two blocks of the last apply
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0, :4].tolist() == [1, 2, 7, 0] and host(bt[1].tensor)[0, :2].tolist() == [3, 0]
    assert host(bt.num_blocks_device).tolist() == bt.num_blocks.tolist() == [[3, 0, 0, 0], [1, 0, 0, 0]]
    assert host(bt[0].tensor)[2].sum() == 0  # the cleared overwrite of row 2 never landed


def test_a_clear_after_a_refused_apply_restores_the_last_applied_counts(staging):
    bt = small(staging)
    bt.append_block_ids(1, ([1], [2]), True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([3], []), False)
    bt.append_block_ids(3, ([4], [5]), True)
    bt[0].tensor.resize_(4, 2)
    with pytest.raises(StagedWriteError, match="resized in place"):
        bt.apply_staged_writes()
    bt.clear_staged_writes()
    assert bt.num_blocks.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]


# -- the tables are fixed ---------------------------------------------------------------------------------------
def test_a_group_cannot_be_replaced(staging):
    bt = small(staging)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    old = bt[0].tensor
    storage = torch.zeros(12, dtype=I32)
    with pytest.raises(StagedWriteError, match=r"group 0 \(shape \(4, 4\)\): a BlockTables' tables cannot be replaced "
                                               "or resized: every group's table and num_blocks share one allocation; "
                                               "build a new BlockTables with the new sizes"):  # fmt: skip
        bt[0].tensor = storage[:8].view(4, 2)
    assert bt[0].tensor is old and bt[0].num_staged_writes == 1 and not storage.any()
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[0].tolist() == [1, 2, 0, 0] and host(bt.num_blocks_device)[:, 0].tolist() == [2, 1]


def _prepare(bt: BlockTables) -> None:
    bt.prepare_inputs(torch.tensor([0], dtype=I32), torch.tensor([0, 1], dtype=I32), torch.tensor([0]), 1, 1)


CHANGES = {
    "shrink-columns": lambda bt: bt[0].tensor.resize_(4, 2),
    "shrink-rows": lambda bt: bt[0].tensor.resize_(2, 4),
    "grow": lambda bt: bt[0].tensor.resize_(4, 6),  # over the next group's memory
    "set_": lambda bt: bt[0].tensor.set_(torch.zeros(4, 4, dtype=I32)),  # other memory, same shape
    "transpose": lambda bt: bt[0].tensor.t_(),  # same shape, other strides
    "num_blocks-set_": lambda bt: bt.num_blocks_device.set_(torch.zeros(2, 4, dtype=I32)),
}
JOBS = {
    "apply_staged_writes": lambda bt: bt.apply_staged_writes(),
    "prepare_inputs": _prepare,
    "gather_block_tables": lambda bt: bt.gather_block_tables(torch.tensor([0], dtype=I32), 1),
    "a writer": lambda bt: FusedStagedWriter("cpu", CPU).apply([bt[1]]),
}


@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_table_resized_in_place_is_refused_by_the_next_job_with_every_write_kept(change, job):
    bt = small(max_num_batched_tokens=4)
    bt.append_block_ids(1, ([5], [6]), True)
    bt.apply_staged_writes()
    before = [host(t.tensor).copy() for t in bt.block_tables[1:]], host(bt.num_blocks_device).copy()
    bt.append_block_ids(0, ([1, 2, 3], [4]), True)
    counts = bt.num_blocks.copy()
    CHANGES[change](bt)
    what = "num_blocks" if change.startswith("num_blocks") else "group 0"
    with pytest.raises(StagedWriteError, match=rf"{what} of a BlockTables was resized in place \(.*\): it cannot be "
                                               "resized or moved, the tables and num_blocks of a BlockTables share one "
                                               "allocation.* Nothing was written and every staged write stays "
                                               "staged"):  # fmt: skip
        JOBS[job](bt)
    # nothing written anywhere (the other group and num_blocks included), everything still staged
    assert [host(t.tensor).tolist() for t in bt.block_tables[1:]] == [t.tolist() for t in before[0]]
    if not change.startswith("num_blocks"):
        assert host(bt.num_blocks_device).tolist() == before[1].tolist()
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1] and (bt.num_blocks == counts).all()
    assert host(bt.input_block_tables[0]).sum() == 0 and (host(bt.slot_mappings) == -1).all()


OUTPUT_CHANGES = {
    "slot_mappings-set_": (
        lambda bt: bt.slot_mappings.set_(torch.full((2, 4), 555, dtype=torch.int64, device=bt.device)),
        "slot_mappings",
    ),
    "input_block_tables-set_": (
        lambda bt: bt.input_block_tables[1].set_(torch.zeros(4, 4, dtype=I32, device=bt.device)),
        "input_block_tables\\[1\\]",
    ),
    "slot_mappings-resize_": (lambda bt: bt.slot_mappings.resize_(2, 2), "slot_mappings"),
}
STAGE_JOBS = {
    "prepare_inputs": _prepare,
    "gather_block_tables": JOBS["gather_block_tables"],
    "compute_slot_mappings": lambda bt: bt.compute_slot_mappings(torch.tensor([0], dtype=I32),
                                                                 torch.tensor([0, 1], dtype=I32), torch.tensor([0]), 1),
    "get_dummy_block_tables": lambda bt: bt.get_dummy_block_tables(2),  # (they write the outputs too)
    "get_dummy_slot_mappings": lambda bt: bt.get_dummy_slot_mappings(2),
}  # fmt: skip


@pytest.mark.parametrize("job", list(STAGE_JOBS))
@pytest.mark.parametrize("change", list(OUTPUT_CHANGES))
def test_outputs_moved_in_place_are_refused_by_the_next_stage_job_with_every_write_kept(backend, change, job):
    """`input_block_tables` and `slot_mappings` are written by address (a kernel, a captured graph): after a `set_`
    or `resize_` in place the next stage job refuses, naming the output, and writes nothing (the earlier design
    wrote through the old address: into freed memory)."""
    bt = BlockTables([16, 32], 4, [4, 2], backend.device, [16, 16], backend=backend.name, max_num_batched_tokens=4)
    bt.append_block_ids(0, ([1, 2], [3]), True)
    change_fn, what = OUTPUT_CHANGES[change]
    change_fn(bt)
    with pytest.raises(StagedWriteError, match=rf"{what} of a BlockTables was resized in place \(.*\): it cannot be "
                                               "resized or moved.*every staged write stays staged"):  # fmt: skip
        STAGE_JOBS[job](bt)
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1] and not host(bt[0].tensor).any()


@pytest.mark.parametrize("job", ["apply_staged_writes", "prepare_inputs"])
def test_a_torch_write_into_the_tables_is_no_resize(job):
    bt = small(max_num_batched_tokens=4)
    bt.append_block_ids(0, ([1], [2]), True)
    bt.apply_staged_writes()
    bt[1].tensor[3, 3] = 77  # bumps the version counter; the layout is the same
    bt.num_blocks_device[1, 3] = 4
    bt.append_block_ids(0, ([3], []), False)
    JOBS[job](bt)
    assert host(bt[0].tensor)[0, :2].tolist() == [1, 3] and host(bt[1].tensor)[3, 3] == 77


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_a_block_tables_refuses_to_be_copied_or_pickled(staging, how):
    bt = small(staging)
    bt.append_block_ids(1, ([1], [2]), True)
    with pytest.raises(TypeError, match="a BlockTables cannot be copied or pickled: it owns its device tables and "
                                        "staging memory that kernels read; build a new BlockTables"):  # fmt: skip
        how(bt)
    assert [t.num_staged_writes for t in bt.block_tables] == [1, 1]
    bt.apply_staged_writes()
    assert host(bt.num_blocks_device)[:, 1].tolist() == [1, 1]


# -- one backend call; failures -------------------------------------------------------------------------------
def test_an_apply_is_one_backend_call_with_every_group_and_the_counts():
    recorder = RecordingBackend()
    bt = BlockTables([16, 32, 8, 16], 4, [4, 4, 4, 4], "cpu", [16, 16, 8, 16], backend=recorder,
                     max_num_batched_tokens=4)  # fmt: skip
    for req in range(4):
        bt.append_block_ids(req, ([req + 1], [req + 10], [req + 20, req + 21], [req + 30]), overwrite=True)
    bt.apply_staged_writes()
    (batch,) = recorder.calls[0]  # one call, one batch (one dtype)
    assert len(recorder.calls) == 1 and batch.num_tables == 5  # four groups and num_blocks
    assert batch.meta.shape[0] == 4 * 4 + 4  # per request: one write per group and one of its counts
    assert batch.writes()[:5] == [(0, 0, 0, [1]), (1, 0, 0, [20, 21]), (2, 0, 0, [20, 21]), (3, 0, 0, [30]),
                                  (4, 0, 0, [1, 2, 2, 1])]  # fmt: skip
    assert host(bt.num_blocks_device)[:, 3].tolist() == [1, 2, 2, 1]
    assert host(bt[3].tensor)[:, 0].tolist() == [30, 31, 32, 33]
    bt.apply_staged_writes()  # nothing staged: the backend is not called
    _prepare(bt)
    assert len(recorder.calls) == 1


@pytest.mark.parametrize("job", ["apply_staged_writes", "prepare_inputs"])
def test_a_backend_failure_is_a_backend_error_and_a_retry_lands_every_write(staging, job):
    failing = HalfFailingBackend()
    bt = block_tables_class(staging)([16, 32, 16], 4, [4, 4, 4], "cpu", [16, 16, 16], backend=failing,
                                     max_num_batched_tokens=4)  # fmt: skip
    ref = ReferenceBlockTables([16, 32, 16], 4, [4, 4, 4], [16, 16, 16])
    calls = [(0, ([1, 2], [3], [4]), True), (1, ([5], [], [6, 7]), True), (0, ([8], [9], []), False)]
    for call in calls:
        bt.append_block_ids(*call)
        ref.append_block_ids(*call)
    with pytest.raises(BackendError) as info:
        JOBS[job](bt)
    assert "backend 'half-failing' (tests.support.backends.HalfFailingBackend) failed applying 11 staged writes " \
           "to group 0, group 1, group 2, num_blocks on cpu: RuntimeError: lost the device half-way" \
           in str(info.value)  # fmt: skip
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.backend is failing
    assert info.value.tables == ("group 0", "group 1", "group 2", "num_blocks")
    assert [t.num_staged_writes for t in bt.block_tables] == [3, 3, 2]
    assert (bt.num_blocks == ref.num_blocks).all()  # the host keeps the staged counts
    assert host(bt.num_blocks_device).sum() == 0  # num_blocks is past the half that was written
    JOBS[job](bt)  # the retry
    ref.apply_staged_writes()
    assert mismatches(bt, ref) == [] and failing.calls == 2
    bt.append_block_ids(1, ([10], [], []), False)  # and staging goes on from the retried counts
    bt.apply_staged_writes()
    assert host(bt[0].tensor)[1, :2].tolist() == [5, 10]


@pytest.mark.parametrize("job", ["apply_staged_writes", "prepare_inputs"])
def test_a_keyboard_interrupt_passes_through_with_every_write_and_count_kept(staging, job):
    bt = small(staging, HalfFailingBackend(KeyboardInterrupt()), max_num_batched_tokens=4)
    bt.append_block_ids(0, ([1], [2, 3]), True)
    bt.append_block_ids(2, ([4], []), True)
    with pytest.raises(KeyboardInterrupt):
        JOBS[job](bt)
    assert [t.num_staged_writes for t in bt.block_tables] == [2, 2]
    assert bt.num_blocks.tolist() == [[1, 0, 1, 0], [2, 0, 0, 0]]
    JOBS[job](bt)
    assert host(bt.num_blocks_device).tolist() == bt.num_blocks.tolist()
    assert host(bt[0].tensor)[:3, 0].tolist() == [1, 0, 4] and host(bt[1].tensor)[0, :2].tolist() == [2, 3]


# -- threads and a long replay against the reference ----------------------------------------------------------
def random_calls(rng: np.random.Generator, ref: ReferenceBlockTables, count: int, bad: float = 0.0) -> list[tuple]:
    """`count` append_block_ids calls for `ref`'s current counts: overwrites and appends that fit, and with
    probability `bad` one the tables refuse (a row outside, a negative id, past the row, a wrong group count)."""
    calls = []
    widths = [t.shape[1] for t in ref.tables]
    held = ref.num_blocks.copy()
    for _ in range(count):
        req = int(rng.integers(0, ref.max_num_reqs))
        overwrite = bool(rng.random() < 0.3) or held[:, req].max() == 0
        ids = []
        for g, (k, w) in enumerate(zip(ref.k, widths)):
            room = (w - (0 if overwrite else held[g, req])) // k
            n = int(rng.integers(0, min(room, 3) + 1))
            ids.append(rng.integers(0, 5000, size=n).tolist())
            if n or overwrite:
                held[g, req] = (0 if overwrite else held[g, req]) + n * k
        if rng.random() < bad:
            kind = int(rng.integers(0, 4))
            if kind == 0:
                req = ref.max_num_reqs + int(rng.integers(0, 3))
            elif kind == 1:
                ids[0] = [*ids[0], -1]
            elif kind == 2:
                ids[-1] = list(range(widths[-1] + 1))
            else:
                ids = ids[:-1]
        calls.append((req, ids, overwrite))
    return calls


def test_a_long_random_replay_matches_the_reference(backend, staging):
    steps = 25 if backend.interpreted else 300
    rng = np.random.default_rng(11)
    sizes, kernel, widths, reqs = [16, 32, 8], [16, 16, 8], [6, 5, 9], 6
    bt = block_tables_class(staging)(sizes, reqs, widths, backend.device, kernel, backend=backend.name)
    ref = ReferenceBlockTables(sizes, reqs, widths, kernel)
    for step in range(steps):
        calls = random_calls(rng, ref, int(rng.integers(0, 6)), bad=0.1)
        if step % 3 == 0:  # the step's calls in one batch: a refused one ends it, the ones before it stay
            refused = None
            for i, call in enumerate(calls):
                try:
                    ref.append_block_ids(*call)
                except StagedWriteError:
                    refused = i
                    break
            if refused is None:
                bt.append_block_ids_batch([c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls])
            else:
                with pytest.raises(StagedWriteError, match=f"call {refused} of {len(calls)} "):
                    bt.append_block_ids_batch(*map(list, zip(*calls)))
        else:
            for call in calls:
                try:
                    ref.append_block_ids(*call)
                except StagedWriteError:
                    with pytest.raises(StagedWriteError):
                        bt.append_block_ids(*call)
                else:
                    bt.append_block_ids(*call)
        assert bt.num_blocks.tolist() == ref.num_blocks.tolist(), step
        if step % 7 == 5:  # a step staged, then dropped
            bt.clear_staged_writes()
            ref.clear_staged_writes()
            assert bt.num_blocks.tolist() == ref.num_blocks.tolist(), step
        elif step % 4 != 3:  # some steps apply, others pile up into the next one
            bt.apply_staged_writes()
            ref.apply_staged_writes()
            assert mismatches(bt, ref) == [], step
    bt.apply_staged_writes()
    ref.apply_staged_writes()
    assert mismatches(bt, ref) == [] and ref.num_blocks.sum() > 0


def test_distinct_block_tables_from_eight_threads_match_the_reference(backend):
    steps = 5 if backend.interpreted else 100

    def worker(seed: int, ready) -> None:
        rng = np.random.default_rng(seed)
        bt = BlockTables([16, 32], 8, [6, 4], backend.device, [16, 16], backend=backend.name)
        ref = ReferenceBlockTables([16, 32], 8, [6, 4], [16, 16])
        ready()
        for step in range(steps):
            if step % 5 == 2:  # a batch staged, then dropped: the reference never sees it
                bt.append_block_ids_batch([0, 1], [([1], []), ([2], [3])], True)
                bt.clear_staged_writes()
            calls = random_calls(rng, ref, int(rng.integers(1, 5)))
            for call in calls:
                ref.append_block_ids(*call)
            if step % 2:
                bt.append_block_ids_batch(*map(list, zip(*calls)))
            else:
                for call in calls:
                    bt.append_block_ids(*call)
            bt.apply_staged_writes()
            ref.apply_staged_writes()
        bad = mismatches(bt, ref)
        assert not bad, bad

    assert run_interleaved(worker) == []


def test_tables_built_and_used_inside_inference_mode(backend):
    """vLLM builds and runs its model runner's state under `torch.inference_mode()`: the tables are normal tensors
    there too (the resize guards read their version counters), and every job works."""
    import torch

    from multiwrite import BlockTables

    d = backend.device
    with torch.inference_mode():
        bt = BlockTables([4], 2, [2], d, backend=backend.name, max_num_batched_tokens=4)
        bt.append_block_ids(1, [[3, 5]], True)
        gathered, slots = bt.prepare_inputs(torch.tensor([1], device=d), torch.tensor([0, 2], device=d),
                                            torch.tensor([1, 6], device=d), 2, 3)  # fmt: skip
        assert gathered[0].tolist() == [[3, 5], [0, 0]] and slots.tolist() == [[13, 22, -1]]
        bt.append_block_ids(1, [[7]], True)
        bt.apply_staged_writes()
        assert bt.gather_block_tables(torch.tensor([1], device=d), 1)[0].tolist() == [[7, 5]]
        assert not bt.input_block_tables[0].is_inference()
    bt.refresh_layout()  # outside inference mode: the plan's descriptors are normal tensors too
    assert bt.gather_block_tables(torch.tensor([1], device=d), 1)[0].tolist() == [[7, 5]]
