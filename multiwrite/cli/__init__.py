"""The `multiwrite` command: one module per subcommand, registered in `SUBCOMMANDS`.

`main` maps what a subcommand raises to the documented exit codes (`exit_codes.EXIT_CODES_HELP`): bad input and sizes
that cannot fit exit 2 with one line, any other error exits 3 with one line (the traceback behind `--debug`),
Ctrl-C exits 130 with one line.

Modules: `exit_codes` (constants, no imports), `args` (what every subcommand shares: argument types, refusals, the
progress bar), then one per subcommand: `replay`, `info`, `bench`, `check_backend`, each with `add_parser(sub,
common)` (which sets `func`, the function that runs it and returns the exit code). Every one of them imports only
argparse and `args` at its top, and `build_parser` imports each when it registers it (the `replay` and `bench`
parsers read the workload's constants for their help: numpy, never torch); what a subcommand runs with (torch, the
library) is imported when it runs.

Ctrl-C at any moment: this module imports only `sys` and `exit_codes` at its top, so everything else the command
loads (argparse included) loads inside `main`'s `try`. An interrupt raised inside an import can abort the process
(native module code calling back into Python) or leave a module half-initialized (torch's C extension loaded, `torch`
itself gone from `sys.modules`), so `main`'s handler lets a running import end before it interrupts (`_importing`);
and nothing on the way from the interrupt to the exit imports anything: the `except` clauses that an interrupt
passes test classes already loaded (`_known_errors`), never import them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from multiwrite.cli.exit_codes import EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from types import FrameType

#: One entry per subcommand: a function that adds its parser to the `multiwrite` subparsers (and sets
#: `func`, the function that runs it and returns the exit code). A new subcommand is one more module and entry.
AddParser = Callable[["argparse._SubParsersAction", "argparse.ArgumentParser"], None]


def _add_replay(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from multiwrite.cli.replay import add_parser

    add_parser(sub, common)


def _add_info(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from multiwrite.cli.info import add_parser

    add_parser(sub, common)


def _add_bench(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from multiwrite.cli.bench import add_parser

    add_parser(sub, common)


def _add_check_backend(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from multiwrite.cli.check_backend import add_parser

    add_parser(sub, common)


SUBCOMMANDS: dict[str, AddParser] = {
    "replay": _add_replay,
    "info": _add_info,
    "bench": _add_bench,
    "check-backend": _add_check_backend,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `multiwrite` command, every entry of `SUBCOMMANDS` registered."""
    from multiwrite.cli.args import EXIT_CODES_HELP, OneLineParser, common_options

    parser = OneLineParser(
        prog="multiwrite",
        description="Fused block-table writes for paged-KV-cache LLM serving.",
        epilog=EXIT_CODES_HELP,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = common_options()
    for add in SUBCOMMANDS.values():
        add(sub, common)
    return parser


#: Errors that mean bad input (exit 2, one line): (module, class name).
KNOWN_ERRORS = (
    ("multiwrite.workload", "TraceError"),
    ("multiwrite.errors", "StagedWriteError"),
    ("multiwrite.errors", "BackendUnavailableError"),
    ("multiwrite.environment", "DeviceError"),
    ("multiwrite.cli.args", "RefusedError"),
)


def _known_errors() -> tuple[type[BaseException], ...]:
    """The classes of `KNOWN_ERRORS` whose modules are loaded, without importing any: an exception of a class whose
    module never loaded cannot exist, and an import here (an `except` clause that every exception passing `main`
    evaluates) could meet a module an interrupt left half-initialized."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in KNOWN_ERRORS)
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _importing(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside an import. An interrupt is never raised there: a module's initialization may be
    native code calling back into Python (torch's `_c10d_init` does, while `import torch` runs), and an exception
    thrown through it can abort the process (a C++ `terminate`, seen on the CI machine), where it would at best leave
    the module half-initialized."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


class _Run:
    """What `main` knows of the run so far, for its messages: the parsed arguments once parsed, and whether a
    SIGINT arrived (recorded by `on_sigint`, so that an interrupt that some code turned into another error, or
    swallowed, still ends the command as interrupted)."""

    def __init__(self) -> None:
        self.args: argparse.Namespace | None = None
        self.interrupted = False
        self._resender: threading.Thread | None = None
        self._ended = threading.Event()
        self._sending = threading.Lock()

    def where(self) -> str:
        return f" {self.args.command}" if self.args is not None else ""

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler while `main` runs: record it, then interrupt as Python's own handler does; and until
        `main` ends, again every 50 ms (`_resend`: code that swallowed the interrupt must not run on). Inside an
        import it only records: the import ends first and a resend interrupts after it (`_importing`)."""
        self.interrupted = True
        self._resend()
        if not _importing(frame):
            raise KeyboardInterrupt

    def on_unraisable(self, unraisable: object) -> None:
        """`sys.unraisablehook` while `main` runs: an interrupt raised where Python cannot propagate it (a callback
        inside the import machinery, a finalizer) is recorded instead of printed and delivered again (`_resend`),
        else the command would run on as if never interrupted; others go to the previous hook."""
        if isinstance(getattr(unraisable, "exc_value", None), KeyboardInterrupt):
            self.interrupted = True
            self._resend()
        else:
            self.previous_unraisable(unraisable)

    def _resend(self) -> None:
        """Interrupt the main thread again every 50 ms, from a thread of its own, until `main` ends (sent from a
        hook itself, the interrupt would be taken inside the hook, where it may not propagate either)."""
        if self._resender is not None:
            return
        import _thread

        def resend() -> None:
            while not self._ended.wait(0.05):
                with self._sending:
                    if not self._ended.is_set():
                        _thread.interrupt_main()

        self._resender = threading.Thread(target=resend, name="multiwrite-interrupt", daemon=True)
        self._resender.start()

    def watch(self) -> Callable[[], None]:
        """Install `on_sigint` (where Python's own handler is in place, in the main thread) and `on_unraisable`;
        returns the function that puts back what was there."""
        import signal

        self.previous_unraisable = sys.unraisablehook
        sys.unraisablehook = self.on_unraisable
        handler = signal.getsignal(signal.SIGINT)
        ours = handler is signal.default_int_handler
        if ours:
            try:
                signal.signal(signal.SIGINT, self.on_sigint)
            except ValueError:  # not the main thread: Python's handler stays
                ours = False

        def restore() -> None:
            self._ended.set()
            try:
                with self._sending:  # no interrupt is sent after this (a send under way ends first),
                    pass
                for _ in range(3):  # and one sent before it is taken in here, by `on_sigint`
                    pass
            except KeyboardInterrupt:
                pass
            if ours:
                signal.signal(signal.SIGINT, handler)
            sys.unraisablehook = self.previous_unraisable

        return restore


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `multiwrite` console script; returns the exit code (see `EXIT_CODES_HELP`).

    Ctrl-C at any moment (while the command loads, runs or reports another error) returns `EXIT_INTERRUPTED` after
    one line on stderr."""
    run = _Run()
    code = EXIT_INTERRUPTED
    restore = None
    try:
        restore = run.watch()
        code = _main(argv, run)
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        if restore is not None:
            restore()
    if not run.interrupted:
        return code
    try:
        print(f"multiwrite{run.where()}: interrupted", file=sys.stderr)
    except (KeyboardInterrupt, OSError):  # a second Ctrl-C, or no stderr: the exit code still says it
        pass
    return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None, run: _Run) -> int:
    """`main` without its interrupt handling (every `KeyboardInterrupt` passes through)."""
    import contextlib
    import os

    try:
        from multiwrite.cli.args import UsageError

        parser = build_parser()
        try:
            run.args = args = parser.parse_args(argv)
        except SystemExit:
            sys.stdout.flush()  # after --help: a closed pipe shows here, not at the interpreter's exit
            raise
        try:
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
            return code
        except UsageError as exc:
            args.parser.error(str(exc))  # argparse's format, exit code 2
            return EXIT_USAGE  # pragma: no cover (error() exits)
        except _known_errors() as exc:
            if run.interrupted:  # (an interrupt that some code turned into this error: `main` says interrupted)
                return EXIT_INTERRUPTED
            print(f"multiwrite {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say, nowhere to say it
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if run.interrupted:  # (numpy, for one, turns an interrupt of its C extension's import into an ImportError)
            return EXIT_INTERRUPTED
        import traceback

        debug = bool(getattr(run.args, "debug", False))
        if debug:
            traceback.print_exc()
        hint = "" if debug else "; run with --debug for the traceback"
        print(f"multiwrite{run.where()}: internal error: {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
        return EXIT_INTERNAL
