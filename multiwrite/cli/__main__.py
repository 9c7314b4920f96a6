"""`python -m multiwrite.cli`: the `multiwrite` command (as `python -m multiwrite`, whose entry this runs)."""

import multiwrite.__main__  # noqa: F401 (importing it runs the command)
