"""Where ``GroupRegistry.create()`` spends its time on real gloo ranks:
``python benchmarks/creation_phases.py [--world 8] [--worlds 10] [--warm | --first]``.

Two tables from fresh gloo worlds (one per repetition, as ``commgroups bench`` does):

- per phase, the slowest rank's milliseconds: agreement (its store namespace, then the vote),
  each group, the flight recorder's start and the heartbeat's start;
- the same layout created in every way of :data:`VARIANTS` once in each world, in rotating order:
  the slowest rank's median milliseconds and paired ratios against DeviceMesh and against a
  loop of the registry's own ``new_group`` calls. Besides the registry, DeviceMesh (with and
  without its own fsdp group: the registry's communicators) and the loop, the registry with its
  parts turned off one after another: the heartbeat, the flight recorder, both, then also the
  socket ledger, then also the agreement. Those last two are no option of the product (without
  the ledger a gloo generation cannot be severed after a rank loss, without the agreement
  ranks that disagree hang): they only measure what each part costs.

``--warm``: each process first creates one registry and one DeviceMesh, so every variant runs
warm code (the bench's figure is a process's first of each). ``--first``: instead, each variant
is the first creation in a fresh world of its own (as the bench's first-creation table), the
variants alternating, ``--worlds`` of each; the one table then gives each variant's paired ratio
to DeviceMesh, which is what turning each part off buys where it counts (a job's one creation).
A probe for the creation floor (benchmarks/README.md, docs/guide.md "Creation happens in
`create()`"), not a scenario of the bench: its phases are timed, and its parts turned off, by
replacing the registry's internal functions.
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
VARIANTS = ("registry", "registry, no heartbeat", "registry, no flight recorder",
            "registry, no heartbeat or flight", "registry, quiet, no socket ledger",
            "registry, quiet, no ledger or agreement", "devicemesh", "devicemesh + own fsdp",
            "new_group loop")


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


def _create(variant: str, layout: Any) -> Any:
    """``variant`` of :data:`VARIANTS` made on every rank; returns what keeps it alive."""
    from commgroups.bench import creation
    from commgroups.creation import agreement, sockets
    from commgroups.generation import make
    from commgroups.registry import GroupRegistry

    if not variant.startswith("registry"):
        # Not creation._timed: its call counter patches every loaded module's new_group first
        # (a scan of sys.modules), which the bench leaves outside its timer and a timer around
        # this call would count (DeviceMesh then read 1.2x to 1.6x slower than it is).
        return creation._create(variant, layout, creation.CallCounter())
    quiet = layout.model_copy(update={"flight_recorder": False})
    if variant == "registry":
        return GroupRegistry(layout).create()
    if variant == "registry, no heartbeat":
        return GroupRegistry(layout, heartbeat_s=None).create()
    if variant == "registry, no flight recorder":
        return GroupRegistry(quiet).create()
    if variant == "registry, no heartbeat or flight":
        return GroupRegistry(quiet, heartbeat_s=None).create()
    ledger, agree = sockets.SUPPORTED, make.agree
    sockets.SUPPORTED = False  # type: ignore[misc]  # a probe: no ledger, no sever
    if variant == "registry, quiet, no ledger or agreement":
        make.agree = lambda *args, **kwargs: agreement.Verdict(carried=False)  # type: ignore[assignment]
    try:
        return GroupRegistry(quiet, heartbeat_s=None).create()
    finally:
        sockets.SUPPORTED, make.agree = ledger, agree  # type: ignore[misc]


def _measure(rank: int, world: int, progress: Any, repetition: int,
             warm: bool) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from commgroups.bench import creation

    spent: dict[str, float] = {}
    _timing(spent)
    layout = creation.bench_layout(world)
    warm_up = dist.new_group(group_desc="warm-up")
    dist.barrier(group=warm_up)  # type: ignore[arg-type]  # every rank is a member
    kept: list[Any] = []
    if warm:
        kept += [_create("registry", layout), _create("devicemesh", layout)]
    order = VARIANTS[repetition % len(VARIANTS):] + VARIANTS[:repetition % len(VARIANTS)]
    out: dict[str, list[float]] = {}
    for variant in order:
        dist.barrier()
        spent.clear()
        start = time.perf_counter()
        kept.append(_create(variant, layout))
        values = [time.perf_counter() - start] + [spent.get(name, 0.0) for _, name in PHASES]
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[variant] = slowest.tolist()
    dist.barrier()
    return out


FIRST_VARIANTS = ("devicemesh", "registry", "registry, no heartbeat or flight",
                  "registry, quiet, no socket ledger", "registry, quiet, no ledger or agreement",
                  "devicemesh + own fsdp", "new_group loop")


def _measure_first(rank: int, world: int, progress: Any, variant: str) -> float:
    """``variant`` as the first creation in this fresh world: the slowest rank's seconds."""
    import torch
    import torch.distributed as dist

    from commgroups.bench import creation

    layout = creation.bench_layout(world)
    warm_up = dist.new_group(group_desc="warm-up")
    dist.barrier(group=warm_up)  # type: ignore[arg-type]  # every rank is a member
    dist.barrier()
    start = time.perf_counter()
    kept = _create(variant, layout)
    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if hasattr(kept, "_recovery"):  # the registry's start-up, untimed, as the bench's settle()
        kept._recovery.wait_started()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.barrier()
    return float(slowest.item())


def _first(world: int, worlds: int) -> None:
    from commgroups.bench.world import run_world

    times: dict[str, list[float]] = {variant: [] for variant in FIRST_VARIANTS}
    for repetition in range(worlds):
        shift = repetition % len(FIRST_VARIANTS)
        for variant in FIRST_VARIANTS[shift:] + FIRST_VARIANTS[:shift]:
            times[variant].append(run_world(_measure_first, world, variant,
                                            grow_table=False)[0])
    print(f"the first creation in a fresh world, {world} gloo ranks, {worlds} worlds each: "
          "slowest rank, median ms; paired ratio to devicemesh, median [min-max]")
    for variant in FIRST_VARIANTS:
        paired = sorted(a / b for a, b in zip(times[variant], times["devicemesh"]))
        print(f"  {variant:40s} {statistics.median(times[variant]) * 1e3:6.1f}  "
              f"{statistics.median(paired):.2f} [{paired[0]:.2f}-{paired[-1]:.2f}]")


def main(argv: list[str]) -> int:
    """Measure and print both tables."""
    sys.path.insert(0, str(ROOT))  # the source tree's commgroups when it is not installed
    from commgroups.bench.world import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="gloo ranks (default 8)")
    parser.add_argument("--worlds", type=int, default=10, help="fresh worlds (default 10)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--warm", action="store_true",
                      help="every variant on warm code (a registry and a DeviceMesh first)")
    mode.add_argument("--first", action="store_true",
                      help="each variant the first creation in a fresh world of its own")
    args = parser.parse_args(argv)
    if args.first:
        _first(args.world, args.worlds)
        return 0
    runs: dict[str, list[list[float]]] = {variant: [] for variant in VARIANTS}
    for repetition in range(args.worlds):
        for variant, values in run_world(_measure, args.world, repetition,
                                         args.warm)[0].items():
            runs[variant].append(values)
    print(f"create() on {args.world} gloo ranks, {args.worlds} worlds"
          f"{', warm' if args.warm else ''}: slowest rank, median ms, by phase")
    for variant in ("registry", "registry, no heartbeat or flight"):
        columns = [statistics.median(column) * 1e3 for column in zip(*runs[variant])]
        phases = ", ".join(f"{name.split('.')[-1]} {value:.1f}"
                           for (_, name), value in zip(PHASES, columns[1:]))
        print(f"  {variant}: {columns[0]:.1f} ({phases})")
    print("every variant: median ms; paired ratios, median [min-max]")
    for variant in VARIANTS:
        ratios = []
        for base in ("devicemesh", "new_group loop"):
            paired = sorted(a[0] / b[0] for a, b in zip(runs[variant], runs[base]))
            ratios.append(f"/ {base} {statistics.median(paired):.2f} "
                          f"[{paired[0]:.2f}-{paired[-1]:.2f}]")
        median = statistics.median(values[0] for values in runs[variant]) * 1e3
        print(f"  {variant:40s} {median:6.1f}  {'  '.join(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
