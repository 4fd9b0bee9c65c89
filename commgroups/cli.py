"""The ``commgroups`` command line: one sub-command per module in :mod:`commgroups.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
from collections.abc import Sequence

from commgroups.errors import CommGroupsError

__all__ = ["build_parser", "main", "one_line"]

# Sub-command modules; each has register(subparsers) and is imported only when the CLI starts.
COMMAND_MODULES = ("plan", "demo", "audit", "bench", "flight")

CLOSED_STDOUT_STATUS = 141
"""The exit status when stdout's reader went away (``commgroups plan ... | head``): 128 + SIGPIPE,
what the shell reports for any Unix filter that stops there."""


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
    """Run the command line; returns the exit status (:data:`CLOSED_STDOUT_STATUS`, quietly, when
    stdout's reader went away)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.run(args)
        sys.stdout.flush()  # here, not at exit: a reader gone after short output shows up in time
    except BrokenPipeError as error:
        if not _stdout_closed():  # a socket's peer went away: not the reader of our output
            return _internal_error(error, args.verbose)
        # `| head` had what it wanted: stop as any filter does. Point stdout at devnull, so that
        # the interpreter's flush at exit cannot raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_STDOUT_STATUS
    except CommGroupsError as error:
        # One line, whatever the error holds (a layout error lists every problem on its own line).
        print(f"commgroups: error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:
        return _internal_error(error, args.verbose)
    return status


def _internal_error(error: Exception, verbose: int) -> int:
    """Report an unexpected exception in one line (exit status 3); re-raise it at -vv."""
    # Every input problem is a CommGroupsError; anything else is a commgroups bug. Say so in one
    # line rather than a traceback, unless asked for the traceback (-vv).
    if verbose >= 2:
        raise error
    print(f"commgroups: internal error: {type(error).__name__}: {one_line(str(error))}; this "
          "is a bug, please report it with the command (-vv shows the traceback)",
          file=sys.stderr)
    return 3


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone: polling it for writing reports an error."""
    try:
        poller = select.poll()  # not on Windows: there the error is reported as any other
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is not a file
        return False


def one_line(text: str, width: int = 2000) -> str:
    """``text`` on one line: its lines joined with ``"; "``, cut to ``width`` characters."""
    joined = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return joined if len(joined) <= width else joined[: width - 4] + " ..."
