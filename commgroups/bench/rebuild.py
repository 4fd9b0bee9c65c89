"""Rebuild after a rank loss against first creation, by phase.

Gloo worlds of 4 and 8 ranks with HSDP (``dp_replicate x dp_shard=2``, replicas elastic): each
repetition creates the registry and its HSDP mesh from scratch, then the last rank leaves it (it stays
alive but takes no further part, exactly what a lost rank does to the others) and the survivors call
``rebuild(alive=...)``, which removes its replica. Timed from the call, so the check-in measures
agreement on the survivors once each has noticed the loss (a job that does not know who died also
waits for the check-in window). A sample is the slowest survivor's time; the ratio is rebuild /
first creation, per repetition.

Simulated: one process is one rank of a 65,536-rank fake world (8 ranks a replica); a repetition
times first creation, then ``replan`` + ``rebuild`` after the loss of one node of 8.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, paired_ratios, summarize
from commgroups.layout.specs import ElasticSpec, Layout
from commgroups.rank_loss.rebuild_report import PHASES
from commgroups.registry import GroupRegistry

__all__ = ["hsdp_layout", "measure_fake", "measure_gloo", "merge", "tables"]


def hsdp_layout(world_size: int, shard: int = 2) -> Layout:
    """HSDP over ``world_size`` ranks, ``shard`` ranks a replica, replicas elastic down to one."""
    return Layout(dims={"dp_replicate": world_size // shard, "dp_shard": shard},
                  elastic=ElasticSpec(dims={"dp_replicate": 1}))


def _slowest(values: list[float], group: dist.ProcessGroup) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.tolist()]


def measure_gloo(rank: int, world_size: int, progress: Progress, repetitions: int) -> dict[str, Any]:
    """On every rank of a real gloo world: first creation, then rebuild without the last rank.

    Run one repetition per world: after a rebuild the ranks left out have created fewer groups
    than the members, so torch would name the next registry's groups differently on them.
    """
    layout = hsdp_layout(world_size)
    # torch >= 2.14 types new_group as ProcessGroup | NON_GROUP_MEMBER: Any for both.
    everyone: Any = dist.new_group(list(range(world_size)), group_desc="bench-everyone")
    survivors = list(range(world_size - 1))
    # Only the survivors' clock matters after the loss; every rank calls new_group (all_ranks).
    alive_group: Any = dist.new_group(survivors, group_desc="bench-survivors")
    samples: dict[str, list[float]] = {"create": [], "rebuild": [],
                                       **{f"phase {p}": [] for p in PHASES}}
    kept: list[GroupRegistry] = []
    progress.describe(f"rebuild, gloo x{world_size}")
    progress.add_total(repetitions)
    for _ in range(repetitions):
        dist.barrier(group=everyone)
        start = time.perf_counter()
        registry = GroupRegistry(layout).create()
        registry.device_mesh(["dp_replicate", "fsdp"])
        (created,) = _slowest([time.perf_counter() - start], everyone)
        kept.append(registry)
        if rank in survivors:
            dist.barrier(group=alive_group)
            start = time.perf_counter()
            report = registry.rebuild(alive=survivors)
            total = time.perf_counter() - start
            phases = [report.seconds.get(p, 0.0) for p in PHASES]
            slowest = _slowest([total, *phases], alive_group)
            samples["create"].append(created)
            samples["rebuild"].append(slowest[0])
            for phase, value in zip(PHASES, slowest[1:]):
                samples[f"phase {phase}"].append(value)
        progress.advance()
    dist.barrier(group=everyone)
    for registry in kept:  # the leaver's groups (and the retired ones) go with the world
        registry.close()
    return {"world": world_size, "backend": "gloo", "samples": samples}


def measure_fake(rank: int, world_size: int, progress: Progress, repetitions: int) -> dict[str, Any]:
    """Rank 0 of a simulated world: first creation, then replan + rebuild without one node of 8."""
    FakeStore = torch_internals.import_fake_backend()
    layout = hsdp_layout(world_size, shard=8)
    lost = set(range(8, 16))
    alive = [r for r in range(world_size) if r not in lost]
    samples: dict[str, list[float]] = {"create": [], "rebuild": [],
                                       **{f"phase {p}": [] for p in PHASES}}
    progress.describe(f"rebuild, fake x{world_size}")
    progress.add_total(repetitions)
    for _ in range(repetitions):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            start = time.perf_counter()
            registry = GroupRegistry(layout).create()
            registry.device_mesh(["dp_replicate", "fsdp"])
            samples["create"].append(time.perf_counter() - start)
            start = time.perf_counter()
            report = registry.rebuild(alive=alive)
            samples["rebuild"].append(time.perf_counter() - start)
            for phase in PHASES:
                samples[f"phase {phase}"].append(report.seconds.get(phase, 0.0))
            registry.close()
        finally:
            dist.destroy_process_group()
        progress.advance()
    return {"world": world_size, "backend": "fake", "samples": samples}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several worlds' results of the same size (their samples joined)."""
    merged: dict[str, Any] = {**results[0], "samples": {k: [] for k in results[0]["samples"]}}
    for result in results:
        for key, values in result["samples"].items():
            merged["samples"][key].extend(values)
    return merged


def tables(results: list[dict[str, Any]]) -> tuple[Table, dict[str, Any]]:
    """The rebuild table and the summary figures (``rebuild_ratio_vs_create`` per world)."""
    table = Table(
        "rebuild",
        "Rebuild after losing a rank (HSDP, replicas elastic) vs first creation, by phase",
        ["world", "backend", "what", "time ms", "ratio vs first creation"],
    )
    summary: dict[str, Any] = {}
    for result in sorted(results, key=lambda r: (r["backend"] != "gloo", r["world"])):
        samples = result["samples"]
        base = samples["create"]
        for what in ("create", "rebuild", *(f"phase {p}" for p in PHASES)):
            ratio = summarize(paired_ratios(samples[what], base)) if what == "rebuild" else "-"
            table.add(result["world"], result["backend"], what,
                      summarize(samples[what]).scaled(1e3), ratio)
        key = f"rebuild_ratio_vs_create_{result['backend']}{result['world']}"
        summary[key] = summarize(paired_ratios(samples["rebuild"], base)).median
        summary[f"rebuild_seconds_{result['backend']}{result['world']}"] = summarize(
            samples["rebuild"]).median
    table.notes += [
        "create: GroupRegistry(layout).create() + device_mesh(['dp_replicate', 'fsdp']) on every rank "
        "(slowest rank); rebuild: registry.rebuild(alive=survivors) after the last rank left "
        "(slowest survivor), meshes included",
        "phases: check_in (agree on the survivors through the store), replan (the smaller layout "
        "and its rank map), retire (old generation: "
        "handles stale, meshes forgotten), create (agreement + every role on the survivors), "
        "meshes (the meshes asked for before)",
        "fake: one node of 8 ranks (one replica) lost out of the simulated world; one process",
    ]
    return table, summary
