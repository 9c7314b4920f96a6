"""What every `multiwrite` subcommand shares: its parser and common options, argument types, exit codes, refusals,
the progress bar, the output files of a run (checked before it, written after it).

The lowest floor of the command line: it imports nothing of multiwrite but `multiwrite.cli.exit_codes` (and nothing
heavy), so `multiwrite.cli` and every subcommand module build on it without importing each other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

# The exit codes live in a module that imports nothing (`multiwrite.cli` needs them before anything loads).
from multiwrite.cli.exit_codes import EXIT_BROKEN_PIPE as EXIT_BROKEN_PIPE
from multiwrite.cli.exit_codes import EXIT_CODES_HELP as EXIT_CODES_HELP
from multiwrite.cli.exit_codes import EXIT_INTERNAL as EXIT_INTERNAL
from multiwrite.cli.exit_codes import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from multiwrite.cli.exit_codes import EXIT_MISMATCH as EXIT_MISMATCH
from multiwrite.cli.exit_codes import EXIT_OK as EXIT_OK
from multiwrite.cli.exit_codes import EXIT_USAGE as EXIT_USAGE


class UsageError(ValueError):
    """Arguments that parse one by one but not together (e.g. list lengths that differ): reported in
    argparse's `usage ... error:` format, exit code 2."""


class RefusedError(ValueError):
    """The run cannot fit (memory, value range): refused before it starts, one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr, exit code 2 (argparse prints the whole
    usage block first): `multiwrite replay: error: argument --steps: ... (see multiwrite replay --help)`.
    Subparsers made through `add_subparsers().add_parser` inherit the class."""

    def print_help(self, file: Any = None) -> None:
        """The help, written so that a write error propagates (argparse's own printing swallows it, and a closed
        pipe would then exit 0 or 120 instead of 141)."""
        (sys.stdout if file is None else file).write(self.format_help())

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def int_list(text: str) -> list[int]:
    """`"16,32,8"` -> `[16, 32, 8]` (argparse type); positive integers only, no empty items."""
    items = [x.strip() for x in text.split(",")]
    if any(not x for x in items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r} (expected comma-separated integers like 16,32,8)")
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def common_options() -> argparse.ArgumentParser:
    """A parent parser with the options every subcommand takes (`--debug`)."""
    p = OneLineParser(add_help=False)
    p.add_argument("--debug", action="store_true", help="on an unexpected error, print the traceback (exit code 3)")
    return p


def add_subcommand(
    sub: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    name: str,
    func: Callable[[argparse.Namespace], int],
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """The parser of subcommand `name` on the `multiwrite` command's subparsers `sub`: it takes the common options
    (`common`), `func` (runs the subcommand, returns the exit code) and the parser itself (which reports a
    `UsageError`) are its defaults `func` and `parser`; `kwargs` go to `add_parser` (help, description, epilog)."""
    p = sub.add_parser(name, parents=[common], **kwargs)
    p.set_defaults(func=func, parser=p)
    return p


def add_trace_option(p: argparse.ArgumentParser, max_prompt_tokens: int) -> None:
    """`--trace` (the workload's CSV; default: the embedded trace), whose help names the workload's token cap."""
    p.add_argument(
        "--trace",
        help="CSV with ContextTokens,GeneratedTokens columns (default: embedded Azure trace); prompts and "
        f"outputs are capped at {max_prompt_tokens} tokens",
    )


def add_device_options(p: argparse.ArgumentParser) -> None:
    """`--device` (auto) and `--backend` (default: the best available on the device)."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto)")
    p.add_argument("--backend", default=None, help="force a backend by name (default: best available)")


def add_progress_option(p: argparse.ArgumentParser) -> None:
    """`--no-progress` (see `show_progress`)."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only when stderr is a terminal)")


def show_progress(disabled: bool) -> bool:
    """Whether to draw a progress bar: not disabled, and stderr is a terminal (never into a log file)."""
    return not disabled and sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[..., object]]:
    """A tqdm bar on stderr (the `cli` extra), or a silent stand-in when disabled or tqdm is missing."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    try:
        yield (bar.update if bar is not None else (lambda n=1: None))
    finally:
        if bar is not None:
            bar.close()


def format_bytes(n: float) -> str:
    """`1.5e9` -> `"1.5 GB"` (powers of 1000)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def host_memory_available() -> int | None:
    """Bytes of host memory available to a new allocation (`MemAvailable` of /proc/meminfo, else the
    physical memory from `os.sysconf`), or None when neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def refuse_if_too_big(what: str, host_bytes: int, device_bytes: int, device: object) -> None:
    """Raise `RefusedError` when `host_bytes` exceed the host's available memory, or `device_bytes` the
    free memory of a CUDA/ROCm `device` (a `torch.device`; on a CPU device both come from the host).

    `what` names the arguments responsible, e.g. `"--concurrency 100000000"`.
    """
    kind = getattr(device, "type", "cpu")
    if kind != "cuda":
        host_bytes += device_bytes
        device_bytes = 0
    avail = host_memory_available()
    if avail is not None and host_bytes > avail:
        raise RefusedError(
            f"{what} needs about {format_bytes(host_bytes)} of host memory; {format_bytes(avail)} is available: "
            "refused before the run"
        )
    if device_bytes:
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        if device_bytes > free:
            raise RefusedError(
                f"{what} needs about {format_bytes(device_bytes)} on {device}; {format_bytes(free)} is free there: "
                "refused before the run"
            )


def output_path_problem(path: str, option: str) -> str | None:
    """Why `path` cannot be written, or None when it can: checked before the run, so that a typo in
    `--csv` or `--plot` fails at once instead of after minutes of measuring. Opens the file for appending
    (which leaves an existing file as it is) and removes it again if it did not exist."""
    if os.path.isdir(path):
        return f"{option} {path}: is a directory"
    existed = os.path.lexists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot write there: {exc.strerror or exc}"
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(path)
    return None


def plot_format_problem(path: str) -> str | None:
    """Why matplotlib cannot save a figure to `path` (its extension names no format it knows), or None."""
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        return f"--plot {path}: matplotlib cannot write .{ext} files (supported: {', '.join(sorted(formats))})"
    return None


def refuse_unwritable_outputs(csv: str | None, plot: str | None) -> None:
    """Before a run that writes `--csv` `csv` and `--plot` `plot` (None: not asked for): raise `RefusedError` when
    the plot is asked for without matplotlib, else at the first path that cannot be written (`output_path_problem`)
    or plot format that matplotlib cannot write (`plot_format_problem`)."""
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RefusedError("--plot needs matplotlib: pip install 'multiwrite[plot]'") from None
    problems = [output_path_problem(path, option) for path, option in ((csv, "--csv"), (plot, "--plot")) if path]
    if plot:
        problems.append(plot_format_problem(plot))
    for problem in filter(None, problems):
        raise RefusedError(problem)


def write_outputs(
    report: str,
    csv: str | None,
    plot: str | None,
    write_csv: Callable[[str], object],
    write_plot: Callable[[str], object],
) -> None:
    """After a run: print its terminal `report`, then write the `--csv` file `csv` and the `--plot` figure `plot`
    where asked for (None: not), through `write_csv(path)` and `write_plot(path)`, each followed by a line naming
    its path."""
    print(report)
    if csv:
        write_csv(csv)
        print(f"csv: {csv}")
    if plot:
        write_plot(plot)
        print(f"plot: {plot}")
