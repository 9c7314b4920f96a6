"""`python -m multiwrite.cli`: the `multiwrite` command (as `python -m multiwrite`)."""

import sys

from multiwrite.cli import main

sys.exit(main())
