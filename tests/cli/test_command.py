"""The `multiwrite` command itself: it runs as `python -m multiwrite` and `python -m multiwrite.cli`, importing it and
building its parser load no torch (so that Ctrl-C while it starts ends quietly, and `--help` is instant), and its help
cites only files the repository has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from multiwrite.cli import SUBCOMMANDS, build_parser, main
from tests.support.processes import subprocess_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["multiwrite", "multiwrite.cli"])
def test_the_command_runs_as_a_module(module):
    proc = subprocess.run([sys.executable, "-m", module, "info"], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("multiwrite info\n") and "backends for cpu:" in proc.stdout


def test_the_command_stays_light_until_a_subcommand_runs():
    code = """
import sys
def loaded():
    return [m for m in ("torch", "numpy", "triton") if m in sys.modules]

import multiwrite.cli
assert loaded() == [], ("import multiwrite.cli", loaded())
multiwrite.cli.build_parser()  # the replay and bench parsers read the workload's constants: numpy, never torch
assert "torch" not in loaded() and "triton" not in loaded(), ("build_parser()", loaded())
try:
    multiwrite.cli.main(["replay", "--help"])
except SystemExit as exc:
    assert exc.code == 0
assert "torch" not in loaded(), ("replay --help", loaded())
assert multiwrite.cli.main(["info"]) == 0
assert "torch" in loaded()
"""
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_subcommand_is_registered_and_the_help_lists_them(capsys):
    assert list(SUBCOMMANDS) == ["replay", "info", "bench", "check-backend"]
    parser = build_parser()
    for name in SUBCOMMANDS:
        assert parser.parse_args([name, "x"] if name == "check-backend" else [name]).command == name
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("command", ["replay", "bench"])
def test_the_help_cites_benchmarks_md_and_no_file_outside_the_repository(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    cited = set(re.findall(r"[\w./-]+\.md\b", text))
    assert "BENCHMARKS.md" in cited and "ANCHORS" not in text
    assert [name for name in sorted(cited) if not (REPO / name).is_file()] == []
