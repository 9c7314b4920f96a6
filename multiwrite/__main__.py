"""`python -m multiwrite`: the `multiwrite` command."""

import sys

from multiwrite.cli import main

sys.exit(main())
