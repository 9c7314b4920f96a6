"""Exit codes and argument edge cases, through the real `multiwrite` console script in fresh processes.

Every case starts at once (module fixture) and the tests read the results, so the file costs about one
interpreter start. Faults are injected with a `sitecustomize.py` on PYTHONPATH, which Python imports at
start-up, before the console script runs: the script itself is the one pip installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SMALL = str(DATA / "small_trace.csv")
QUICK_CPU = ["--device", "cpu", "--no-progress"]


def _command() -> list[str]:
    """The installed console script beside this interpreter, else `python -m multiwrite`."""
    script = Path(sys.executable).with_name("multiwrite")
    if script.exists():
        return [str(script)]
    found = shutil.which("multiwrite")
    return [found] if found else [sys.executable, "-m", "multiwrite"]


#: A fault injected into `run_replay`, selected by $MULTIWRITE_TEST_FAULT: "error" raises an unexpected
#: RuntimeError; "wait" writes a marker file and then runs the real replay (the test sends SIGINT).
SITECUSTOMIZE = """
import os
fault = os.environ.get("MULTIWRITE_TEST_FAULT")
if fault:
    import multiwrite.replay as replay
    real = replay.run_replay
    def run_replay(*args, **kwargs):
        if fault == "error":
            raise RuntimeError("injected fault")
        open(os.environ["MULTIWRITE_TEST_MARKER"], "w").close()
        return real(*args, **kwargs)
    replay.run_replay = run_replay
"""

CASES: dict[str, tuple[list[str], str | None]] = {
    "replay-huge-concurrency": (["replay", "--concurrency", "100000000", *QUICK_CPU], None),
    "bench-huge-burst": (["bench", "--quick", "--burst-ids", "100000000", *QUICK_CPU], None),
    "bench-huge-concurrency": (["bench", "--quick", "--concurrency", "40,100000000", *QUICK_CPU], None),
    "empty-list-item": (["replay", "--block-sizes", "16,,8", *QUICK_CPU], None),
    "kernel-length-mismatch": (["replay", "--block-sizes", "16,32", "--kernel-block-sizes", "16", *QUICK_CPU], None),
    "tokenless-trace": (["replay", "--trace", "{tmp}/zero.csv", *QUICK_CPU], None),
    "small-replay": (["replay", "--trace", SMALL, "--block-sizes", "48,24", "--steps", "40", "--device", "cpu"], None),
    "unexpected-error": (["replay", "--trace", SMALL, *QUICK_CPU], "error"),
    "unexpected-error-debug": (["replay", "--trace", SMALL, "--debug", *QUICK_CPU], "error"),
    "replay-help": (["replay", "--help"], None),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "zero.csv").write_text("ContextTokens,GeneratedTokens\n0,0\n0,0\n")
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    procs = {}
    for name, (argv, fault) in CASES.items():
        env = dict(os.environ, PYTHONPATH=str(tmp), MULTIWRITE_TEST_FAULT=fault or "")
        env.pop("MULTIWRITE_BACKEND", None)
        argv = [a.replace("{tmp}", str(tmp)) for a in argv]
        procs[name] = subprocess.Popen(
            [*_command(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def _one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("replay-huge-concurrency", ["multiwrite replay: error: --concurrency 100000000 needs about", "TB of host"]),
        ("bench-huge-burst", ["multiwrite bench: error: --burst-requests 64 --burst-ids 100000000", "beyond int32"]),
        ("bench-huge-concurrency", ["--concurrency 100000000 (configuration G3) needs about"]),
    ],
)
def test_sizes_that_cannot_fit_are_refused_before_the_run_in_one_line(results, case, fragments):
    line = _one_line_error(results[case], 2)
    assert all(f in line for f in fragments), line
    assert line.endswith("refused before the run")


def test_an_empty_list_item_is_an_argument_error(results):
    proc = results["empty-list-item"]
    assert proc.returncode == 2
    assert "multiwrite replay: error: argument --block-sizes: empty item in '16,,8'" in proc.stderr


def test_a_length_mismatch_is_reported_like_every_argument_error(results):
    proc, other = results["kernel-length-mismatch"], results["empty-list-item"]
    assert proc.returncode == 2
    assert proc.stderr.startswith("multiwrite replay: error: argument") and other.stderr.startswith(
        "multiwrite replay: error: argument"
    )
    assert len(proc.stderr.strip().splitlines()) == len(other.stderr.strip().splitlines()) == 1
    assert "multiwrite replay: error: argument --kernel-block-sizes: 1 entry for the 2 groups" in proc.stderr


def test_a_trace_without_tokens_is_refused(results):
    line = _one_line_error(results["tokenless-trace"], 2)
    assert "zero.csv: all 2 requests have ContextTokens + GeneratedTokens = 0: nothing to schedule" in line


def test_no_progress_bar_without_a_terminal_and_the_caps_are_stated(results):
    proc = results["small-replay"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # stderr is a pipe here: no progress bar even without --no-progress
    assert "token caps         prompts cut to 8192 tokens (0 longer in this trace), outputs to 8192 (0" in proc.stdout
    assert "result: OK" in proc.stdout


def test_the_kernel_block_size_default_follows_the_stated_rule(results):
    proc = results["small-replay"]
    assert "block sizes [48, 24], kernel block sizes [16, 8]" in proc.stdout  # gcd(bs, 16)
    assert "gcd(block size, 16)" in " ".join(results["replay-help"].stdout.split())


def test_an_unexpected_error_exits_3_in_one_line_traceback_behind_debug(results):
    line = _one_line_error(results["unexpected-error"], 3)
    assert line == (
        "multiwrite replay: internal error: RuntimeError: injected fault; run with --debug for the traceback"
    )
    debug = results["unexpected-error-debug"]
    assert debug.returncode == 3
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == "multiwrite replay: internal error: RuntimeError: injected fault"


def test_help_documents_the_exit_codes_and_the_token_cap(results):
    for case in ("replay-help",):
        text = " ".join(results[case].stdout.split())
        assert results[case].returncode == 0
        assert "exit codes: 0 success; 1 a table differed from the reference; 2 bad arguments" in text
        assert "3 any other error" in text and "130 interrupted (Ctrl-C)" in text
    assert "capped at 8192 tokens" in " ".join(results["replay-help"].stdout.split())


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_ends_quietly_with_130(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), MULTIWRITE_TEST_FAULT="wait", MULTIWRITE_TEST_MARKER=str(marker))
    env.pop("MULTIWRITE_BACKEND", None)
    argv = ["replay", "--steps", "100000000", "--concurrency", "256", *QUICK_CPU]
    proc = subprocess.Popen([*_command(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the replay never started"
        time.sleep(0.3)  # well inside the replay loop
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "multiwrite replay: interrupted"
