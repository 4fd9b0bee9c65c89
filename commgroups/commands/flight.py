"""``commgroups flight merge DIR``: merge a job's flight-recorder dumps into a table per role."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``flight`` sub-command."""
    parser = subparsers.add_parser(
        "flight", help="the flight recorder: merge the ranks' dumps and name who is behind")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    merge = actions.add_parser("merge", help="print a table per role and the hazards")
    merge.add_argument("directory", help="the directory holding flight-g*-rank*.json")
    merge.add_argument("--torch-dumps", metavar="DIR",
                       help="where torch's own flight-recorder dumps are (NCCL writes them on a "
                            "timeout to TORCH_FR_DUMP_TEMP_FILE, default /tmp/nccl_trace_rank_<rank>); "
                            "default: DIRECTORY")
    merge.add_argument("--torch-prefix", metavar="PREFIX",
                       help="their file-name prefix (default nccl_trace_rank_)")
    merge.add_argument("--json", action="store_true", help="print JSON instead of text")
    merge.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the merged report; exit status 1 when hazards were found, 0 otherwise."""
    # Imported here: the package imports torch, and every other command (audit's merge too)
    # must build its parser where torch cannot be imported.
    from commgroups.flight_recorder.merge import merge_dir

    prefix = {"torch_prefix": args.torch_prefix} if args.torch_prefix else {}
    report = merge_dir(args.directory, args.torch_dumps, **prefix)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1
