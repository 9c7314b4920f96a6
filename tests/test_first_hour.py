"""What a new user hits in the first hour: each case is a report of a fresh-eyes trial, fixed for its kind."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*argv: str, pre: str = "") -> subprocess.CompletedProcess:
    """Run `python -m multiwrite ARGV` (after `pre`, Python run first in the same process)."""
    code = (
        f"import runpy, sys\n{pre}\nsys.argv = ['multiwrite', *{list(argv)!r}]\n"
        "runpy.run_module('multiwrite', run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# 1. check-backend refuses up front (exit 2, one line) what would fail every property.


def test_check_backend_without_the_test_extra_is_one_line_exit_2():
    r = _cli("check-backend", "torch-cpu", pre="sys.modules['pytest'] = None; sys.modules['hypothesis'] = None")
    assert r.returncode == 2, r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "multiwrite[test]" in lines[0] and "pytest" in lines[0], r.stderr
    assert "FAIL" not in r.stdout


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("check-backend", "nope"), "registered backends: "),
        (("check-backend", "compiled-cpu", "--device", "cuda"), "cannot run"),
    ],
)
def test_check_backend_unknown_or_unavailable_backend_is_one_line_exit_2(argv, needle):
    r = _cli(*argv)
    assert r.returncode == 2, r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert ("torch-cpu" if "nope" in argv else "compiled-cpu") in lines[0]
    assert "FAIL" not in r.stdout


# 2. Ctrl-C while the command starts: `import multiwrite.cli` loads neither torch nor numpy.


def test_importing_the_cli_loads_neither_torch_nor_numpy():
    code = (
        "import sys, multiwrite.cli\n"
        "heavy = [m for m in ('torch', 'numpy', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import multiwrite\n"
        "from multiwrite import BlockTables, StagedWriteTensor, hookimpl, __version__\n"
        "assert 'torch' in sys.modules and set(multiwrite.__all__) <= set(dir(multiwrite))\n"
        "assert multiwrite.BlockTables is BlockTables\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_unknown_public_name_is_an_attribute_error():
    import multiwrite

    with pytest.raises(AttributeError, match="no_such_name"):
        multiwrite.no_such_name  # noqa: B018


# 7. StageInputError is public, where the other errors are.


def test_stage_input_error_is_importable_from_multiwrite_and_errors():
    import multiwrite
    import multiwrite.errors
    import multiwrite.stage

    assert multiwrite.StageInputError is multiwrite.errors.StageInputError is multiwrite.stage.StageInputError
    assert "StageInputError" in multiwrite.__all__
    assert issubclass(multiwrite.StageInputError, ValueError)


# 3. Every argparse error is one line on stderr, exit 2, for every subcommand.


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (("replay", "--block-sizes", "16,,8"), "multiwrite replay: error: argument --block-sizes: empty item"),
        (("replay", "--steps", "0"), "multiwrite replay: error: argument --steps: "),
        (("replay", "--overlap-rate", "nan"), "multiwrite replay: error: argument --overlap-rate: "),
        (("replay", "--block-sizes", "16,16", "--kernel-block-sizes", "16"), "multiwrite replay: error: "),
        (("bench", "--configs", "G9"), "multiwrite bench: error: argument --configs: "),
        (("check-backend", "torch-cpu", "--examples", "0"), "multiwrite check-backend: error: argument --examples"),
        (("info", "--bogus"), "multiwrite: error: unrecognized arguments: --bogus"),
        (("nosuch",), "multiwrite: error: argument command: invalid choice"),
    ],
)
def test_argparse_errors_are_one_line(argv, prefix):
    r = subprocess.run([sys.executable, "-m", "multiwrite", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), r.stderr
    assert "usage:" not in r.stderr and r.stdout == ""


# 4. append_block_ids(overwrite=...) takes a bool only, on both staging paths; 6. a dict of groups is named.


def _tables():
    from multiwrite import BlockTables

    return BlockTables([16, 32], 4, [10, 10], "cpu", backend="torch-cpu")  # CPU tables whatever tox -e cuda forces


@pytest.mark.parametrize("bad", ["no", None, 1, 0.0, "False"])
def test_overwrite_must_be_a_bool(staging, bad):
    from multiwrite import StagedWriteError

    bt = _tables()
    bt.append_block_ids(0, [[1], [2]], True)
    with pytest.raises(StagedWriteError, match=rf"overwrite must be a bool.*got {bad!r}"):
        bt.append_block_ids(0, [[3], [4]], bad)
    bt.append_block_ids(1, [[5], [6]], __import__("numpy").bool_(True))  # numpy's bool is a bool
    bt.apply_staged_writes()
    assert bt[0].tensor[:2, 0].tolist() == [1, 5]  # row 0 kept its ids, row 1 was written from column 0
    assert bt[1].tensor[:2, :2].tolist() == [[2, 0], [6, 0]]  # the refused write (ids 3, 4) staged nothing


def test_a_dict_of_groups_is_refused_as_such(staging):
    from multiwrite import StagedWriteError

    bt = _tables()
    with pytest.raises(StagedWriteError, match="a dict is not a sequence of per-group lists"):
        bt.append_block_ids(0, {0: [1], 1: [2]}, True)
