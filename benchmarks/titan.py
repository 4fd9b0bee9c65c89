"""The torchtitan tables alone: ``python benchmarks/titan.py [--repetitions N] [--steps N] [--json FILE]``.

Runs what ``benchmarks/run.py`` runs for torchtitan (``tools/titan_bench.py``): interleaved
trainings of torchtitan's llama3 debug model with cp=4 on 4 gloo ranks, through commgroups with
its flight recorder on (the default) and off, with the audit, and stock; their step times and
start-up; then prints the tables as text and markdown (the form benchmarks/README.md quotes). The
fake-world mesh table is left out unless ``--meshes``. About a minute per training on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    """Measure and print; ``--json`` also writes the tables and summary."""
    # The source tree first: tools/ and tests/titan are not shipped.
    sys.path.insert(0, str(ROOT))
    from commgroups.bench.progress import NullProgress
    from commgroups.bench.runner import machine_info
    from commgroups.bench.world import run_world
    from tools.titan_bench import TitanConfig, available, measure_meshes, measure_steps, tables

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3,
                        help="interleaved rounds of every variant (default 3)")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--meshes", action="store_true",
                        help="also the 65,536-rank fake-world mesh table")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.repetitions < 1 or args.steps < 3:
        parser.error("--repetitions must be >= 1 and --steps >= 3 (step 1 is the warm-up)")
    reason = available()
    if reason is not None:
        print(f"not run: {reason}")
        return 0
    config = TitanConfig(repetitions=args.repetitions, steps=args.steps)
    progress = NullProgress()
    machine = machine_info()
    meshes = (run_world(measure_meshes, config.fake_world, config, backend="fake",
                        timeout_s=1800, progress=progress)[0] if args.meshes else None)
    with tempfile.TemporaryDirectory(prefix="commgroups-titan-bench-") as directory:
        steps = run_world(measure_steps, 4, config, directory,
                          timeout_s=600 * args.repetitions * 4, progress=progress)[0]
    result_tables, summary = tables(steps, meshes, config.fake_world)
    if meshes is None:
        result_tables = [t for t in result_tables if t.name != "torchtitan_meshes"]
    print(f"machine: {machine['nproc']} CPUs ({machine['cpu_model']}), torch {machine['torch']}, "
          f"load average at start {machine['load_average_at_start'][0]}, "
          f"{machine['date_utc']} UTC; {args.repetitions} repetitions of {args.steps} steps\n")
    print("\n\n".join(table.text() for table in result_tables))
    print("\n" + "\n\n".join(table.markdown() for table in result_tables))
    print("\n" + json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine, "summary": summary,
             "tables": {table.name: table.to_dict() for table in result_tables}}, indent=1) + "\n",
            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
