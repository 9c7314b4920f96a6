"""A table whose own cells overlap in memory (issue 23, item 5b): refused, naming the table, its shape and strides,
on every backend, when it is installed (no backend would land writes to distinct cells at one address in staging
order); the Triton device's alias check counts such a table as aliasing (writes in strict staging order)."""

from __future__ import annotations

import pytest
import torch

from multiwrite import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from multiwrite.staging.table import self_overlaps

OVERLAPPING = {
    "rows two apart": lambda: torch.zeros(64, dtype=torch.int32).as_strided((4, 8), (2, 1)),
    "a zero row stride": lambda: torch.zeros(8, dtype=torch.int32).as_strided((4, 8), (0, 1)),
    "columns overlapping": lambda: torch.zeros(64, dtype=torch.int32).as_strided((2, 3), (2, 1)),
}
DISTINCT = {  # (built on the device under test: a forced GPU backend runs them there)
    "contiguous": lambda dev: torch.zeros(4, 8, dtype=torch.int32, device=dev),
    "transposed": lambda dev: torch.zeros(8, 4, dtype=torch.int32, device=dev).t(),
    "interleaved": lambda dev: torch.zeros(64, dtype=torch.int32, device=dev).as_strided((2, 3), (3, 2)),  # 0 2 4 3 5 7
    "one column, zero stride": lambda dev: torch.zeros(4, dtype=torch.int32, device=dev).as_strided((4, 1), (1, 0)),
}


@pytest.mark.parametrize("make", list(OVERLAPPING))
def test_a_table_whose_cells_overlap_is_refused_and_the_old_one_kept(backend, make):
    t = StagedWriteTensor((4, 8), torch.int32, backend.device, name="t")
    t.stage_write(1, 0, [7])
    old = t.tensor
    new = OVERLAPPING[make]().to(backend.device) if backend.device.type == "cpu" else None
    if new is None:  # (as_strided of a device tensor)
        base = torch.zeros(64, dtype=torch.int32, device=backend.device)
        new = base.as_strided((4, 8), (2, 1))
    with pytest.raises(StagedWriteError, match=r"t: a table whose cells overlap in memory \(shape \(\d, \d\), "
                                               r"strides \(\d, \d\)\) is refused"):  # fmt: skip
        t.tensor = new
    assert t.tensor is old and t.num_staged_writes == 1
    FusedStagedWriter(backend.device, backend.name).apply([t])
    assert t.tensor[1, 0].item() == 7


@pytest.mark.parametrize("make", list(OVERLAPPING))
def test_overlapping_cells_are_found(make):
    assert self_overlaps(OVERLAPPING[make]())


@pytest.mark.parametrize("make", list(DISTINCT))
def test_distinct_cells_are_not_refused(backend, make):
    table = DISTINCT[make](backend.device)
    assert not self_overlaps(table)
    t = StagedWriteTensor(tuple(table.shape), torch.int32, backend.device, name="t")
    t.tensor = table
    t.stage_write(table.shape[0] - 1, 0, [5] * table.shape[1])
    FusedStagedWriter(backend.device, backend.name).apply([t])
    assert table[-1].tolist() == [5] * table.shape[1]


def test_the_triton_alias_check_counts_a_self_overlapping_table():
    from multiwrite.backends.triton.device import tables_alias

    assert tables_alias([OVERLAPPING["rows two apart"]()])
    assert not tables_alias([torch.zeros(4, 8), torch.zeros(4, 8)])
