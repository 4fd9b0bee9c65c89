"""Regenerate the committed results: ``python benchmarks/run.py [--quick]`` from the repository root.

Runs ``commgroups bench`` and writes benchmarks/results/latest.json, latest.md and the PNG charts. The
scenarios themselves live in ``commgroups/bench/`` (installed with the package), so this script only
chooses where the results go.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def main(argv: list[str]) -> int:
    """Run the benchmarks with output into benchmarks/results/."""
    # The source tree first (a script, not library code): commgroups when it is not installed, and
    # tests/titan, the CPU patches the torchtitan scenario needs, which are not shipped.
    sys.path.insert(0, str(ROOT))
    from commgroups.cli import main as cli_main
    return cli_main(["bench", *argv, "--json", str(RESULTS / "latest.json"),
                     "--plot", str(RESULTS), "--markdown", str(RESULTS / "latest.md")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
