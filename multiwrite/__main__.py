"""`python -m multiwrite` (and `python -m multiwrite.cli`): the `multiwrite` command."""

import sys

try:
    from multiwrite.cli import main
except KeyboardInterrupt:  # Ctrl-C while `multiwrite.cli` itself loads, before `main` is there to say it as it does
    sys.stderr.write("multiwrite: interrupted\n")
    sys.exit(130)  # multiwrite.cli.exit_codes.EXIT_INTERRUPTED
sys.exit(main())
