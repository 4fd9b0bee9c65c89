"""Where ``GroupRegistry.create()`` spends its time on real gloo ranks:
``python benchmarks/creation_phases.py [--world 8] [--worlds 10]``.

Two tables from fresh gloo worlds (one per repetition, as ``commgroups bench`` does):

- per phase, the slowest rank's milliseconds: agreement (its store namespace, then the vote),
  each group, the flight recorder's start and the heartbeat's start;
- the same layout created four ways in each world, in rotating order, as paired ratios: the
  registry, the registry with the heartbeat and the flight recorder off, DeviceMesh, and
  DeviceMesh plus its own fsdp group (the registry's communicators).

A probe for the creation floor (benchmarks/README.md), not a scenario of the bench: its phases are
timed by wrapping the registry's internal functions.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PHASES = (("commgroups.generation.make", "agreement_store"),
          ("commgroups.generation.make", "_agree"),
          ("commgroups.generation.make", "_create_one"),
          ("commgroups.generation.make", "open_flight"),
          ("commgroups.rank_loss.recovery", "Recovery.start_threads"))
VARIANTS = ("registry", "registry, no heartbeat or flight", "devicemesh", "devicemesh + own fsdp")


def _timing(spent: dict[str, float]) -> None:
    """Wrap each phase's function so its time on this rank adds up in ``spent``."""
    for module_name, name in PHASES:
        owner: Any = importlib.import_module(module_name)
        attribute = name
        if "." in name:
            class_name, attribute = name.split(".")
            owner = getattr(owner, class_name)
        original = getattr(owner, attribute)

        def timed(*args: Any, _original: Callable[..., Any] = original, _name: str = name,
                  **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start

        functools.update_wrapper(timed, original)
        setattr(owner, attribute, timed)


def _measure(rank: int, world: int, progress: Any, repetition: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from commgroups.bench import creation
    from commgroups.registry import GroupRegistry

    spent: dict[str, float] = {}
    _timing(spent)
    layout = creation.bench_layout(world)
    quiet = layout.model_copy(update={"flight_recorder": False})
    warm_up = dist.new_group(group_desc="warm-up")
    dist.barrier(group=warm_up)  # type: ignore[arg-type]  # every rank is a member
    order = VARIANTS[repetition % len(VARIANTS):] + VARIANTS[:repetition % len(VARIANTS)]
    out: dict[str, list[float]] = {}
    kept: list[Any] = []
    for variant in order:
        dist.barrier()
        spent.clear()
        start = time.perf_counter()
        if variant == "registry":
            kept.append(GroupRegistry(layout).create())
        elif variant == "registry, no heartbeat or flight":
            kept.append(GroupRegistry(quiet, heartbeat_s=None).create())
        else:
            kept.append(creation._timed(variant, layout)[2])
        values = [time.perf_counter() - start] + [spent.get(name, 0.0) for _, name in PHASES]
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[variant] = slowest.tolist()
    dist.barrier()
    return out


def main(argv: list[str]) -> int:
    """Measure and print both tables."""
    sys.path.insert(0, str(ROOT))  # the source tree's commgroups when it is not installed
    from commgroups.bench.world import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="gloo ranks (default 8)")
    parser.add_argument("--worlds", type=int, default=10, help="fresh worlds (default 10)")
    args = parser.parse_args(argv)
    runs: dict[str, list[list[float]]] = {variant: [] for variant in VARIANTS}
    for repetition in range(args.worlds):
        for variant, values in run_world(_measure, args.world, repetition)[0].items():
            runs[variant].append(values)
    print(f"create() on {args.world} gloo ranks, {args.worlds} worlds: slowest rank, median ms")
    for variant in ("registry", "registry, no heartbeat or flight"):
        columns = [statistics.median(column) * 1e3 for column in zip(*runs[variant])]
        phases = ", ".join(f"{name.split('.')[-1]} {value:.1f}"
                           for (_, name), value in zip(PHASES, columns[1:]))
        print(f"  {variant}: {columns[0]:.1f} ({phases})")
    print("paired ratios, median [min-max]:")
    for variant in VARIANTS:
        for base in ("devicemesh", "devicemesh + own fsdp"):
            ratios = sorted(a[0] / b[0] for a, b in zip(runs[variant], runs[base]))
            print(f"  {variant} / {base}: {statistics.median(ratios):.2f} "
                  f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
