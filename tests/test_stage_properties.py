"""Property tests of the gather and slot-mapping stage against the sequential reference, on every backend.

Random tables and writes, `idx_mapping` permutations with gaps, padding rows, chunked prefill (several tokens
per request), `is_padding` masks with junk positions, kernel block sizes, context parallelism (`cp_size` 1, 2,
4, every rank, interleaves 1, 2 and a whole block), and `prepare_inputs` equal to the three calls in order.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiwrite import BlockTables
from multiwrite.reference import (
    PAD_SLOT_ID,
    ReferenceBlockTables,
    compute_slot_mappings_reference,
    gather_block_tables_reference,
)


def examples(backend, cpu: int) -> int:
    """Triton's interpreter runs a launch in tens of milliseconds: fewer examples there."""
    return cpu if backend.device.type != "cpu" or backend.name == "torch-cpu" else max(cpu // 3, 8)


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def to_input(values, dtype: torch.dtype, backend, place: str) -> torch.Tensor:
    """A step input where an engine keeps it: on the tables' device, or in (pinned, if possible) host memory."""
    t = torch.tensor(values, dtype=dtype)
    if place == "device":
        return t.to(backend.device)
    return t.pin_memory() if torch.cuda.is_available() else t


@st.composite
def configs(draw, cp_sizes=(1, 2, 4)):
    """Groups (block size, kernel block size, blocks per row), rows, and context parallelism."""
    num_groups = draw(st.integers(1, 3))
    groups = []
    for _ in range(num_groups):
        bs = draw(st.sampled_from([2, 4, 8]))
        kbs = draw(st.sampled_from([d for d in (1, 2, 4, 8) if bs % d == 0]))
        groups.append((bs, kbs, draw(st.integers(1, 4))))
    cp_size = draw(st.sampled_from(cp_sizes))
    smallest = min(bs for bs, _, _ in groups)
    interleave = draw(st.sampled_from(sorted({1, 2, smallest}))) if cp_size > 1 else 1
    return groups, draw(st.integers(1, 5)), cp_size, draw(st.integers(0, cp_size - 1)), interleave


@st.composite
def write_rounds(draw, groups, rows: int, distinct: bool = False):
    """1-2 rounds of `append_block_ids` calls, each within its rows' capacity."""
    held = np.zeros((len(groups), rows), dtype=np.int64)
    rounds, next_id = [], 1
    for _ in range(draw(st.integers(1, 2))):
        calls = []
        for _ in range(draw(st.integers(0, 2 * rows))):
            req = draw(st.integers(0, rows - 1))
            overwrite = draw(st.booleans())
            ids = []
            for g, (_, _, m) in enumerate(groups):
                start = 0 if overwrite else held[g, req]
                n = draw(st.integers(0, m - start))
                if distinct:
                    ids.append(list(range(next_id, next_id + n)))
                    next_id += n
                else:
                    ids.append(draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)))
                held[g, req] = start + n if (n or overwrite) else held[g, req]
            calls.append((req, ids, overwrite))
        rounds.append(calls)
    return rounds


@st.composite
def steps(draw, groups, rows: int, max_tokens_per_req: int = 4):
    """A scheduled batch: request rows (a permutation prefix, so with gaps), per entry a chunk of consecutive
    positions, is_padding (with junk positions under it), padded counts, where inputs live."""
    order = draw(st.permutations(range(rows)))
    n = draw(st.integers(0, rows))
    idx = list(order[:n])
    # every group can address the first `reach` positions (the rank-local index never exceeds the position)
    reach = min(m * bs for bs, _, m in groups)
    qsl, positions = [0], []
    for _ in idx:
        length = draw(st.integers(0, min(max_tokens_per_req, reach)))
        start = draw(st.integers(0, reach - length))
        positions.extend(range(start, start + length))
        qsl.append(qsl[-1] + length)
    num_tokens = qsl[-1]
    num_tokens_padded = num_tokens + draw(st.integers(0, 3))
    positions += [draw(st.sampled_from([-5, 10**6, 0])) for _ in range(num_tokens_padded - num_tokens)]
    is_padding = None
    if draw(st.booleans()):
        is_padding = draw(st.lists(st.booleans(), min_size=num_tokens_padded, max_size=num_tokens_padded))
        positions = [draw(st.sampled_from([-3, 10**6])) if pad else p for p, pad in zip(positions, is_padding)]
    return dict(
        idx=idx,
        qsl=qsl + [num_tokens] * draw(st.integers(0, 2)),  # a longer persistent buffer is fine
        positions=positions,
        is_padding=is_padding,
        num_reqs_padded=n + draw(st.integers(0, rows - n)),
        num_tokens_padded=num_tokens_padded,
        idx_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        place=draw(st.sampled_from(["device", "host"])),
    )


def inputs(step, backend):
    place = step["place"]
    return dict(
        idx_mapping=to_input(step["idx"], step["idx_dtype"], backend, place),
        query_start_loc=to_input(step["qsl"], torch.int32, backend, place),
        positions=to_input(step["positions"], step["pos_dtype"], backend, place),
        is_padding=None if step["is_padding"] is None else to_input(step["is_padding"], torch.bool, backend, place),
    )


def make_tables(backend, config, max_tokens: int, cp_rank: int | None = None) -> BlockTables:
    groups, rows, cp_size, rank, interleave = config
    return BlockTables(
        [bs for bs, _, _ in groups], rows, [m for _, _, m in groups], backend.device,
        [kbs for _, kbs, _ in groups], backend=backend.name, max_num_batched_tokens=max_tokens,
        cp_size=cp_size, cp_rank=rank if cp_rank is None else cp_rank, cp_interleave=interleave,
    )  # fmt: skip


@st.composite
def cases(draw, cp_sizes=(1, 2, 4), distinct=False):
    config = draw(configs(cp_sizes))
    groups, rows = config[0], config[1]
    rounds = draw(write_rounds(groups, rows, distinct))
    return config, rounds, [draw(steps(groups, rows)) for _ in rounds]


def test_prepare_inputs_equals_three_calls_and_the_reference(backend):
    @settings(max_examples=examples(backend, 60), deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case):
        config, rounds, batches = case
        groups, rows, cp_size, rank, interleave = config
        kbs = [k for _, k, _ in groups]
        max_tokens = max(s["num_tokens_padded"] for s in batches) + 2
        one, three = make_tables(backend, config, max_tokens), make_tables(backend, config, max_tokens)
        ref = ReferenceBlockTables([bs for bs, _, _ in groups], rows, [m for _, _, m in groups], kbs)
        ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
        for calls, step in zip(rounds, batches):
            for req, ids, overwrite in calls:
                one.append_block_ids(req, ids, overwrite)
                three.append_block_ids(req, ids, overwrite)
                ref.append_block_ids(req, ids, overwrite)
            args = inputs(step, backend)
            gathered, slots = one.prepare_inputs(
                args["idx_mapping"], args["query_start_loc"], args["positions"],
                step["num_reqs_padded"], step["num_tokens_padded"], args["is_padding"],
            )  # fmt: skip
            three.apply_staged_writes()
            gathered3 = three.gather_block_tables(args["idx_mapping"], step["num_reqs_padded"])
            slots3 = three.compute_slot_mappings(
                args["idx_mapping"], args["query_start_loc"], args["positions"],
                step["num_tokens_padded"], args["is_padding"],
            )  # fmt: skip
            expected_gather = gather_block_tables_reference(
                ref.tables, ref.num_blocks, step["idx"], step["num_reqs_padded"], ref_inputs
            )
            expected_slots = compute_slot_mappings_reference(
                ref.tables, kbs, step["idx"], step["qsl"], step["positions"], step["num_tokens_padded"],
                step["is_padding"], cp_size, rank, interleave,
            )  # fmt: skip
            for g in range(len(groups)):
                np.testing.assert_array_equal(host(gathered[g]), expected_gather[g])
                np.testing.assert_array_equal(host(gathered3[g]), expected_gather[g])
                # the whole persistent buffers agree, rows past num_reqs_padded included
                np.testing.assert_array_equal(host(one.input_block_tables[g]), host(three.input_block_tables[g]))
                np.testing.assert_array_equal(host(one[g].tensor), ref.tables[g])
            np.testing.assert_array_equal(host(slots), expected_slots)
            np.testing.assert_array_equal(host(slots3), expected_slots)
            assert (host(one.slot_mappings)[:, step["num_tokens_padded"] :] == PAD_SLOT_ID).all()
            np.testing.assert_array_equal(host(one.slot_mappings), host(three.slot_mappings))
            np.testing.assert_array_equal(host(one.num_blocks_device), ref.num_blocks)

    check()


def test_each_token_is_stored_by_exactly_one_rank(backend):
    """For every rank of cp_size 2 and 4: each live token gets a slot on exactly one rank, and on each rank
    distinct tokens of a request never share a slot (block ids are distinct here, so slots must be too)."""

    @settings(max_examples=examples(backend, 25), deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(cp_sizes=(2, 4), distinct=True))
    def check(case):
        config, rounds, batches = case
        groups, cp_size = config[0], config[2]
        max_tokens = max(s["num_tokens_padded"] for s in batches) + 1
        ranks = [make_tables(backend, config, max_tokens, cp_rank=r) for r in range(cp_size)]
        for calls, step in zip(rounds, batches):
            for bt in ranks:
                for req, ids, overwrite in calls:
                    bt.append_block_ids(req, ids, overwrite)
            args = inputs(step, backend)
            slots = np.stack(
                [
                    host(
                        bt.prepare_inputs(
                            args["idx_mapping"], args["query_start_loc"], args["positions"],
                            step["num_reqs_padded"], step["num_tokens_padded"], args["is_padding"],
                        )[1]
                    )
                    for bt in ranks
                ]
            )  # fmt: skip  # [rank, group, token]
            T = step["num_tokens_padded"]
            live = np.zeros(T, dtype=bool)
            live[: step["qsl"][len(step["idx"])]] = True
            if step["is_padding"] is not None:
                live &= ~np.asarray(step["is_padding"], dtype=bool)
            owners = (slots != PAD_SLOT_ID).sum(axis=0)  # [group, token]
            assert (owners[:, live] == 1).all()
            assert (owners[:, ~live] == 0).all()
            interleave = config[4]
            pos = np.asarray(step["positions"][:T], dtype=np.int64)
            chunk = pos // interleave
            local = (chunk // cp_size) * interleave + pos % interleave  # the owner's local token index
            for g, (_, kbs, _) in enumerate(groups):
                for b, req in enumerate(step["idx"]):
                    tokens = np.arange(step["qsl"][b], step["qsl"][b + 1])
                    for r in range(cp_size):
                        # tokens inside the blocks the request holds: their slots on a rank are all distinct
                        mine = tokens[live[tokens] & (slots[r, g, tokens] != PAD_SLOT_ID)]
                        mine = mine[local[mine] // kbs < ranks[r].num_blocks[g, req]]
                        assert len(set(slots[r, g, mine].tolist())) == mine.size

    check()


# -------------------------------------------------------------------------------------------------
# The overlap of a step's writes with its own batch: what the one-launch stage (Triton) must get right
# -------------------------------------------------------------------------------------------------
class FusedSpy:
    """Counts the Triton backends' one-launch stages that ran (through the general path's
    `triton_stage.launch_fused`, or the direct path of `backends/triton_direct.py`, which a GPU binds after the
    first call) and the ones `launch_fused` declined."""

    def __init__(self, backend, monkeypatch):
        self.ran = self.declined = 0
        if not backend.name.startswith("triton-"):
            return
        from multiwrite.backends import triton_direct, triton_stage

        original = triton_stage.launch_fused

        def spy(writer, batch, stage):
            took = original(writer, batch, stage)
            self.ran += took
            self.declined += not took
            return took

        direct = triton_direct.DirectStage.prepare_inputs

        def direct_spy(self_, *args):
            out = direct(self_, *args)
            self.ran += out is not None
            return out

        monkeypatch.setattr(triton_stage, "launch_fused", spy)
        monkeypatch.setattr(triton_direct.DirectStage, "prepare_inputs", direct_spy)


def check_step(bt: BlockTables, ref: ReferenceBlockTables, ref_inputs, step, backend) -> None:
    """`bt.prepare_inputs` of `step` equals the reference's apply, gather and slot mappings."""
    args = inputs(step, backend)
    gathered, slots = bt.prepare_inputs(
        args["idx_mapping"], args["query_start_loc"], args["positions"],
        step["num_reqs_padded"], step["num_tokens_padded"], args["is_padding"],
    )  # fmt: skip
    ref.apply_staged_writes()
    expected = gather_block_tables_reference(
        ref.tables, ref.num_blocks, step["idx"], step["num_reqs_padded"], ref_inputs
    )
    expected_slots = compute_slot_mappings_reference(
        ref.tables, bt.kernel_block_sizes, step["idx"], step["qsl"], step["positions"], step["num_tokens_padded"],
        step["is_padding"], bt.cp_size, bt.cp_rank, bt.cp_interleave,
    )  # fmt: skip
    for g in range(bt.num_groups):
        np.testing.assert_array_equal(host(bt[g].tensor), ref.tables[g], err_msg=f"group {g} table")
        np.testing.assert_array_equal(host(gathered[g]), expected[g], err_msg=f"group {g} gathered")
    np.testing.assert_array_equal(host(slots), expected_slots)
    np.testing.assert_array_equal(host(bt.num_blocks_device), ref.num_blocks)


def decode_step(rows: list[int], positions: list[int], padded_reqs: int, padded_tokens: int) -> dict:
    return dict(
        idx=rows, qsl=list(range(len(rows) + 1)), positions=positions, is_padding=None,
        num_reqs_padded=padded_reqs, num_tokens_padded=padded_tokens, idx_dtype=torch.int32,
        pos_dtype=torch.int64, place="device",
    )  # fmt: skip


def test_overlap_of_the_writes_with_their_own_batch(backend, monkeypatch):
    """Each case a step whose writes touch what the same step gathers or maps: rows in the batch, a row
    re-staged in one step (later wins), num_blocks shrunk by an overwrite, rows not in the batch, an empty batch,
    a row staged more often than the one-launch stage overlays (MAX_ROUNDS: two launches, same result)."""
    spy = FusedSpy(backend, monkeypatch)
    bs, kbs, widths = [4, 8], [4, 4], [6, 6]
    bt = BlockTables(bs, 4, widths, backend.device, kbs, backend=backend.name, max_num_batched_tokens=8)
    ref = ReferenceBlockTables(bs, 4, widths, kbs)
    ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]

    def stage(*calls):
        for req, ids, overwrite in calls:
            bt.append_block_ids(req, ids, overwrite)
            ref.append_block_ids(req, ids, overwrite)

    # rows 0 and 1 new; both in the batch, the tokens in the blocks this very step writes
    stage((0, ([1, 2, 3], [4]), True), (1, ([5], [6, 7]), True))
    check_step(bt, ref, ref_inputs, decode_step([1, 0], [13, 11], 3, 4), backend)
    # row 0 re-staged: an append, then an overwrite that shrinks it, then an append (later wins, num_blocks too);
    # row 2 written but not scheduled; row 1 scheduled but not written
    stage((0, ([8], [9]), False), (2, ([10], [11]), True), (0, ([12], []), True), (0, ([13], [14]), False))
    check_step(bt, ref, ref_inputs, decode_step([0, 1], [5, 14], 4, 3), backend)
    # nothing staged; then an empty batch with padding rows while row 3 is written
    check_step(bt, ref, ref_inputs, decode_step([2, 1, 0], [0, 1, 2], 4, 4), backend)
    stage((3, ([15, 16], [17]), True))
    check_step(bt, ref, ref_inputs, decode_step([], [], 2, 2), backend)
    # one row staged 10 times in one step: more rounds than the one launch overlays
    for i in range(10):
        stage((3, ([20 + i], [30 + i]), i % 3 == 0))
    check_step(bt, ref, ref_inputs, decode_step([3, 0], [7, 1], 2, 2), backend)
    if backend.name.startswith("triton-"):
        assert (spy.ran, spy.declined) == (3, 1)  # steps with writes: 4; the 10-round one declined


@st.composite
def busy_steps(draw):
    """Steps whose writes pile onto few rows (re-staged, overwritten, shrunk) that the same step schedules."""
    groups = [(4, 4, 4), (8, 4, 3)]
    rows = draw(st.integers(1, 4))
    held = np.zeros((len(groups), rows), dtype=np.int64)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        calls = []
        for _ in range(draw(st.integers(0, 6))):
            req = draw(st.integers(0, rows - 1))
            overwrite = draw(st.booleans()) or held[:, req].max() == 0
            ids = []
            for g, (_, _, m) in enumerate(groups):
                start = 0 if overwrite else held[g, req]
                n = draw(st.integers(0, m - start))
                ids.append(draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)))
                held[g, req] = start + n if (n or overwrite) else held[g, req]
            calls.append((req, ids, overwrite))
        order = draw(st.permutations(range(rows)))
        n = draw(st.integers(0, rows))
        tokens = [draw(st.integers(1, 3)) for _ in range(n)]
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(int).tolist()
        positions = [draw(st.integers(0, 15)) for _ in range(qsl[-1])]
        step = decode_step(list(order[:n]), positions, n + draw(st.integers(0, rows - n)), qsl[-1] + 1)
        step["qsl"] = qsl
        out.append((calls, step))
    return rows, out


def test_prepare_inputs_when_the_step_writes_its_own_batch(backend, monkeypatch):
    """Random steps whose writes land on the rows they schedule, against the reference; on Triton every step
    with writes goes through the one launch (none has more rounds than it overlays)."""
    spy = FusedSpy(backend, monkeypatch)
    launches = []

    @settings(max_examples=examples(backend, 40), deadline=None, suppress_health_check=list(HealthCheck))
    @given(busy_steps())
    def check(case):
        rows, steps_ = case
        bt = BlockTables([4, 8], rows, [4, 3], backend.device, [4, 4], backend=backend.name, max_num_batched_tokens=16)
        ref = ReferenceBlockTables([4, 8], rows, [4, 3], [4, 4])
        ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
        for calls, step in steps_:
            for call in calls:
                bt.append_block_ids(*call)
                ref.append_block_ids(*call)
            before = spy.ran
            staged = sum(t.num_staged_writes for t in bt.block_tables) > 0
            check_step(bt, ref, ref_inputs, step, backend)
            launches.append((staged, spy.ran - before))

    check()
    if backend.name.startswith("triton-"):
        assert all(ran == int(staged) for staged, ran in launches) and spy.declined == 0
        assert sum(ran for _, ran in launches) >= 10
