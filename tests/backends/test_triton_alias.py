"""Tables whose memory intersects (views of one tensor) get a strictly sequential write order in the Triton backends.

Grouping a batch's writes in rounds by (table, row) is only right when the tables do not alias: through two views of
one tensor, writes to different (table, row) pairs may hit one cell, and writes of one round run in parallel on a GPU,
so the earlier write could win. Triton's interpreter runs programs one after another and cannot show that race: these
tests pin the host side (alias detection, one round per write) where it is decided, white-box, plus the result."""

from __future__ import annotations

import numpy as np
import torch

from multiwrite import FusedStagedWriter, StagedWriteTensor
from multiwrite.backends.triton.backend import TritonCudaBackend
from multiwrite.backends.triton.device import TritonDevice, tables_alias
from multiwrite.staging.arena import overlap_rounds
from tests.support.tables import host

CPU = torch.device("cpu")


def test_views_of_one_tensor_alias_and_disjoint_slices_do_not():
    base = torch.zeros(8, 6, dtype=torch.int32)
    assert tables_alias([base, base])
    assert tables_alias([base[:4], base[3:]])  # row 3 in both
    assert tables_alias([base, base.t()])  # a transposed view: the same cells
    assert tables_alias([base[:, :3], base[:, 2:]])  # column 2 of every row in both
    assert not tables_alias([base[:4], base[4:]])  # a BlockTables' groups: disjoint slices of one allocation
    assert not tables_alias([base, torch.zeros(8, 6, dtype=torch.int32)])
    assert not tables_alias([base[:0], base])  # an empty table touches nothing
    flat = torch.zeros(40, dtype=torch.int32)
    assert not tables_alias([flat[:20].view(4, 5), flat[20:].view(4, 5)])
    assert tables_alias([flat[:20].view(4, 5), flat[19:39].view(4, 5)])  # one shared cell


def test_rounds_group_writes_by_table_and_row_and_sequential_rounds_keep_one_write_each():
    meta = np.array([[0, 1, 0, 2, 0], [1, 1, 0, 2, 2], [0, 2, 0, 1, 4], [1, 1, 1, 1, 5]], dtype=np.int32)
    perm, bounds = overlap_rounds(meta)
    # (table, row) rounds: tables 0 and 1 are different keys, so writes 0, 1 and 2 share round 0, write 3 is round 1
    assert bounds.tolist() == [0, 3, 4] and perm.tolist() == [0, 1, 2, 3]
    perm, bounds = overlap_rounds(meta, sequential=True)  # aliasing tables: each write alone, in staging order
    assert perm.tolist() == [0, 1, 2, 3] and bounds.tolist() == [0, 1, 2, 3, 4]


def test_an_apply_to_aliasing_tables_lands_in_staging_order_one_write_per_round(monkeypatch):
    base = torch.zeros(4, 6, dtype=torch.int32)
    a = StagedWriteTensor((4, 6), torch.int32, CPU, name="a")
    b = StagedWriteTensor((6, 4), torch.int32, CPU, name="b")
    a.tensor = base
    b.tensor = base.t()  # b[c, r] is a[r, c]
    a.stage_write(1, 0, [1, 2, 3])
    b.stage_write(1, 1, [7])  # a[1, 1]: later, wins over a's write
    a.stage_write(2, 0, [4])
    b.stage_write(0, 2, [8, 9])  # a[2, 0] and a[3, 0]: over a's write to a[2, 0]
    a.stage_write(1, 1, [5])  # the latest write to a[1, 1]
    rounds: list[int] = []
    real = TritonDevice.launch_apply

    def record(self, lease, desc, w, v, num_rounds, np_dtype):
        rounds.append((num_rounds, desc.aliased))
        return real(self, lease, desc, w, v, num_rounds, np_dtype)

    monkeypatch.setattr(TritonDevice, "launch_apply", record)
    FusedStagedWriter(CPU, backend=TritonCudaBackend()).apply([b, a])  # (either argument order: staging order)
    assert rounds == [(5, True)]
    want = np.zeros((4, 6), np.int64)
    want[1, :3] = [1, 5, 3]
    want[2, 0], want[3, 0] = 8, 9
    np.testing.assert_array_equal(host(base), want)
