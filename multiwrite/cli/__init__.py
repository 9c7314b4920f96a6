"""The `multiwrite` command: one module per subcommand, registered in `SUBCOMMANDS`.

`main` maps what a subcommand raises to the documented exit codes (`args.EXIT_CODES_HELP`): bad input and sizes
that cannot fit exit 2 with one line, any other error exits 3 with one line (the traceback behind `--debug`),
Ctrl-C exits 130 quietly.

Modules: `args` (what every subcommand shares: argument types, exit codes, refusals, the progress bar), then one
per subcommand: `replay`, `info`, `bench`, `check_backend`, each with `add_parser(sub, common)` (which sets
`func`, the function that runs it and returns the exit code). Every one of them imports only argparse and `args`
at its top, and `build_parser` imports each when it registers it (the `replay` and `bench` parsers read the
workload's constants for their help: numpy, never torch); what a subcommand runs with (torch, the library) is
imported when it runs. So `import multiwrite.cli` stays light, and even an interrupt while torch is loading ends
quietly (`main` catches it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from multiwrite.cli.args import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES_HELP,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    OneLineParser,
    RefusedError,
    UsageError,
    common_options,
)

#: One entry per subcommand: a function that adds its parser to the `multiwrite` subparsers (and sets
#: `func`, the function that runs it and returns the exit code). A new subcommand is one more module and entry.
AddParser = Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None]


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


def _known_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (exit 2, one line): imported here so that `main` catches them."""
    from multiwrite.environment import DeviceError
    from multiwrite.errors import BackendUnavailableError, StagedWriteError
    from multiwrite.workload import TraceError

    return (TraceError, StagedWriteError, BackendUnavailableError, DeviceError, RefusedError)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `multiwrite` console script; returns the exit code (see `EXIT_CODES_HELP`)."""
    args = None
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
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
            print(f"multiwrite {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say, nowhere to say it
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"multiwrite{' ' + args.command if args else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        debug = bool(getattr(args, "debug", False))
        if debug:
            traceback.print_exc()
        where = f" {args.command}" if args is not None else ""
        hint = "" if debug else "; run with --debug for the traceback"
        print(f"multiwrite{where}: internal error: {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
        return EXIT_INTERNAL
