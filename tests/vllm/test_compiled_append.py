"""`multiwrite.vllm.BlockTables.append_block_ids` is compiled (`_cstaging.VllmStaging`): vLLM's common call stages
straight into the core's staging, every other call takes the adapter's Python path. Both stage the same bytes,
counts and errors, checked here against the Python path alone (`PyVllmStaging` first in the bases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiwrite.errors import BlockTableWriteError
from multiwrite.staging.fields import COMPILED
from multiwrite.testing.staging import PythonStagedBlockTables
from multiwrite.vllm import BlockTables
from multiwrite.vllm.block_tables import PyVllmStaging

pytestmark = pytest.mark.skipif(not COMPILED, reason="the compiled staging helper is not built")


class PythonPath(PyVllmStaging, BlockTables):
    """The adapter with its Python `append_block_ids` only."""


def make(device: torch.device, cls=BlockTables) -> BlockTables:
    """On the device under test (tests/vllm/conftest.py): the staging is the host's whatever it is."""
    return cls([16, 32, 8], 6, 64, [5, 4, 8], device)


def staged(bt: BlockTables) -> tuple:
    arena = bt.core.block_tables[0].arena
    return (arena.meta[: arena.num_writes].tolist(), arena.values[: arena.num_values].tolist(),
            bt.num_blocks.np.tolist(), bool(arena.may_overlap))  # fmt: skip


CALLS = [
    (0, [[1, 2], [3], [4, 5, 6]], True),
    (0, ([7], [], [8]), False),  # a tuple; a group given nothing
    (1, [[9], [10], [11], [99, 98]], True),  # entries past the groups are ignored
    (2, [(12, 13), [14], []], True),
    (0, [[15], [16], [17]], False),  # a second write to row 0: overlapping
    (3, [[2**31 - 1], [0], [0]], True),  # the largest id
    (4, [[], [], []], True),  # an overwrite with nothing resets the counts
]


def test_the_compiled_path_is_the_public_method_and_is_bound_to_the_core(device):
    bt = make(device)
    assert type(bt).append_block_ids is not PyVllmStaging.append_block_ids
    assert bt.staging_core is bt.core


def test_it_stages_exactly_what_the_python_path_stages(device):
    ours, twin = make(device), make(device, PythonPath)
    for call in CALLS:
        ours.append_block_ids(*call)
        twin.append_block_ids(*call)
        assert staged(ours) == staged(twin), call
    ours.apply_staged_writes()
    twin.apply_staged_writes()
    for a, b in zip(ours.block_tables, twin.block_tables):
        np.testing.assert_array_equal(a.gpu.cpu().numpy(), b.gpu.cpu().numpy())


@pytest.mark.parametrize("ids", [[[5, 6, 7], [8], [1, 2]], [np.array([5, 6]), (8,), []], [[5, True], [-1], [2**40]]])
def test_the_null_block_redirect_stages_zeros_whatever_the_ids(ids, device):
    """Only the lengths are read (a numpy array of ids, or ids that would be refused, included)."""
    ours, twin = make(device), make(device, PythonPath)
    for bt in (ours, twin):
        bt.redirect_writes_to_null_block = True
        bt.append_block_ids(2, ids, True)
        bt.append_block_ids(2, [[3]] * 4, False)
    assert staged(ours) == staged(twin)
    assert ours.num_blocks.np[:, 2].tolist() == [len(ids[0]) + 1, len(ids[1]) + 1, len(ids[2]) + 1]


BAD_CALLS = [
    ((9, [[1], [2], [3]], True), r"request row 9 is outside \[0, 6\)"),
    ((0, [[1], [2]], True), "got block ids for 2 KV-cache groups, the tables have 3"),
    ((0, [[1] * 6, [2], [3]], True), "past the row width 5"),
    ((0, [[1], [-2], [3]], True), "block id -2 is negative"),
    ((0, [[1], [True], [3]], True), "a bool block id"),
    ((0, [[1], [2], [3]], "yes"), "overwrite must be a bool"),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_a_refused_call_raises_the_python_paths_error_and_stages_nothing(call, message, device):
    ours, twin = make(device), make(device, PythonPath)
    ours.append_block_ids(1, [[1], [2], [3]], True)
    twin.append_block_ids(1, [[1], [2], [3]], True)
    errors = []
    for bt in (ours, twin):
        with pytest.raises(BlockTableWriteError, match=message) as info:
            bt.append_block_ids(*call)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and errors[0].startswith(f"append_block_ids for request {call[0]}: ")
    assert staged(ours) == staged(twin)


def test_keywords_and_a_core_staging_in_python_take_the_python_path(device):
    bt = make(device)
    bt.append_block_ids(req_index=0, new_block_ids=[[1], [2], [3]], overwrite=True)
    assert bt.num_blocks.np[:, 0].tolist() == [1, 1, 1]
    twin = make(device)
    twin._bind_vllm(None)  # (what a core staging in Python binds)
    twin.append_block_ids(0, [[1], [2], [3]], True)
    assert staged(bt) == staged(twin)


def test_a_core_that_stages_in_python_is_not_bound(monkeypatch, device):
    import multiwrite.vllm.block_tables as adapter

    monkeypatch.setattr(adapter, "CoreBlockTables", PythonStagedBlockTables)
    bt = make(device)
    assert bt.staging_core is None
    bt.append_block_ids(0, [[1], [2], [3], [4]], True)
    assert bt.num_blocks.np[:, 0].tolist() == [1, 1, 1]


def test_tables_without_groups_stage_nothing(device):
    bt = BlockTables([], 4, 64, [], device)
    bt.append_block_ids(0, [], True)
    bt.append_block_ids(9, [[1]], "not even a bool")
    assert bt.staging_core is None and bt.num_blocks.np.shape == (0, 4)
