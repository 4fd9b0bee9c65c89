"""The ``commgroups`` command line: one sub-command per module in :mod:`commgroups.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from commgroups.errors import CommGroupsError

__all__ = ["build_parser", "main"]

# Sub-command modules; each has register(subparsers) and is imported only when the CLI starts.
COMMAND_MODULES = ("plan", "demo", "audit", "bench")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="commgroups",
        description="Dedicated communicators per role for PyTorch distributed training.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v info, -vv debug)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"commgroups.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.run(args)
    except CommGroupsError as error:
        print(f"commgroups: error: {error}", file=sys.stderr)
        return 2
    return status
