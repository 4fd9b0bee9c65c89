"""``commgroups bench [--quick] [--json FILE] [--plot DIR]``: benchmark group layouts side by side.

The scenarios live in :mod:`commgroups.bench`; results, charts and the README are in the source
tree's ``benchmarks/`` folder. Needs the ``benchmarks`` extra (tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commgroups.errors import BenchDependencyError  # defined there; importable from here as before

if TYPE_CHECKING:
    from commgroups.bench.runner import Scenario

logger = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'commgroups[benchmarks]'"


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark group layouts: creation, rank loss (kill to rebuilt), planning, "
             "async-and-wait cost, checkpoint metadata, memory",
        description="Runs every scenario side by side, with interleaved repetitions, and prints "
                    "tables of medians [p25-p75] and ratios. Uses real 4- and 8-rank gloo worlds "
                    "and the fake backend for simulated worlds.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="fewer sizes and repetitions (under two minutes on 2 cores)")
    size.add_argument("--smoke", action="store_true",
                      help="the smallest run of every scenario (seconds; numbers meaningless)")
    parser.add_argument("--json", metavar="FILE", help="write every table and the summary as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _require(module: str, purpose: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise BenchDependencyError(
            f"commgroups bench needs {module} for {purpose} ({error}); fix: {EXTRA_HINT}"
        ) from None


def run(args: argparse.Namespace, scenarios: Sequence[Scenario] = ()) -> int:
    """Run the benchmarks (plus ``scenarios``, which repository tooling adds) and write what was
    asked for."""
    # Check optional dependencies first: failing after minutes of measuring would waste the run.
    if not args.no_progress:
        _require("tqdm", "the progress bar (or pass --no-progress)")
    if args.plot:
        _require("matplotlib", "--plot")
    from commgroups.bench import config as configs
    from commgroups.bench.progress import NullProgress, Progress, TqdmProgress
    from commgroups.bench.report import markdown, text, write_json, write_plots
    from commgroups.bench.runner import run_bench

    config = (configs.quick_config() if args.quick
              else configs.smoke_config() if args.smoke else configs.full_config())
    bar: Progress = NullProgress() if args.no_progress else TqdmProgress()
    try:
        result = run_bench(config, bar, scenarios)
    finally:
        if isinstance(bar, TqdmProgress):
            bar.close()
    print(text(result))
    if args.json:
        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(result), encoding="utf-8")
        print(f"wrote {args.markdown}")
    if args.plot:
        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0
