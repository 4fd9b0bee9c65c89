"""``commgroups audit DIR``: merge a run's per-rank audit files and print the hazards."""

from __future__ import annotations

import argparse
import json
from typing import Any

from commgroups.audit.merge import merge_dir


def register(subparsers: Any) -> None:
    """Add the ``audit`` sub-command."""
    parser = subparsers.add_parser(
        "audit",
        help="merge per-rank audit files (COMMGROUPS_AUDIT_DIR) and print the hazards",
    )
    parser.add_argument("directory", help="the directory the run's ranks wrote rank*.json into")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the merged report; exit status 1 when hazards were found, 0 otherwise."""
    report = merge_dir(args.directory)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1
