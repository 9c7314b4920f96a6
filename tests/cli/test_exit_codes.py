"""The exit codes every `multiwrite` command documents (README, `--help`): 0 success, 1 a mismatch (test_replay.py,
tests/bench), 2 bad arguments or input in one line, 3 any other error in one line with the traceback behind
`--debug`, 130 on Ctrl-C quietly, 141 when the output pipe closes. The interrupt and the closed pipe run the
installed console script in a fresh process; everything else runs `multiwrite.cli.main` here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import torch

from multiwrite import Backend
from multiwrite.cli import main
from multiwrite.plugins.dispatch import BACKEND_ENV
from tests.support.distributions import backend_source, install_distribution
from tests.support.processes import SMALL_TRACE, multiwrite_command, one_line_error, subprocess_env

CPU = ["--device", "cpu", "--no-progress"]


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


ARGUMENT_ERRORS = [
    (("replay", "--block-sizes", "16,,8"), "multiwrite replay: error: argument --block-sizes: empty item in '16,,8'"),
    (("replay", "--block-sizes", "16,x"), "multiwrite replay: error: argument --block-sizes: expected comma-separated"),
    (("replay", "--steps", "0"), "multiwrite replay: error: argument --steps: expected an integer >= 1, got 0"),
    (("replay", "--steps", "-1"), "multiwrite replay: error: argument --steps: "),
    (("replay", "--concurrency", "0"), "multiwrite replay: error: argument --concurrency: "),
    (("replay", "--check-every", "-1"), "multiwrite replay: error: argument --check-every: expected an integer >= 0"),
    (("replay", "--check-every", "x"), "multiwrite replay: error: argument --check-every: expected an integer, got"),
    (("replay", "--overlap-rate", "nan"), "multiwrite replay: error: argument --overlap-rate: expected a share in"),
    (("replay", "--block-sizes", "16,32", "--kernel-block-sizes", "16"),
     "multiwrite replay: error: argument --kernel-block-sizes: 1 entry for the 2 groups of --block-sizes 16,32"),
    (("replay", "--block-sizes", "16,24", "--kernel-block-sizes", "16,16"),
     "multiwrite replay: error: argument --kernel-block-sizes: group 1 block size 24 is not a positive multiple of "
     "its kernel block size 16"),
    (("bench", "--configs", "G9"), "multiwrite bench: error: argument --configs: unknown configuration 'G9' (known: "),
    (("bench", "--steps", "0"), "multiwrite bench: error: argument --steps: "),
    (("bench", "--concurrency", "x"), "multiwrite bench: error: argument --concurrency: "),
    (("bench", "--burst-reps", "-1"), "multiwrite bench: error: argument --burst-reps: "),
    (("check-backend", "torch-cpu", "--examples", "0"), "multiwrite check-backend: error: argument --examples: "),
    (("check-backend",), "multiwrite check-backend: error: the following arguments are required: name"),
    (("info", "--bogus"), "multiwrite: error: unrecognized arguments: --bogus"),
    (("nosuch",), "multiwrite: error: argument command: invalid choice: 'nosuch'"),
    ((), "multiwrite: error: the following arguments are required: command"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "prefix"), ARGUMENT_ERRORS, ids=[" ".join(a) or "-" for a, _ in ARGUMENT_ERRORS])
def test_every_argument_error_is_one_line_exit_2(capsys, argv, prefix):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--no-progress"] if argv[:1] == ("replay",) else list(argv))
    assert info.value.code == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(prefix), line
    command = "multiwrite" + ("" if prefix.startswith("multiwrite:") else f" {argv[0]}")
    assert line.endswith(f"(see {command} --help)") and "usage:" not in captured.err and captured.out == ""


@pytest.mark.parametrize("command", ["replay", "bench"])
@pytest.mark.parametrize("device", ["cudax", "cuda:x"])
def test_an_unparsable_device_is_one_line_exit_2_before_the_run(capsys, command, device):
    warmup = ["--warmup", "0"] if command == "bench" else []
    assert main([command, "--trace", SMALL_TRACE, "--steps", "3", *warmup, "--no-progress", "--device", device]) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.err)
    assert line.startswith(f"multiwrite {command}: error: cannot parse device {device!r}: ")
    assert line.endswith("(expected auto, cpu, cuda or cuda:N)") and captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_line_exit_2_naming_the_torch_build(capsys):
    assert main(["replay", "--trace", SMALL_TRACE, "--steps", "3", "--no-progress", "--device", "cuda"]) == 2
    line = one_line_error(capsys.readouterr().err)
    build = "built with" if torch.version.cuda or getattr(torch.version, "hip", None) else "built without CUDA"
    assert line.startswith("multiwrite replay: error: device cuda requested but CUDA is not available (torch "
                           f"{torch.__version__} ")  # fmt: skip
    assert build in line


def test_an_unknown_backend_is_one_line_exit_2_listing_the_registered_ones(capsys):
    assert main(["replay", "--trace", SMALL_TRACE, "--backend", "nope", "--steps", "3", *CPU]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("multiwrite replay: error: unknown backend backend='nope'; registered backends: ")
    assert "torch-cpu" in line and "compiled-cpu" in line


class Exploding(Backend):
    NAME = "exploding"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        raise RuntimeError("injected fault")


@pytest.fixture
def exploding(provide_backends):
    provide_backends("exploding-plugin", Exploding)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_an_unexpected_error_is_one_line_exit_3_and_debug_adds_the_traceback(capsys, exploding, debug):
    argv = ["replay", "--trace", SMALL_TRACE, "--steps", "3", "--backend", "exploding", *CPU]
    assert main([*argv, "--debug"] if debug else argv) == 3
    captured = capsys.readouterr()
    head = "multiwrite replay: internal error: BackendError: backend 'exploding' ("
    if debug:
        assert "Traceback (most recent call last)" in captured.err and "RuntimeError: injected fault" in captured.err
        last = captured.err.strip().splitlines()[-1]
        assert last.startswith(head) and "RuntimeError: injected fault" in last and "--debug" not in last
    else:
        line = one_line_error(captured.err)
        assert line.startswith(head) and "RuntimeError: injected fault" in line
        assert line.endswith("; run with --debug for the traceback")


def test_the_help_of_every_command_documents_the_exit_codes(capsys):
    for argv in ([], ["replay"], ["bench"], ["check-backend"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        assert info.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "exit codes: 0 success; 1 a table differed from the reference; 2 bad arguments or input" in text, argv
        assert "3 any other error (one line, --debug prints the traceback)" in text, argv
        assert "130 interrupted (Ctrl-C); 141 the output pipe closed (e.g. | head)" in text, argv


# A backend that says when the replay is under way (a marker file), then applies through torch-cpu.
MARKER_SOURCE = """
import os

class Started(Marker):
    def apply(self, batches):
        path = os.environ["MULTIWRITE_TEST_MARKER"]
        if not os.path.exists(path):
            open(path, "w").close()
        super().apply(batches)

@hookimpl
def multiwrite_backends():
    return [Started()]
"""
MARKER_PLUGIN = backend_source("Marker", "marker-cpu") + MARKER_SOURCE


def sigint_as_a_terminal_gives_it() -> None:
    """`preexec_fn` of the children that get a SIGINT: its default disposition, whatever the test run's is (a CI
    runner started as a background job of a shell ignores SIGINT, and a child would inherit that: Ctrl-C could not
    reach it, rightly)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(proc: subprocess.Popen, started: Callable[[], None]) -> tuple[str, str]:
    """SIGINT to `proc` once `started()` returns, then its stdout and stderr (it is killed if it outlives the test)."""
    try:
        started()
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_during_a_replay_ends_quietly_with_130(tmp_path):
    install_distribution(tmp_path, "marker-plugin", "marker_plugin", MARKER_PLUGIN)
    marker = tmp_path / "started"
    env = subprocess_env(tmp_path, MULTIWRITE_TEST_MARKER=str(marker))
    argv = ["replay", "--steps", "100000000", "--concurrency", "256", "--backend", "marker-cpu", *CPU]
    proc = subprocess.Popen([*multiwrite_command(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_as_a_terminal_gives_it)  # fmt: skip

    def started():
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the replay never started: " + (proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(0.3)  # well inside the replay loop

    stdout, stderr = interrupt(proc, started)
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "multiwrite replay: interrupted" and stdout == ""


# A child that says when its interpreter's own start-up is over (before that, Python's handling of SIGINT is all
# there is), then runs the command as the console script does or as `python -m multiwrite` does.
ENTRIES = {
    "console-script": "sys.argv[0] = 'multiwrite'; from multiwrite.cli import main; sys.exit(main())",
    "python -m": "import runpy; runpy.run_module('multiwrite', run_name='__main__', alter_sys=True)",
}
# From the first imports (argparse, the library, numpy, torch: about 0.3-2 s on a 2-core machine) into the run. (0.0
# would land in the child's own `import` statement, outside multiwrite's code.)
DELAYS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0, 3.0)
LONG_REPLAY = ("replay", "--steps", "100000000", *CPU)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
@pytest.mark.parametrize("entry", ENTRIES)
def test_ctrl_c_at_any_moment_of_the_first_seconds_ends_with_130_and_one_line(entry):
    code = f"import sys; sys.stderr.write('started\\n'); sys.stderr.flush(); sys.argv[1:] = {list(LONG_REPLAY)!r}; "
    outcomes = []
    for delay in DELAYS:
        proc = subprocess.Popen([sys.executable, "-c", code + ENTRIES[entry]], env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_as_a_terminal_gives_it)  # fmt: skip

        def started(proc=proc, delay=delay):
            assert proc.stderr.readline() == "started\n"
            time.sleep(delay)

        _, stderr = interrupt(proc, started)
        outcomes.append((delay, proc.returncode, stderr))
    for delay, rc, stderr in outcomes:
        line = one_line_error(stderr)  # one line, no traceback
        assert rc == 130 and line in ("multiwrite: interrupted", "multiwrite replay: interrupted"), (delay, stderr)
    assert outcomes[-1][2].strip() == "multiwrite replay: interrupted"  # by 3 s the arguments were parsed


@pytest.mark.parametrize("buffering", ["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "argv",
    [
        ("info",),
        ("replay", "--trace", SMALL_TRACE, "--steps", "5", *CPU),
        ("replay", "--help"),
    ],
    ids=["info", "replay", "help"],
)
def test_a_closed_output_pipe_exits_141_quietly(argv, buffering):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything: every write fails
    try:
        env = subprocess_env(unbuffered=buffering == "unbuffered")
        proc = subprocess.run([*multiwrite_command(), *argv], stdout=write, stderr=subprocess.PIPE, env=env, text=True,
                              timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


# A child whose SIGINT is lost (LOST_INTERRUPTS), then a long loop: the command must end as interrupted, not run on.
LOSES_AN_INTERRUPT = """
import os, signal, sys, time
from multiwrite.cli import _Run
run = _Run()
restore = run.watch()
try:
{loses}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pass
    print("ran on", run.interrupted)
except KeyboardInterrupt:
    print("interrupted", run.interrupted)
finally:
    restore()
"""
LOST_INTERRUPTS = {
    # Its KeyboardInterrupt raised inside a finalizer, where Python cannot propagate it (it becomes "unraisable"):
    # under load on the 2-core CI machine a Ctrl-C landed there and a replay of 10^8 steps ran on past the test's
    # 120 s.
    "inside-a-finalizer": """
class Finalized:
    def __del__(self):
        raise KeyboardInterrupt
Finalized()
""",
    # Its KeyboardInterrupt caught and dropped by some code on the way.
    "swallowed": """
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass  # code that swallows it
""",
}


@pytest.mark.parametrize("loses", LOST_INTERRUPTS)
def test_an_interrupt_that_is_lost_on_the_way_still_interrupts_the_command(loses):
    code = LOSES_AN_INTERRUPT.format(loses=textwrap.indent(LOST_INTERRUPTS[loses].strip("\n"), "    "))
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120, preexec_fn=sigint_as_a_terminal_gives_it)  # fmt: skip
    assert done.stdout.split() == ["interrupted", "True"], (done.stdout, done.stderr)
    assert done.stderr == ""  # recorded, not printed as an unraisable exception


# A child whose SIGINT arrives inside an import (a module that sends it and runs on for a while): the import must end
# whole and the interrupt come right after it. Raised inside it, torch's `_c10d_init` (native code calling back into
# Python while `import torch` runs) aborted the process with a C++ `terminate` on the CI machine.
INTERRUPTED_IMPORT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from multiwrite.cli import _Run
run = _Run()
restore = run.watch()
try:
    try:
        import interrupted_module
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pass
        print("ran-on")
    except KeyboardInterrupt:
        module = sys.modules.get("interrupted_module")
        print("whole" if getattr(module, "ended", False) else "half", run.interrupted)
finally:
    restore()
"""
INTERRUPTED_MODULE = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
deadline = time.monotonic() + 0.5
while time.monotonic() < deadline:  # (where the interrupt is taken)
    pass
ended = True
"""


def test_an_interrupt_inside_an_import_waits_for_the_import_to_end(tmp_path):
    (tmp_path / "interrupted_module.py").write_text(INTERRUPTED_MODULE)
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, str(tmp_path)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=sigint_as_a_terminal_gives_it)  # fmt: skip
    assert done.stdout.split() == ["whole", "True"], (done.stdout, done.stderr)
    assert done.stderr == ""


# A child that swallows an interrupt (as above), the resend that follows held back until `restore()` waits for it to
# end: when the handlers go back, that interrupt is still pending, and `restore()` takes it itself (else it would
# surface after the command ended, as a traceback).
PENDING_AT_RESTORE = """
import _thread, os, signal, threading, time
from multiwrite.cli import _Run
sending, go = threading.Event(), threading.Event()
interrupt_main = _thread.interrupt_main
def held_back():  # the resender's send, on its thread
    sending.set()
    go.wait()
    time.sleep(1)  # the main thread is by now in restore(), waiting for this send to end
    interrupt_main()
_thread.interrupt_main = held_back
run = _Run()
restore = run.watch()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass
sending.wait()
go.set()
try:
    restore()
    for _ in range(1000):  # (where a pending interrupt would be taken, with Python's handler back)
        pass
    print("restored", run.interrupted)
except KeyboardInterrupt:
    print("leaked", run.interrupted)
"""


def test_an_interrupt_resent_while_the_handlers_go_back_is_taken_by_them():
    done = subprocess.run([sys.executable, "-c", PENDING_AT_RESTORE], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=sigint_as_a_terminal_gives_it)  # fmt: skip
    assert done.stdout.split() == ["restored", "True"], (done.stdout, done.stderr)
    assert done.stderr == ""
