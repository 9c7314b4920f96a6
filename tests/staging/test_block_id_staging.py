"""The staging of block ids (`multiwrite.staging.block_ids`): the compiled `BlockIdStaging` (C, what `BlockTables`
inherits where the helper is built) and its Python twin stage the same bytes and raise the same errors on the same
calls; the helper, once built, is the one `BlockTables` runs; the overlap flag of a batch of block ids; and staging
that outgrows the arena in the middle of a call.

Both paths through `multiwrite.testing.staging.block_tables_class("c")` / `("python")`. What is staged is read from
the arena (`StagedWriteTensor.arena`: the `WriteBatch` a backend receives) and from what a recording backend is
handed at apply.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multiwrite.staging
from multiwrite import BlockTables, StagedWriteError
from multiwrite.reference import ReferenceBlockTables
from multiwrite.staging import fields
from multiwrite.staging.arena import StagingArena
from multiwrite.staging.block_ids import PyBlockIdStaging
from multiwrite.testing.staging import PythonStagedBlockTables, block_tables_class
from tests.support.backends import RecordingBackend
from tests.support.tables import host, mismatches

BS, KBS, WIDTHS, REQS = [16, 32, 8], [16, 16, 8], [6, 5, 7], 5  # kernel blocks per block: 1, 2, 1
needs_c = pytest.mark.skipif(not fields.COMPILED, reason="multiwrite.staging._cstaging is not built")


def built_helpers() -> list[Path]:
    """The compiled helper files installed next to the package (any extension suffix of this interpreter)."""
    here = Path(multiwrite.staging.__file__).parent
    return sorted(p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in here.glob(f"_cstaging{suffix}"))


# -- the compiled helper is taken where it is built -----------------------------------------------------------
def test_an_installed_helper_imports_and_is_what_block_tables_runs():
    if not built_helpers():
        pytest.skip("no compiled staging helper next to the package (installed without a C compiler)")
    module = importlib.import_module("multiwrite.staging._cstaging")  # a broken build fails here, with its reason
    assert fields.COMPILED, "the helper imports, but multiwrite.staging.fields fell back to the Python twins"
    assert issubclass(BlockTables, module.BlockIdStaging)
    assert BlockTables.append_block_ids is module.BlockIdStaging.append_block_ids
    assert BlockTables.append_block_ids_batch is module.BlockIdStaging.append_block_ids_batch
    assert issubclass(StagingArena, module.ArenaFields) and fields.LeaseFields is module.LeaseFields
    assert block_tables_class("c") is BlockTables and block_tables_class("default") is BlockTables
    # and the twin really is the twin
    assert PythonStagedBlockTables.append_block_ids is PyBlockIdStaging.append_block_ids
    assert PythonStagedBlockTables.append_block_ids_batch is PyBlockIdStaging.append_block_ids_batch


def test_a_machine_with_a_c_compiler_and_python_headers_has_the_helper_built():
    """README: the install compiles the helper when a C compiler and the Python headers are present (the build is
    optional, so a failing build would go unnoticed but for this)."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not cc or shutil.which(cc[0]) is None or not headers.exists():
        pytest.skip("no C compiler or no Python headers here: the helper is optional")
    assert built_helpers(), (
        f"{cc[0]} and {headers} exist but multiwrite/staging has no compiled _cstaging: the optional build failed "
        "(reinstall with `pip install -v` to see why)"
    )


# -- the twin stages the same bytes and raises the same errors ------------------------------------------------
def tables(path: str) -> BlockTables:
    return block_tables_class(path)(BS, REQS, WIDTHS, "cpu", KBS, backend=RecordingBackend())


GOOD_ID = st.integers(0, 999)
BAD_ID = st.sampled_from([-1, 2**31, 2**30, 10**400, True, np.bool_(False), 1.5, None, "3", np.int64(7), np.uint8(250)])
CONTAINERS = ["list", "list", "list", "tuple", "int64-array"]
good_groups = st.tuples(
    st.sampled_from(["groups", "groups", "groups", "tuple-of-groups", "generator-of-groups"]),
    st.lists(st.tuples(st.sampled_from(CONTAINERS), st.lists(GOOD_ID, max_size=2)), min_size=3, max_size=3),
)
bad_groups = st.one_of(
    st.tuples(st.just("groups"), st.lists(  # a bad id somewhere, a float array, a generator (no sequence)
        st.tuples(st.sampled_from([*CONTAINERS, "float-array", "generator"]),
                  st.lists(st.one_of(GOOD_ID, BAD_ID), max_size=3)),
        min_size=3, max_size=3)),
    st.tuples(st.just("groups"), st.lists(  # a wrong group count
        st.tuples(st.just("list"), st.lists(GOOD_ID, max_size=2)), min_size=2, max_size=4)),
    st.tuples(st.sampled_from(["dict", "none", "int"]), st.just([])),
)  # fmt: skip
GOOD_CALL = st.tuples(
    st.integers(0, REQS - 1),
    good_groups,
    st.sampled_from([True, False, False, True, False, np.bool_(True), np.bool_(False)]),
    st.sampled_from(["positional", "positional", "keyword", "all-keywords"]),
)
BAD_CALL = st.one_of(
    st.tuples(st.integers(0, REQS - 1), bad_groups, st.booleans(), st.just("positional")),
    st.tuples(st.sampled_from([-1, REQS, True, np.int64(2), 1.5, "a", 2**70]), good_groups, st.booleans(),
              st.just("positional")),
    st.tuples(st.integers(0, REQS - 1), good_groups, st.sampled_from(["no", None, 1]), st.just("keyword")),
)  # fmt: skip
CALL = st.integers(0, 7).flatmap(lambda i: BAD_CALL if i == 0 else GOOD_CALL)  # one call in 8 refused
OPERATION = st.sampled_from(["call"] * 6 + ["batch", "batch", "apply", "clear"]).flatmap(
    lambda kind: st.tuples(st.just("call"), CALL) if kind == "call"
    else st.tuples(st.just("batch"), st.lists(CALL, max_size=5), st.sampled_from(["per-call", "one-bool", "one-short"]))
    if kind == "batch" else st.just((kind,))
)  # fmt: skip


def build_ids(kind: str, values: list):
    if kind == "tuple":
        return tuple(values)
    if kind == "int64-array":
        return np.asarray([v if isinstance(v, (int, np.integer)) and -(2**63) <= v < 2**63 else 0 for v in values],
                          dtype=np.int64)  # fmt: skip
    if kind == "float-array":
        return np.asarray([float(v) if isinstance(v, (int, float)) and abs(v) < 1e300 else 0.0 for v in values])
    if kind == "generator":
        return (v for v in values)
    return list(values)


def build_groups(spec):
    kind, groups = spec
    per_group = [build_ids(k, v) for k, v in groups]
    return {
        "groups": lambda: per_group,
        "tuple-of-groups": lambda: tuple(per_group),
        "generator-of-groups": lambda: (g for g in per_group),
        "dict": lambda: {0: [1]},
        "none": lambda: None,
        "int": lambda: 5,
    }[kind]()


def call(bt: BlockTables, spec) -> None:
    req, groups, overwrite, form = spec
    ids = build_groups(groups)
    if form == "positional":
        bt.append_block_ids(req, ids, overwrite)
    elif form == "keyword":
        bt.append_block_ids(req, ids, overwrite=overwrite)
    else:
        bt.append_block_ids(overwrite=overwrite, new_block_ids=ids, req_index=req)


def batch(bt: BlockTables, calls, flags: str) -> None:
    reqs = [c[0] for c in calls]
    ids = [build_groups(c[1]) for c in calls]
    if flags == "per-call":
        bt.append_block_ids_batch(reqs, ids, [c[2] for c in calls])
    elif flags == "one-bool":
        bt.append_block_ids_batch(reqs, ids, True)
    else:  # one flag fewer than calls: refused before anything is staged
        bt.append_block_ids_batch(reqs, ids, [c[2] for c in calls][:-1])


def outcome(run) -> tuple | None:
    """None, or what was raised: its type, message, and its cause's type and message."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the point is to compare every kind of error
        cause = exc.__cause__
        return type(exc), str(exc), type(cause), str(cause) if cause is not None else None
    return None


def arena_state(bt: BlockTables) -> tuple:
    arena = bt[0].arena
    return (arena.meta[: arena.num_writes].tolist(), arena.values[: arena.num_values].tolist(), arena.may_overlap,
            bt.num_blocks.tolist(), [t.num_staged_writes for t in bt.block_tables])  # fmt: skip


@needs_c
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(OPERATION, min_size=1, max_size=25))
def test_the_python_twin_stages_the_same_bytes_and_raises_the_same_errors(operations):
    c, py = tables("c"), tables("python")
    for op in operations:
        if op[0] == "call":
            results = [outcome(lambda bt=bt, op=op: call(bt, op[1])) for bt in (c, py)]
        elif op[0] == "batch":
            results = [outcome(lambda bt=bt, op=op: batch(bt, op[1], op[2])) for bt in (c, py)]
        elif op[0] == "apply":
            results = [outcome(bt.apply_staged_writes) for bt in (c, py)]
        else:
            results = [outcome(bt.clear_staged_writes) for bt in (c, py)]
        assert results[0] == results[1], op
        assert arena_state(c) == arena_state(py), op
    c.apply_staged_writes()
    py.apply_staged_writes()
    assert len(c.backend.calls) == len(py.backend.calls)
    for got, want in zip(c.backend.calls, py.backend.calls):
        (g,), (w,) = got, want
        assert (g.meta.tolist(), g.values.tolist(), g.may_overlap) == (w.meta.tolist(), w.values.tolist(),
                                                                       w.may_overlap)  # fmt: skip
    for a, b in zip(c.block_tables, py.block_tables):
        assert host(a.tensor).tolist() == host(b.tensor).tolist()
    assert host(c.num_blocks_device).tolist() == host(py.num_blocks_device).tolist()


class _Shrinking:
    """A request row whose `__index__` empties the batch's list of rows (the twin runs it, in C's fallback too)."""

    def __init__(self, rows: list, row: int):
        self.rows, self.row = rows, row

    def __index__(self) -> int:
        self.rows.clear()
        return self.row


@needs_c
@pytest.mark.parametrize("flags", ["one-bool", "per-call"])
def test_a_batch_whose_rows_change_while_it_stages_stages_what_the_twin_stages(flags):
    states = []
    for path in ("c", "python"):
        bt = tables(path)
        reqs = [0, None, 2, 3]
        reqs[1] = _Shrinking(reqs, 1)
        bt.append_block_ids_batch(reqs, [[[1], [2], [3]]] * 4, True if flags == "one-bool" else [True] * 4)
        states.append(arena_state(bt))
    assert states[0] == states[1]
    assert states[0][3] == [[1, 1, 0, 0, 0], [2, 2, 0, 0, 0], [1, 1, 0, 0, 0]]  # calls 0 and 1, then the list was gone


# -- the overlap flag of a batch of block ids -----------------------------------------------------------------
def test_the_overlap_flag_follows_the_rows_a_batch_writes(staging):
    """Backends that write in parallel (the Triton kernel) rely on `WriteBatch.may_overlap` to keep staging order:
    true exactly when a (table, row) is written twice in one batch, or a group is staged directly."""
    bt = block_tables_class(staging)([16, 32], 4, [8, 8], "cpu", [16, 16], backend=RecordingBackend())
    arena = bt[0].arena
    bt.append_block_ids(0, ([1], [2]), True)
    bt.append_block_ids(1, ([3], []), True)
    bt.append_block_ids(2, ([], [4]), False)
    assert arena.may_overlap is False  # distinct rows
    bt.append_block_ids(1, ([5], []), False)  # row 1 again in the same batch
    assert arena.may_overlap is True
    bt.apply_staged_writes()
    assert bt.backend.last.may_overlap is True
    bt.append_block_ids(1, ([6], []), False)  # a new batch: row 1 is free again
    bt.apply_staged_writes()
    assert bt.backend.last.may_overlap is False
    bt.append_block_ids(3, ([7], []), True)
    bt.clear_staged_writes()
    bt.append_block_ids(3, ([8], []), True)  # a clear starts a new batch too
    assert arena.may_overlap is False
    with pytest.raises(StagedWriteError, match="block id -1 is negative"):
        bt.append_block_ids(2, ([5], [-1]), True)  # refused after group 0 was looked at: leaves no stamp
    bt.append_block_ids(2, ([5], [6]), True)
    bt.apply_staged_writes()
    assert bt.backend.last.may_overlap is False
    bt.append_block_ids(0, ([9], []), False)
    bt[0].stage_write(3, 1, [9])  # a write staged straight into a group: assumed to overlap
    assert arena.may_overlap is True
    bt.apply_staged_writes()
    assert bt.backend.last.may_overlap is True
    assert host(bt[0].tensor)[:, :3].tolist() == [[1, 9, 0], [3, 5, 6], [5, 0, 0], [8, 9, 0]]


# -- staging that outgrows the arena in the middle of a call --------------------------------------------------
def test_staging_that_outgrows_the_arena_in_the_middle_of_a_call_loses_nothing(backend, staging):
    """On every backend: a backend that lends the arena its memory (the Triton ring) grows it through its lender."""
    bt = block_tables_class(staging)([16, 32], 3, [1024, 600], backend.device, [16, 16], backend=backend.name)
    ref = ReferenceBlockTables([16, 32], 3, [1024, 600], [16, 16])
    calls = [
        (0, (np.arange(1000), list(range(1, 300))), True),  # 1000 + 598 values: past the first 1024 mid-call
        (1, (list(range(500, 600)), np.arange(7, 9)), True),
        (2, ([np.int64(5)] * 3, []), True),
        (1, (list(range(9)), [3]), False),
        *[(r % 3, ([r], [r, r + 1]), False) for r in range(70)],  # and past the first 64 metadata rows
    ]
    for req, ids, overwrite in calls:
        bt.append_block_ids(req, ids, overwrite)
        ref.append_block_ids(req, ids, overwrite)
    bt.apply_staged_writes()
    ref.apply_staged_writes()
    assert mismatches(bt, ref) == []


@needs_c
def test_collected_tables_release_the_compiled_stagings_views_of_their_count_arrays(auto_selection):
    """The compiled staging holds buffer views of the host counts while bound (each view references its array); once
    its `BlockTables` is collected, none may remain, or the arrays stay alive for the process (found in review: a GC
    refactor dropped the release from the type's `tp_clear`). CPU tables on the backend dispatch selects (the forced
    matrix on the H200 forced triton-cuda onto them, which cannot run there: the test failed)."""
    import gc
    import weakref

    bt = BlockTables(BS, REQS, WIDTHS, "cpu", kernel_block_sizes=KBS)
    assert type(bt).append_block_ids is fields._cstaging.BlockIdStaging.append_block_ids  # (the compiled staging)
    counts = weakref.ref(bt.num_blocks)
    bt.append_block_ids(0, [[1], [2], [3]], True)
    del bt
    gc.collect()
    assert counts() is None
