"""Regenerate the committed results: ``python benchmarks/run.py [--quick]`` from the repository root.

Runs ``commgroups bench`` plus the repository's torchtitan scenario (``tools/titan_bench.py``: it
trains torchtitan on CPU with the test tree's patches, which the package does not ship) and writes
benchmarks/results/latest.json, latest.md and the PNG charts.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def main(argv: list[str]) -> int:
    """Run the benchmarks with output into benchmarks/results/."""
    # The source tree first (a script, not library code): commgroups when it is not installed,
    # tools/ and tests/titan, which are not shipped.
    sys.path.insert(0, str(ROOT))
    from commgroups.cli import build_parser
    from commgroups.commands.bench import run
    from tools.titan_bench import TitanScenario

    args = build_parser().parse_args(
        ["bench", *argv, "--json", str(RESULTS / "latest.json"), "--plot", str(RESULTS),
         "--markdown", str(RESULTS / "latest.md")])
    return run(args, scenarios=[TitanScenario()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
