"""The rank-loss tables alone: ``python benchmarks/rank_loss.py [--quick | --smoke] [--json FILE]``.

Runs what ``commgroups bench`` runs for rank loss, with the same sizes (full run by default): the
kill-to-rebuilt worlds, the resource count over N rebuilds, and the rebuild-vs-creation ratio
table (gloo rows from the kill worlds, plus the largest fake world), then prints them as text and
markdown (the form benchmarks/README.md quotes). Minutes instead of the whole benchmark's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    """Measure and print; ``--json`` also writes the tables and summary."""
    sys.path.insert(0, str(ROOT))  # the source tree's commgroups when it is not installed
    from commgroups.bench import config as configs
    from commgroups.bench import rank_loss, rebuild
    from commgroups.bench.progress import NullProgress
    from commgroups.bench.runner import machine_info
    from commgroups.bench.world import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    config = (configs.quick_config() if args.quick
              else configs.smoke_config() if args.smoke else configs.full_config())
    progress = NullProgress()
    machine = machine_info()
    tables, summary, ratio_results = rank_loss.run(config, progress)
    fake = run_world(rebuild.measure_fake, max(config.fake_worlds), config.rebuild_repetitions,
                     backend="fake", timeout_s=config.timeout_s, progress=progress)[0]
    ratio_table, ratio_summary = rebuild.tables([*ratio_results, fake])
    tables.append(ratio_table)
    summary.update(ratio_summary)
    print(f"machine: {machine['nproc']} CPUs ({machine['cpu_model']}), torch {machine['torch']}, "
          f"load average at start {machine['load_average_at_start'][0]}, "
          f"{machine['date_utc']} UTC; {config.name} config\n")
    print("\n\n".join(table.text() for table in tables))
    print("\n" + "\n\n".join(table.markdown() for table in tables))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine, "config": config.name, "summary": summary,
             "tables": {table.name: table.to_dict() for table in tables}}, indent=1) + "\n",
            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
