"""Property tests of the stage against the sequential references (`multiwrite.reference`), on every backend.

Random tables and writes, engine-shaped steps: `idx_mapping` permutations with gaps, padding rows, chunked prefill
(several tokens per request), `is_padding` masks with junk positions under them, tokens past the last entry, kernel
block sizes, context parallelism (`cp_size` 1, 2, 4, every rank, interleaves 1, 2 and a whole block), inputs on the
device or on the host. `prepare_inputs` equals the three calls (`apply_staged_writes`, `gather_block_tables`,
`compute_slot_mappings`) and the references; each token is stored by exactly one rank; a host position past the
blocks its request holds is refused by exactly the calls whose counts do not hold it; and steps whose writes touch
the rows they schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiwrite import BlockTables, StageInputError
from multiwrite.reference import (
    PAD_SLOT_ID,
    ReferenceBlockTables,
    compute_slot_mappings_reference,
    gather_block_tables_reference,
)
from tests.support.tables import examples, host

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


def owner_and_column(p: int, bs: int, kbs: int, cp_size: int, interleave: int) -> tuple[int, int]:
    """The rank that stores position `p` of a group and the kernel block column it needs there (the reference's
    rank-local token stream: chunk `p // interleave` goes to rank `chunk % cp_size`)."""
    chunk = p // interleave
    local = (chunk // cp_size) * interleave + p % interleave
    return chunk % cp_size, local // kbs


def holds(p: int, groups, counts, cp_size: int, interleave: int) -> bool:
    """Whether a request with kernel block `counts` per group holds position `p` in every group (on its owner)."""
    columns = [owner_and_column(p, bs, kbs, cp_size, interleave)[1] for bs, kbs, _ in groups]
    return all(column < count for column, count in zip(columns, counts))


@st.composite
def configs(draw, cp_sizes=(1, 2, 4)):
    """Groups (block size, kernel block size, blocks per row), rows, and context parallelism."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        bs = draw(st.sampled_from([2, 4, 8]))
        kbs = draw(st.sampled_from([d for d in (1, 2, 4, 8) if bs % d == 0]))
        groups.append((bs, kbs, draw(st.integers(1, 4))))
    cp_size = draw(st.sampled_from(cp_sizes))
    smallest = min(bs for bs, _, _ in groups)
    interleave = draw(st.sampled_from(sorted({1, 2, smallest}))) if cp_size > 1 else 1
    return groups, draw(st.integers(1, 5)), cp_size, draw(st.integers(0, cp_size - 1)), interleave


@st.composite
def write_round(draw, groups, held: np.ndarray, distinct_from: list[int] | None = None):
    """`append_block_ids` calls within their rows' capacity; `held` (manager blocks per group and row) follows."""
    calls = []
    rows = held.shape[1]
    for _ in range(draw(st.integers(0, 2 * rows))):
        req = draw(st.integers(0, rows - 1))
        overwrite = draw(st.booleans())
        ids = []
        filled = draw(st.booleans())  # a new request holds blocks in every group (most do)
        for g, (_, _, m) in enumerate(groups):
            start = 0 if overwrite else held[g, req]
            n = draw(st.integers(min(int(filled and overwrite), m - start), m - start))
            if distinct_from is not None:
                ids.append(list(range(distinct_from[0], distinct_from[0] + n)))
                distinct_from[0] += n
            else:
                ids.append(draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)))
            if n or overwrite:
                held[g, req] = start + n
        calls.append((req, ids, overwrite))
    return calls


@st.composite
def step(draw, groups, counts: np.ndarray, cp_size: int, interleave: int, max_tokens_per_req: int = 4):
    """A scheduled batch over request rows whose kernel blocks per group are `counts`: each entry a chunk of
    consecutive positions its request holds (or none), `is_padding` (junk positions under it), tokens past the
    last entry, padded counts, where the inputs live."""
    rows = counts.shape[1]
    reach = min(m * bs for bs, _, m in groups) * cp_size
    order = draw(st.permutations(range(rows)))
    n = draw(st.integers(0, rows))
    idx = list(order[:n])
    qsl, positions = [0], []
    for req in idx:
        valid = [p for p in range(reach) if holds(p, groups, counts[:, req], cp_size, interleave)]
        length = 0
        if valid:
            start = draw(st.sampled_from(valid))
            run = 0
            while run < max_tokens_per_req and holds(start + run, groups, counts[:, req], cp_size, interleave):
                run += 1
            length = draw(st.integers(min(run, 1), run))
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


@st.composite
def cases(draw, cp_sizes=(1, 2, 4), distinct=False):
    """A config, then 1-2 rounds of writes, each followed by a step over the counts the round leaves."""
    config = draw(configs(cp_sizes))
    groups, rows, cp_size, _, interleave = config
    held = np.zeros((len(groups), rows), dtype=np.int64)
    k = np.asarray([bs // kbs for bs, kbs, _ in groups])[:, None]
    next_id = [1] if distinct else None
    rounds, steps = [], []
    for _ in range(draw(st.integers(1, 2))):
        rounds.append(draw(write_round(groups, held, next_id)))
        steps.append(draw(step(groups, held * k, cp_size, interleave)))
    return config, rounds, steps


def to_input(values, dtype: torch.dtype, device: torch.device, place: str) -> torch.Tensor:
    """A step input where an engine keeps it: on the tables' device, or in (pinned, if possible) host memory."""
    t = torch.tensor(values, dtype=dtype)
    if place == "device":
        return t.to(device)
    return t.pin_memory() if torch.cuda.is_available() else t


def inputs(s: dict, device: torch.device) -> dict:
    place = s["place"]
    return dict(
        idx_mapping=to_input(s["idx"], s["idx_dtype"], device, place),
        query_start_loc=to_input(s["qsl"], torch.int32, device, place),
        positions=to_input(s["positions"], s["pos_dtype"], device, place),
        is_padding=None if s["is_padding"] is None else to_input(s["is_padding"], torch.bool, device, place),
    )


def make_tables(backend, config, max_tokens: int, cp_rank: int | None = None) -> BlockTables:
    groups, rows, cp_size, rank, interleave = config
    return BlockTables(
        [bs for bs, _, _ in groups], rows, [m for _, _, m in groups], backend.device,
        [kbs for _, kbs, _ in groups], backend=backend.name, max_num_batched_tokens=max_tokens,
        cp_size=cp_size, cp_rank=rank if cp_rank is None else cp_rank, cp_interleave=interleave,
    )  # fmt: skip


def reference(config) -> ReferenceBlockTables:
    groups, rows = config[0], config[1]
    return ReferenceBlockTables([bs for bs, _, _ in groups], rows, [m for _, _, m in groups], [k for _, k, _ in groups])


def prepare(bt: BlockTables, s: dict, args: dict):
    return bt.prepare_inputs(args["idx_mapping"], args["query_start_loc"], args["positions"], s["num_reqs_padded"],
                             s["num_tokens_padded"], args["is_padding"])  # fmt: skip


def slot_mappings(bt: BlockTables, s: dict, args: dict):
    return bt.compute_slot_mappings(args["idx_mapping"], args["query_start_loc"], args["positions"],
                                    s["num_tokens_padded"], args["is_padding"])  # fmt: skip


def test_prepare_inputs_equals_the_three_calls_and_the_reference(backend):
    @settings(max_examples=examples(backend, 60), **SETTINGS)
    @given(cases())
    def check(case):
        config, rounds, steps = case
        groups, rows, cp_size, rank, interleave = config
        kbs = [k for _, k, _ in groups]
        max_tokens = max(s["num_tokens_padded"] for s in steps) + 2
        one, three = make_tables(backend, config, max_tokens), make_tables(backend, config, max_tokens)
        ref = reference(config)
        ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
        for calls, s in zip(rounds, steps):
            for call in calls:
                one.append_block_ids(*call)
                three.append_block_ids(*call)
                ref.append_block_ids(*call)
            args = inputs(s, backend.device)
            gathered, slots = prepare(one, s, args)
            three.apply_staged_writes()
            gathered3 = three.gather_block_tables(args["idx_mapping"], s["num_reqs_padded"])
            slots3 = slot_mappings(three, s, args)
            ref.apply_staged_writes()
            want_gather = gather_block_tables_reference(ref.tables, ref.num_blocks, s["idx"], s["num_reqs_padded"],
                                                        ref_inputs)  # fmt: skip
            want_slots = compute_slot_mappings_reference(ref.tables, kbs, s["idx"], s["qsl"], s["positions"],
                                                         s["num_tokens_padded"], s["is_padding"], cp_size, rank,
                                                         interleave)  # fmt: skip
            for g in range(len(groups)):
                np.testing.assert_array_equal(host(gathered[g]), want_gather[g])
                np.testing.assert_array_equal(host(gathered3[g]), want_gather[g])
                # the whole persistent buffers agree, rows past num_reqs_padded included
                np.testing.assert_array_equal(host(one.input_block_tables[g]), host(three.input_block_tables[g]))
                np.testing.assert_array_equal(host(one[g].tensor), ref.tables[g])
            np.testing.assert_array_equal(host(slots), want_slots)
            np.testing.assert_array_equal(host(slots3), want_slots)
            assert (host(one.slot_mappings)[:, s["num_tokens_padded"] :] == PAD_SLOT_ID).all()
            np.testing.assert_array_equal(host(one.slot_mappings), host(three.slot_mappings))
            np.testing.assert_array_equal(host(one.num_blocks_device), ref.num_blocks)

    check()


def test_each_live_token_is_stored_by_exactly_one_rank(backend):
    """For every rank of cp_size 2 and 4: each live token gets a slot on exactly one rank, padding on none, and on
    each rank distinct tokens of a request never share a slot (block ids are distinct here, so slots must be too)."""

    @settings(max_examples=examples(backend, 25, 3), **SETTINGS)
    @given(cases(cp_sizes=(2, 4), distinct=True))
    def check(case):
        config, rounds, steps = case
        cp_size = config[2]
        max_tokens = max(s["num_tokens_padded"] for s in steps) + 1
        ranks = [make_tables(backend, config, max_tokens, cp_rank=r) for r in range(cp_size)]
        for calls, s in zip(rounds, steps):
            for bt in ranks:
                for call in calls:
                    bt.append_block_ids(*call)
            args = inputs(s, backend.device)
            slots = np.stack([host(prepare(bt, s, args)[1]) for bt in ranks])  # [rank, group, token]
            T = s["num_tokens_padded"]
            live = np.zeros(T, dtype=bool)
            live[: s["qsl"][len(s["idx"])]] = True
            if s["is_padding"] is not None:
                live &= ~np.asarray(s["is_padding"], dtype=bool)
            owners = (slots != PAD_SLOT_ID).sum(axis=0)  # [group, token]
            assert (owners[:, live] == 1).all() and (owners[:, ~live] == 0).all()
            for r in range(cp_size):
                for g in range(slots.shape[1]):
                    for b in range(len(s["idx"])):
                        mine = [i for i in range(s["qsl"][b], s["qsl"][b + 1]) if live[i] and slots[r, g, i] >= 0]
                        assert len({int(slots[r, g, i]) for i in mine}) == len(mine)

    check()


@st.composite
def past_the_blocks(draw):
    """A case, then one live token of its last step moved to a position inside the row but maybe past the blocks
    its request holds: (case, token, new position)."""
    config, rounds, steps = draw(cases(cp_sizes=(1, 2)))
    s = steps[-1]
    live = [i for i in range(s["qsl"][len(s["idx"])]) if s["is_padding"] is None or not s["is_padding"][i]]
    if not live:
        return config, rounds, steps, None, None
    token = draw(st.sampled_from(live))
    groups, cp_size = config[0], config[2]
    reach = min(m * bs for bs, _, m in groups) * cp_size
    return config, rounds, steps, token, draw(st.integers(0, reach - 1))


def test_a_position_past_the_requests_blocks_is_refused_by_the_calls_that_do_not_hold_it(backend):
    """`prepare_inputs` checks host positions against the counts as staged (it applies first), a lone
    `compute_slot_mappings` against the counts of the last apply; a refused call names the token, its batch entry,
    request row and group, and changes nothing."""

    @settings(max_examples=examples(backend, 60), **SETTINGS)
    @given(past_the_blocks())
    def check(case):
        config, rounds, steps, token, position = case
        groups, rows, cp_size, rank, interleave = config
        bt = make_tables(backend, config, max(s["num_tokens_padded"] for s in steps) + 1)
        ref = reference(config)
        for calls in rounds[:-1]:
            for call in calls:
                bt.append_block_ids(*call)
                ref.append_block_ids(*call)
            bt.apply_staged_writes()
            ref.apply_staged_writes()
        for call in rounds[-1]:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)
        s = dict(steps[-1], place="host")  # host inputs: their values are checked
        if token is not None:
            s["positions"] = list(s["positions"])
            s["positions"][token] = position
        args = inputs(s, backend.device)
        entry = {i: b for b in range(len(s["idx"])) for i in range(s["qsl"][b], s["qsl"][b + 1])}
        live = [i for i in sorted(entry) if s["is_padding"] is None or not s["is_padding"][i]]

        def refused_at(counts: np.ndarray) -> tuple[int, int] | None:
            """The first group with a token whose kernel block this rank stores and its request does not hold, and
            that group's first such token."""
            for g, (bs, kbs, _) in enumerate(groups):
                for i in live:
                    owner, column = owner_and_column(s["positions"][i], bs, kbs, cp_size, interleave)
                    if owner == rank and column >= counts[g, s["idx"][entry[i]]]:
                        return i, g
            return None

        tables = [host(t.tensor).copy() for t in bt.block_tables]
        staged = [t.num_staged_writes for t in bt.block_tables]
        for what, run, counts in [
            ("compute_slot_mappings", lambda: slot_mappings(bt, s, args), ref.num_blocks_applied.copy()),
            ("prepare_inputs", lambda: prepare(bt, s, args), ref.num_blocks.copy()),
        ]:
            refusal = refused_at(counts)
            if refusal is None:
                run()
                continue
            i, g = refusal
            req = s["idx"][entry[i]]
            with pytest.raises(StageInputError) as info:
                run()
            assert str(info.value).startswith(
                f"{what}: token {i} (batch entry {entry[i]}, request row {req}) at position {s['positions'][i]} needs "
                f"kernel block column "
            ) and f" of group {g}, " in str(info.value), (str(info.value), refusal)
            assert [host(t.tensor).tolist() for t in bt.block_tables] == [t.tolist() for t in tables]
            assert [t.num_staged_writes for t in bt.block_tables] == staged

    check()


# -- steps whose writes touch what the same step gathers and maps -------------------------------------------------
def check_step(bt: BlockTables, ref: ReferenceBlockTables, ref_inputs, s: dict, device, dirty: list[int]) -> None:
    """`bt.prepare_inputs` of step `s` equals the reference's apply, gather and slot mappings; `dirty[0]`: the batch
    size of the previous gather (its rows past this one's are zeroed too), updated."""
    gathered, slots = prepare(bt, s, inputs(s, device))
    ref.apply_staged_writes()
    want = gather_block_tables_reference(ref.tables, ref.num_blocks, s["idx"], s["num_reqs_padded"], ref_inputs,
                                         num_rows=dirty[0])  # fmt: skip
    dirty[0] = len(s["idx"])
    want_slots = compute_slot_mappings_reference(ref.tables, bt.kernel_block_sizes, s["idx"], s["qsl"], s["positions"],
                                                 s["num_tokens_padded"], s["is_padding"], bt.cp_size, bt.cp_rank,
                                                 bt.cp_interleave)  # fmt: skip
    for g in range(bt.num_groups):
        np.testing.assert_array_equal(host(bt[g].tensor), ref.tables[g], err_msg=f"group {g} table")
        np.testing.assert_array_equal(host(gathered[g]), want[g], err_msg=f"group {g} gathered")
        np.testing.assert_array_equal(host(bt.input_block_tables[g]), ref_inputs[g], err_msg=f"group {g} buffer")
    np.testing.assert_array_equal(host(slots), want_slots)
    np.testing.assert_array_equal(host(bt.num_blocks_device), ref.num_blocks)


def decode_step(rows: list[int], positions: list[int], padded_reqs: int, padded_tokens: int) -> dict:
    return dict(idx=rows, qsl=list(range(len(rows) + 1)), positions=positions, is_padding=None,
                num_reqs_padded=padded_reqs, num_tokens_padded=padded_tokens, idx_dtype=torch.int32,
                pos_dtype=torch.int64, place="device")  # fmt: skip


def test_a_step_whose_writes_touch_its_own_batch(backend):
    """Each case a step whose writes touch what the same step gathers or maps: rows in the batch, a row re-staged
    in one step (later wins), num_blocks shrunk by an overwrite, rows not in the batch, an empty batch, one row
    staged ten times in one step (more overlap rounds than a one-launch stage overlays)."""
    bs, kbs, widths = [4, 8], [4, 4], [6, 6]
    bt = BlockTables(bs, 4, widths, backend.device, kbs, backend=backend.name, max_num_batched_tokens=8)
    ref = ReferenceBlockTables(bs, 4, widths, kbs)
    ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
    dirty = [0]

    def stage(*calls):
        for call in calls:
            bt.append_block_ids(*call)
            ref.append_block_ids(*call)

    # rows 0 and 1 new; both in the batch, their tokens in the blocks this very step writes
    stage((0, ([1, 2, 3], [4]), True), (1, ([5], [6, 7]), True))
    check_step(bt, ref, ref_inputs, decode_step([1, 0], [3, 7], 3, 4), backend.device, dirty)
    # row 0: an append, an overwrite that shrinks it, an append (later wins, num_blocks too); row 2 written but not
    # scheduled; row 1 scheduled but not written
    stage((0, ([8], [9]), False), (2, ([10], [11]), True), (0, ([12], []), True), (0, ([13], [14]), False))
    check_step(bt, ref, ref_inputs, decode_step([0, 1], [5, 2], 4, 3), backend.device, dirty)
    # nothing staged; then an empty batch with padding rows while row 3 is written
    check_step(bt, ref, ref_inputs, decode_step([2, 1, 0], [0, 1, 2], 4, 4), backend.device, dirty)
    stage((3, ([15, 16], [17]), True))
    check_step(bt, ref, ref_inputs, decode_step([], [], 2, 2), backend.device, dirty)
    for i in range(10):
        stage((3, ([20 + i], [30 + i]), i % 3 == 0))
    check_step(bt, ref, ref_inputs, decode_step([3, 0], [3, 1], 2, 2), backend.device, dirty)


@st.composite
def busy_steps(draw):
    """Steps whose writes pile onto few rows (re-staged, overwritten, shrunk) that the same step schedules."""
    groups = [(4, 4, 4), (8, 4, 3)]
    rows = draw(st.integers(1, 4))
    held = np.zeros((len(groups), rows), dtype=np.int64)
    k = np.asarray([[1], [2]])
    out = []
    for _ in range(draw(st.integers(1, 3))):
        calls = draw(write_round(groups, held))
        counts = held * k
        order = draw(st.permutations(range(rows)))
        n = draw(st.integers(0, rows))
        qsl, positions = [0], []
        for req in order[:n]:
            valid = [p for p in range(16) if holds(p, groups, counts[:, req], 1, 1)]
            tokens = draw(st.lists(st.sampled_from(valid), max_size=3)) if valid else []
            positions += tokens
            qsl.append(qsl[-1] + len(tokens))
        s = decode_step(list(order[:n]), positions, n + draw(st.integers(0, rows - n)), qsl[-1] + 1)
        s["qsl"] = qsl
        s["positions"] = positions + [0]
        out.append((calls, s))
    return rows, out


def test_random_steps_that_write_the_rows_they_schedule(backend):
    @settings(max_examples=examples(backend, 40), **SETTINGS)
    @given(busy_steps())
    def check(case):
        rows, steps = case
        bt = BlockTables([4, 8], rows, [4, 3], backend.device, [4, 4], backend=backend.name, max_num_batched_tokens=16)
        ref = ReferenceBlockTables([4, 8], rows, [4, 3], [4, 4])
        ref_inputs = [np.zeros(t.shape, dtype=np.int64) for t in ref.tables]
        dirty = [0]
        for calls, s in steps:
            for call in calls:
                bt.append_block_ids(*call)
                ref.append_block_ids(*call)
            check_step(bt, ref, ref_inputs, s, backend.device, dirty)

    check()
