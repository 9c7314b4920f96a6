"""Tables whose memory intersects get a fully sequential write order in the Triton backends.

Found on the H200 (2026-11-30): two `StagedWriteTensor`s over one tensor, applied together, were merged
in true staging order and marked `may_overlap`, but the kernel's rounds grouped writes by (table, row),
so writes to the same cells through two different tables ran in one round, in parallel, and the earlier
write could win. The interpreter runs programs one after another and hid it; these tests pin the host
side (alias detection, one round per write) where it can be checked without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton_kernel = pytest.importorskip("multiwrite.backends.triton_kernel")


def test_views_of_one_tensor_alias_and_disjoint_slices_do_not():
    base = torch.zeros(8, 6, dtype=torch.int32)
    assert triton_kernel.tables_alias([base, base])
    assert triton_kernel.tables_alias([base[:4], base[3:]])  # row 3 in both
    assert triton_kernel.tables_alias([base, base.t()])  # transposed view: same cells
    assert triton_kernel.tables_alias([base[:, :3], base[:, 2:]])  # column 2 of every row in both
    assert not triton_kernel.tables_alias([base[:4], base[4:]])  # BlockTables' groups: disjoint slices
    assert not triton_kernel.tables_alias([base, torch.zeros(8, 6, dtype=torch.int32)])
    assert not triton_kernel.tables_alias([base[:0], base])  # an empty table touches nothing
    flat = torch.zeros(40, dtype=torch.int32)
    assert not triton_kernel.tables_alias([flat[:20].view(4, 5), flat[20:].view(4, 5)])
    assert triton_kernel.tables_alias([flat[:20].view(4, 5), flat[19:39].view(4, 5)])  # one shared cell


def test_sequential_rounds_keep_staging_order_one_write_per_round():
    meta = np.array([[0, 1, 0, 2, 0], [1, 1, 0, 2, 2], [0, 2, 0, 1, 4], [1, 1, 1, 1, 5]], dtype=np.int32)
    by_row, bounds = triton_kernel.overlap_rounds(meta)
    # (table, row) rounds: tables 0 and 1 are different keys, so writes 0 and 1 share round 0 ...
    assert bounds.tolist()[0:2] == [0, 3]
    seq, seq_bounds = triton_kernel.overlap_rounds(meta, sequential=True)
    # ... which is only right when the tables do not alias; sequential: each write alone, in order.
    np.testing.assert_array_equal(seq, meta)
    assert seq_bounds.tolist() == [0, 1, 2, 3, 4]


def test_aliasing_tables_get_descriptors_marked_aliased():
    writer = triton_kernel.TritonWriter(torch.device("cpu"), triton_kernel.cuda_launch_params(), ring_depth=1)
    base = torch.zeros(4, 4, dtype=torch.int32)
    other = torch.zeros(4, 4, dtype=torch.int32)
    assert writer._new_descriptors(("a",), [base, base[1:]]).aliased
    assert not writer._new_descriptors(("b",), [base, other]).aliased
