"""The exit codes of the `multiwrite` command (printed by `--help`, listed in README.md).

A module of constants that imports nothing, so that `multiwrite.cli` can hold them from its first line on: an
interrupt while anything else is loading still ends with `EXIT_INTERRUPTED`. `multiwrite.cli.args` re-exports them.
"""

EXIT_OK = 0
EXIT_MISMATCH = 1  # a table differed from the reference
EXIT_USAGE = 2  # bad arguments or input, refused before the run (one line on stderr)
EXIT_INTERNAL = 3  # any other error (one line; the traceback with --debug)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)
EXIT_BROKEN_PIPE = 141  # the output's reader went away, e.g. `| head` (128 + SIGPIPE)

EXIT_CODES_HELP = (
    "exit codes: 0 success; 1 a table differed from the reference; 2 bad arguments or input, or sizes that "
    "cannot fit, refused before the run; 3 any other error (one line, --debug prints the traceback); "
    "130 interrupted (Ctrl-C); 141 the output pipe closed (e.g. | head)"
)
