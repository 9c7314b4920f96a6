"""`multiwrite check-backend`: the conformance kit (`multiwrite.testing`) against one backend, one line per
property."""

from __future__ import annotations

import argparse

from multiwrite.cli.args import EXIT_CODES_HELP, RefusedError, add_subcommand, positive_int


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `check-backend` on the `multiwrite` command's subparsers."""
    p = add_subcommand(
        sub,
        common,
        "check-backend",
        cmd_check_backend,
        help="run the conformance kit against a backend: one line per property, exit 1 on any failure",
        description="Run the conformance kit (multiwrite.testing: every property a backend must satisfy, through "
        "the public API) against one backend on one device, in a pytest subprocess. Needs the test extra "
        "(pip install 'multiwrite[test]').",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("name", help="the backend's NAME (see multiwrite info)")
    p.add_argument("--device", default=None, help="device of the tables (default: the first it can run on)")
    p.add_argument("--examples", type=positive_int, default=None, help="hypothesis examples per property (50)")


def cmd_check_backend(args: argparse.Namespace) -> int:
    """Run `multiwrite check-backend`; returns 0 when every property holds, 1 otherwise.

    Raises:
        RefusedError: the kit cannot run at all (the test extra missing, an unknown backend, one that cannot run on
            the device): one line, exit 2, instead of every property reported failed.
    """
    from multiwrite.testing import check_backend, kit_problem

    problem = kit_problem(args.name, args.device)
    if problem is not None:
        raise RefusedError(problem)
    return check_backend(args.name, args.device, args.examples)
