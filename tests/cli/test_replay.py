"""`multiwrite replay`: the small trace replayed and verified, what it reports, a backend that writes wrong values
caught (exit 1), bad traces named by file and line, the kernel block sizes' default rule, and a progress bar only
where stderr is a terminal."""

from __future__ import annotations

import os
import subprocess

import pytest

from multiwrite import Backend, WriteBatch, select_backend
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from tests.conftest import CPU_DEFAULT
from tests.support.processes import SMALL_TRACE, multiwrite_command, subprocess_env

CPU = ["--device", "cpu", "--no-progress"]


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """These runs choose their backend: a forced one (tox -e cuda) must not leak in."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def _report(out: str) -> dict[str, str]:
    """The `  key  value` lines of a replay report."""
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    return {line[:21].strip(): line[21:] for line in lines}


def test_the_small_trace_replays_with_zero_mismatches_and_says_what_ran(capsys):
    argv = ["replay", "--trace", SMALL_TRACE, "--concurrency", "3", "--steps", "40", "--check-every", "7"]
    assert main([*argv, "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # stderr is no terminal here: no progress bar, even without --no-progress
    lines = captured.out.splitlines()
    assert lines[0] == "multiwrite replay" and lines[-1] == "result: OK, zero mismatches"
    report = _report(captured.out)
    # the README's sample report
    assert list(report) == ["trace", "token caps", "backend", "device", "versions", "groups", "concurrency", "steps",
                            "writes", "overlaps", "block ids written", "checks", "mismatches", "apply host time",
                            "staging + apply"]  # fmt: skip
    assert report["trace"] == f"{SMALL_TRACE} (6 requests)"
    assert report["token caps"] == "prompts cut to 8192 tokens (0 longer in this trace), outputs to 8192 (0 longer)"
    assert report["backend"] == CPU_DEFAULT and report["device"].startswith("cpu (")
    assert report["groups"] == "block sizes [16, 32, 8], kernel block sizes [16, 16, 8]"
    assert report["steps"] == "21 of 40 (the trace ran out of requests)"
    assert report["checks"] == "3"  # steps 7, 14, 21
    assert report["mismatches"] == "0" and int(report["writes"]) > 0 and int(report["block ids written"].split()[0]) > 0
    assert report["apply host time"].startswith("median ") and " us, p99 " in report["apply host time"]


def test_check_every_0_checks_once_after_the_last_step(capsys):
    assert main(["replay", "--trace", SMALL_TRACE, "--concurrency", "3", "--steps", "10", "--check-every", "0",
                 *CPU]) == 0  # fmt: skip
    assert _report(capsys.readouterr().out)["checks"] == "1"


def test_the_kernel_block_sizes_default_to_the_stated_rule(capsys):
    assert main(["replay", "--trace", SMALL_TRACE, "--block-sizes", "48,24,8", "--steps", "5", *CPU]) == 0
    assert _report(capsys.readouterr().out)["groups"] == "block sizes [48, 24, 8], kernel block sizes [16, 8, 8]"
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "default: gcd(block size, 16) per group" in " ".join(capsys.readouterr().out.split())


class OffByOne(Backend):
    """Writes every block id plus one: a wrong backend that replay must catch."""

    NAME = "off-by-one"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        wrong = [WriteBatch(b.tables, b.meta, b.values + 1, b.may_overlap, b.values_in_order, None, b.checked)
                 for b in batches]  # fmt: skip
        select_backend("cpu", "torch-cpu").apply(wrong)


@pytest.fixture
def off_by_one(provide_backends):
    provide_backends("off-by-one-plugin", OffByOne)


def test_a_backend_that_writes_wrong_values_fails_the_run_with_exit_1(capsys, off_by_one):
    argv = ["replay", "--trace", SMALL_TRACE, "--concurrency", "2", "--steps", "30", "--backend", "off-by-one"]
    code = main([*argv, *CPU])
    out = capsys.readouterr().out
    assert code == 1
    report = _report(out)
    assert report["backend"] == "off-by-one" and int(report["mismatches"]) > 0
    assert out.splitlines()[-1] == f"result: FAILED, {report['mismatches']} mismatches"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read trace"),
        ("", "line 1: empty file"),
        ("TIMESTAMP,ContextTokens\nx,3\n", "line 1: missing column 'GeneratedTokens'"),
        ("ContextTokens,GeneratedTokens\n3,4\n5,x\n", "line 3: GeneratedTokens='x' is not an integer"),
        ("ContextTokens,GeneratedTokens\n3,4\n-5,1\n", "line 3: ContextTokens=-5 is negative"),
        ("ContextTokens,GeneratedTokens\n3,\n", "line 2: GeneratedTokens='' is not an integer"),
        ("ContextTokens,GeneratedTokens\n", "no requests after the header"),
        ("ContextTokens,GeneratedTokens\n0,0\n0,0\n",
         "all 2 requests have ContextTokens + GeneratedTokens = 0: nothing to schedule"),
    ],
    ids=["missing", "empty", "no-column", "not-an-integer", "negative", "empty-cell", "header-only", "no-tokens"],
)  # fmt: skip
def test_a_bad_trace_is_one_line_naming_the_file_and_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.csv"
    if content is not None:
        path.write_text(content)
    assert main(["replay", "--trace", str(path), "--steps", "5", *CPU]) == 2
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert "\n" not in line and line.startswith("multiwrite replay: error: ") and str(path) in line and fragment in line
    assert captured.out == ""


def test_sizes_that_cannot_fit_are_refused_before_the_run_in_one_line(capsys):
    assert main(["replay", "--concurrency", "100000000", *CPU]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("multiwrite replay: error: --concurrency 100000000 needs about ") and "\n" not in line
    assert " TB of host memory; " in line and line.endswith("is available: refused before the run")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_progress_bar_is_drawn_when_stderr_is_a_terminal():
    pytest.importorskip("tqdm", reason="progress bars need the cli extra (tqdm)")
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    argv = [*multiwrite_command(), "replay", "--trace", SMALL_TRACE, "--steps", "40", "--device", "cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, env=subprocess_env())
    os.close(slave)
    drawn = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed, everything was read
                break
            if not chunk:
                break
            drawn += chunk
        out = proc.communicate(timeout=120)[0]
    finally:
        os.close(master)
    assert proc.returncode == 0 and b"result: OK" in out
    assert b"\rreplay:   0%|" in drawn and b"/40 [" in drawn and b"step/s]" in drawn, drawn
