"""The Triton kernels through Triton's interpreter on CPU, against `multiwrite.reference`: the apply kernel (decode
and general tiles, overlap rounds, more tables than it preloads), the stage kernel without writes (gather and slot
mappings, rows split into CHUNK-cell programs) and with them (the writes laid over what each program reads, up to
MAX_ROUNDS rounds; more: the apply kernel first), and the kernels' own masking of cells outside a table.

The kernels are reached through the public API (`FusedStagedWriter`, `BlockTables`) except for the masking test,
which hands the kernel a batch marked `checked` that is not (white-box: no public call can)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor, WriteBatch, select_backend
from multiwrite.backends.triton.kernels import apply as apply_kernel
from multiwrite.backends.triton.kernels import stage as stage_kernel
from multiwrite.reference import (
    ReferenceBlockTables,
    apply_writes_reference,
    compute_slot_mappings_reference,
    gather_block_tables_reference,
)
from tests.support.tables import host

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="drives the kernels through Triton's interpreter on CPU tables"
)
TRITON = ["triton-cuda", "triton-rocm"]  # the same kernels with each backend's launch parameters


def _writes(rng, shapes, count, max_len, overlap):
    """`count` random writes `(table, row, start, values)` into tables of `shapes`; with `overlap`, rows repeat."""
    out = []
    for _ in range(count):
        t = int(rng.integers(0, len(shapes)))
        rows, cols = shapes[t]
        row = int(rng.integers(0, min(rows, 2) if overlap else rows))
        n = int(rng.integers(0, min(max_len, cols) + 1))
        start = int(rng.integers(0, cols - n + 1))
        out.append((t, row, start, rng.integers(-(2**40), 2**40, n).tolist()))
    return out


#: (case, table shapes, writes, longest write, overlapping rows): values <= 256 take the decode tile, more the general
#: tile (tiles of writes x column splits); more than 8 tables are found through dependent descriptor loads.
APPLY_CASES = [
    ("decode tile", [(6, 8), (3, 5)], 40, 4, False),
    ("general tile, long rows", [(4, 700), (2, 70)], 6, 700, False),
    ("overlap rounds", [(3, 9), (2, 4)], 30, 6, True),
    ("ten tables", [(2, 3 + t) for t in range(10)], 50, 3, False),
]


@pytest.mark.parametrize("name", TRITON)
@pytest.mark.parametrize("case, shapes, count, max_len, overlap", APPLY_CASES, ids=[c[0] for c in APPLY_CASES])
def test_the_apply_kernel_lands_a_batch_as_the_reference_does(name, case, shapes, count, max_len, overlap):
    rng = np.random.default_rng(len(case) + len(name))
    tables = [StagedWriteTensor(s, torch.int64, "cpu", name=f"t{i}") for i, s in enumerate(shapes)]
    refs = [np.zeros(s, np.int64) for s in shapes]
    values = 0
    for t, row, start, vals in _writes(rng, shapes, count, max_len, overlap):
        tables[t].stage_write(row, start, vals)
        apply_writes_reference(refs[t], [(row, start, vals)])
        values += len(vals)
    assert (values <= apply_kernel.PRELOADED_VALUES) == (case != "general tile, long rows")
    FusedStagedWriter("cpu", backend=name).apply(tables)
    for i, (t, ref) in enumerate(zip(tables, refs)):
        np.testing.assert_array_equal(host(t.tensor), ref, err_msg=f"{case}: table {i}")


@pytest.mark.parametrize("num_values", [17, 300], ids=["decode tile", "general tile"])
def test_the_apply_kernel_writes_nothing_outside_a_tables_current_shape(num_values):
    """Defence in depth (white-box): a batch marked `checked` is not checked on the host, so the kernel itself must
    mask cells past the row's end and rows past the table's; here a 3 x 4 view inside a canary buffer."""
    be = select_backend("cpu", "triton-cuda")
    buf = torch.full((6, 10), -1, dtype=torch.int32)
    table = buf[1:4, 2:6]  # row stride 10: the cells right of each row belong to the canary
    table.zero_()
    writes = [(0, 2, 5), (1, 4, 2), (2, 0, 4), (3, 0, 4), (5, 1, 2)]  # (row, start, length)
    lengths = [n for _, _, n in writes]
    lengths[-1] += num_values - sum(lengths)  # the last (outside) write pads the batch to its tile's size
    meta, offset = [], 0
    for (row, start, _), n in zip(writes, lengths):
        meta.append((0, row, start, n, offset))
        offset += n
    values = np.arange(100, 100 + offset, dtype=np.int32)
    be.apply([WriteBatch([table], np.asarray(meta, np.int32), values, False, True, checked=True)])
    expect = np.full((6, 10), -1)
    expect[1:4, 2:6] = 0
    expect[1, 4:6] = [100, 101]  # write 0: the 2 cells inside its row only
    expect[3, 2:6] = [107, 108, 109, 110]  # write 2 (values after write 0's 5 and write 1's 2)
    np.testing.assert_array_equal(host(buf), expect)


class Stage:
    """A triton-cuda BlockTables and its reference, driven through the same calls."""

    def __init__(self, block_sizes, kernel_block_sizes, widths, reqs=4, tokens=16):
        self.kbs = kernel_block_sizes
        self.bt = BlockTables(block_sizes, reqs, widths, "cpu", kernel_block_sizes, backend="triton-cuda",
                              max_num_batched_tokens=tokens)  # fmt: skip
        self.ref = ReferenceBlockTables(block_sizes, reqs, widths, kernel_block_sizes)
        self.zero = [np.zeros(t.shape, np.int64) for t in self.ref.tables]

    def stage(self, req, ids, overwrite):
        self.bt.append_block_ids(req, ids, overwrite)
        self.ref.append_block_ids(req, ids, overwrite)

    def check(self, gathered, slots, idx, qsl, pos, padded, tokens, pad=None, what=""):
        want = gather_block_tables_reference(self.ref.tables, self.ref.num_blocks, idx, padded, self.zero)
        for g, (a, w) in enumerate(zip(gathered, want)):
            np.testing.assert_array_equal(host(a), w, err_msg=f"{what}: gathered group {g}")
        if slots is not None:
            want_slots = compute_slot_mappings_reference(self.ref.tables, self.kbs, idx, qsl, pos, tokens, pad)
            np.testing.assert_array_equal(host(slots), want_slots, err_msg=f"{what}: slots")
        for g, t in enumerate(self.bt.block_tables):
            np.testing.assert_array_equal(host(t.tensor), self.ref.tables[g], err_msg=f"{what}: table {g}")


def _inputs(idx, qsl, pos, pad=None):
    tensors = [torch.tensor(idx, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int64), torch.tensor(pos)]
    return tensors + ([] if pad is None else [torch.tensor(pad)])


def test_the_stage_kernel_gathers_and_maps_rows_longer_than_one_program():
    """Rows of 4,200 cells are split in programs of CHUNK (4,096) cells; the slot of a token past the first chunk
    comes from the second; padding entries are zeroed across every chunk; is_padding tokens get -1."""
    assert stage_kernel.CHUNK == 4096
    s = Stage([16], [16], [4200])
    s.stage(1, (list(range(1, 1001)),), True)
    for i in range(1, 5):  # calls of 1,000 ids: 4,200 cells in all
        s.stage(1, (list(range(1000 * i + 1, 1000 * i + 1 + (1000 if i < 4 else 200))),), False)
    s.stage(2, ([7, 8],), True)
    s.bt.apply_staged_writes()
    s.ref.apply_staged_writes()
    idx, qsl, pos = [1, 2], [0, 3, 4], [16 * 4150 + 5, 16 * 4095 + 1, 16 * 4096, 17]
    pad = [False, False, True, False, True, True]
    s.bt.input_block_tables[0].fill_(3)  # stale cells: past num_blocks they keep what they held, padding rows zero
    s.zero[0][:] = 3
    gathered = s.bt.gather_block_tables(torch.tensor(idx), 4)
    i, q, p, m = _inputs(idx, qsl, pos, pad)
    slots = s.bt.compute_slot_mappings(i, q, p, 6, m)
    s.check(gathered, slots, idx, qsl, pos, 4, 6, pad, "4,200-cell rows")
    assert slots[0, :3].tolist() == [4151 * 16 + 5, 4096 * 16 + 1, -1] and not gathered[0][2:].any()


def _rounds(s: Stage, req: int, n: int) -> None:
    """`n` calls on one row in one step: `n` overlap rounds, each call appending one block id."""
    s.stage(req, ([9], [9]), True)
    for i in range(n - 1):
        s.stage(req, ([100 + i], [200 + i]), False)


#: (case, stage the step): the writes of the step that prepare_inputs lands before it gathers and maps.
MAX_ROUNDS = int(stage_kernel.MAX_ROUNDS)
PREPARE_CASES = [
    ("decode writes", lambda s: [s.stage(r, ([r + 40], [r + 50]), False) for r in range(3)]),
    (f"{MAX_ROUNDS} rounds, laid over", lambda s: _rounds(s, 1, MAX_ROUNDS)),
    (f"{MAX_ROUNDS + 1} rounds: apply, then stage", lambda s: _rounds(s, 1, MAX_ROUNDS + 1)),
    (
        "300 values in column splits",
        lambda s: [s.stage(r, (list(range(1, 61)), list(range(70, 110))), False) for r in range(3)],
    ),
]


@pytest.mark.parametrize("case, step", PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_the_stage_kernel_with_writes_equals_the_apply_then_the_stage(case, step):
    """prepare_inputs in one launch: the apply programs and the stage programs run in any order (the interpreter runs
    the apply programs last, the overlay's hardest case): each stage program lays its row's staged writes over
    what it reads, the latest round winning."""
    s = Stage([16, 32], [16, 16], [80, 80], reqs=4)
    for r in range(4):
        s.stage(r, ([r + 1, r + 2], [r + 3]), True)
    s.bt.apply_staged_writes()
    s.ref.apply_staged_writes()
    step(s)
    idx, qsl = [1, 3, 0], [0, 2, 3, 4]
    held = [min(int(s.ref.num_blocks[g, r]) * k for g, k in enumerate(s.kbs)) for r in idx]
    pos = [held[0] - 1, 0, held[1] - 1, held[2] - 1]
    gathered, slots = s.bt.prepare_inputs(*_inputs(idx, qsl, pos), 4, 6)
    s.check(gathered, slots, idx, qsl, pos, 4, 6, what=case)


def test_the_stage_kernel_with_writes_into_more_tables_than_it_preloads():
    """Eight groups and the counts table are nine tables: the apply programs load descriptors one by one."""
    assert stage_kernel.NT == 8
    s = Stage([16] * 8, [16] * 8, [6] * 8, reqs=3)
    for r in range(3):
        s.stage(r, [[r * 10 + g + 1] for g in range(8)], True)
    idx, qsl, pos = [2, 0], [0, 1, 2], [5, 3]
    gathered, slots = s.bt.prepare_inputs(*_inputs(idx, qsl, pos), 3, 2)
    s.check(gathered, slots, idx, qsl, pos, 3, 2, what="eight groups")
