"""The conformance kit (`multiwrite.testing`), shipped for backend authors: its suite and property tests collected here
so that they run against every built-in backend and staging path of the matrix (conftest.py points the kit's
fixtures at each case), and the kit's own public helpers: the devices it tries, the tables it builds, and the
fixtures an author overrides."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from multiwrite import BlockTables
from multiwrite.testing.plugin import Kit, candidate_devices
from multiwrite.testing.properties import *  # noqa: F403  (the kit's property tests, collected here)
from multiwrite.testing.staging import PythonStagedBlockTables, block_tables_class
from multiwrite.testing.suite import *  # noqa: F403  (the kit's suite, collected here)
from tests.support.processes import subprocess_env
from tests.support.tables import CPU


def test_the_kit_tries_the_current_gpu_then_xpu_then_mps_then_cpu(monkeypatch):
    assert candidate_devices()[-1] == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    if getattr(torch, "xpu", None) is not None:
        monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    expected = [torch.device("cuda", 1), torch.device("mps"), torch.device("cpu")]
    if getattr(torch, "xpu", None) is not None:
        expected.insert(1, torch.device("xpu", 0))
    assert candidate_devices() == expected


def _kit(made: list | None = None) -> Kit:
    def tensor(shape, dtype):
        if made is not None:
            made.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    return Kit(CPU, torch.device("cpu"), tensor, lambda t: t.detach().cpu().numpy(), 5)


CALLS = [(0, ([1, 2], [3], [4, 5]), True), (1, ([6], [], [7]), True), (0, ([8], [9], []), False),
         (1, ([10], [11], [12]), True)]  # fmt: skip


@pytest.mark.parametrize("staging", ["c", "python", "default"])
def test_kit_block_tables_stage_through_the_path_asked_for_on_the_backend_under_test(staging):
    if staging == "c":
        pytest.importorskip("multiwrite.staging._cstaging", reason="the compiled staging helper is not built")
    kit = _kit()
    bt = kit.block_tables([16, 32, 8], 2, [4, 4, 4], [16, 16, 8], staging=staging, max_num_batched_tokens=8)
    assert type(bt) is (PythonStagedBlockTables if staging == "python" else BlockTables)
    assert type(bt) is block_tables_class(staging)
    assert bt.backend.NAME == CPU and bt.max_num_batched_tokens == 8  # keywords reach BlockTables
    for call in CALLS:
        bt.append_block_ids(*call)
    bt.append_block_ids_batch([0], [([13], [], [14])], [False])
    bt.apply_staged_writes()
    assert kit.host(bt[0].tensor)[:, :3].tolist() == [[1, 2, 8], [10, 0, 0]]
    assert kit.host(bt[1].tensor)[:, :4].tolist() == [[6, 7, 18, 19], [22, 23, 0, 0]]
    assert kit.host(bt[2].tensor)[:, :3].tolist() == [[4, 5, 14], [12, 0, 0]]
    assert kit.host(bt.num_blocks_device).tolist() == [[4, 1], [4, 2], [3, 1]]


def test_an_unknown_staging_path_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"staging='fast' \(known: c, python, default\)"):
        block_tables_class("fast")


def test_kit_tables_come_from_the_authors_tensor_factory_and_apply_on_the_backend_under_test():
    made: list = []
    kit = _kit(made)
    t = kit.table((2, 4), torch.int64, name="t", kernel_blocks_per_block=2)
    t.stage_write(1, 0, [3, 2**40])
    writer = kit.writer()
    writer.apply([t])
    assert made == [((2, 4), torch.int64)] and writer.backend.NAME == CPU
    np.testing.assert_array_equal(kit.host(t.tensor), [[0, 0, 0, 0], [6, 7, 2**41, 2**41 + 1]])


# An author's package: a conftest that overrides the kit's fixtures for "their" device, and a test file that imports
# one property of the suite, run with --multiwrite-backend, which adds the whole suite too.
AUTHOR_CONFTEST = """
import torch
import pytest

MADE = []

@pytest.fixture
def multiwrite_backend_name():
    return "torch-cpu"

@pytest.fixture
def multiwrite_tensor_factory():
    def make(shape, dtype):
        MADE.append(tuple(shape))
        return torch.zeros(shape, dtype=dtype)
    return make

@pytest.fixture
def multiwrite_to_host():
    return lambda t: t.detach().clone().numpy()
"""
AUTHOR_TESTS = """
from multiwrite.testing.suite import kit, test_kernel_block_expansion  # noqa: F401

def test_zz_the_overrides_were_used():
    from conftest import MADE
    assert (2, 8) in MADE  # the table of test_kernel_block_expansion came from the author's factory
"""


def test_an_authors_overrides_are_used_and_a_property_imported_twice_runs_once(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(AUTHOR_CONFTEST))
    (tmp_path / "test_author.py").write_text(textwrap.dedent(AUTHOR_TESTS))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--multiwrite-backend", "torch-cpu", "--multiwrite-device", "cpu", "-k",
                           "kernel_block_expansion or overrides", "test_author.py"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]  # the author's copy of the property, and the check
