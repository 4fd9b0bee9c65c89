"""Rebuild after a rank loss against first creation, by phase: the ratio table.

Gloo rows come from the kill worlds of :mod:`commgroups.bench.rank_loss` (the ``rebuild(alive=)``
variant): each creates the registry and its HSDP mesh from scratch (first creation), then the last
rank is SIGKILLed mid-step and the survivors call ``rebuild(alive=survivors)``, which removes its
replica. Timed from the call (the detection before it and the kill-to-rebuilt wall clock are in
that module's table), so the ratio compares the rebuild's own work with first creation. A sample
is the slowest survivor's time; the ratio is rebuild / first creation, per world.

Simulated: one process is one rank of a 65,536-rank fake world (8 ranks a replica); a repetition
times first creation, then ``replan`` + ``rebuild`` after the loss of one node of 8.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from commgroups import torch_internals
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, paired_ratios, summarize
from commgroups.layout.specs import ElasticSpec, Layout
from commgroups.rank_loss.rebuild_report import PHASES
from commgroups.registry import GroupRegistry

__all__ = ["hsdp_layout", "measure_fake", "tables"]


def hsdp_layout(world_size: int, shard: int = 2) -> Layout:
    """HSDP over ``world_size`` ranks, ``shard`` ranks a replica, replicas elastic down to one."""
    return Layout(dims={"dp_replicate": world_size // shard, "dp_shard": shard},
                  elastic=ElasticSpec(dims={"dp_replicate": 1}))


def measure_fake(rank: int, world_size: int, progress: Progress, repetitions: int) -> dict[str, Any]:
    """Rank 0 of a simulated world: first creation, then replan + rebuild without one node of 8."""
    FakeStore = torch_internals.import_fake_backend()
    layout = hsdp_layout(world_size, shard=8)
    lost = set(range(8, 16))
    alive = [r for r in range(world_size) if r not in lost]
    samples: dict[str, list[float]] = {"create": [], "rebuild": [], "rebuild less release": [],
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
            samples["rebuild less release"].append(
                samples["rebuild"][-1] - report.seconds.get("release", 0.0))
            for phase in PHASES:
                samples[f"phase {phase}"].append(report.seconds.get(phase, 0.0))
            registry.close()
        finally:
            dist.destroy_process_group()
        progress.advance()
    return {"world": world_size, "backend": "fake", "samples": samples}


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
        for what in ("create", "rebuild", "rebuild less release", *(f"phase {p}" for p in PHASES)):
            ratio = (summarize(paired_ratios(samples[what], base)) if what.startswith("rebuild")
                     else "-")
            table.add(result["world"], result["backend"], what,
                      summarize(samples[what]).scaled(1e3), ratio)
        key = f"rebuild_ratio_vs_create_{result['backend']}{result['world']}"
        summary[key] = summarize(paired_ratios(samples["rebuild"], base)).median
        summary[f"rebuild_less_release_ratio_vs_create_{result['backend']}{result['world']}"] = (
            summarize(paired_ratios(samples["rebuild less release"], base)).median)
        summary[f"rebuild_seconds_{result['backend']}{result['world']}"] = summarize(
            samples["rebuild"]).median
    table.notes += [
        "create: GroupRegistry(layout).create() + device_mesh(['dp_replicate', 'fsdp']) on every rank "
        "(slowest rank); rebuild: registry.rebuild(alive=survivors) from its call after the last "
        "rank was SIGKILLed mid-step (gloo: the rebuild(alive=) worlds of the kill_to_rebuilt "
        "table, every role at a 600 s timeout), slowest survivor, meshes included",
        "phases (each the slowest survivor's): check_in (report the loss, interrupt the old "
        "groups, agree on the survivors through the store), replan (the smaller layout and its "
        "rank map), retire (old generation: handles stale, meshes forgotten), create (agreement + "
        "every role on the survivors), meshes (the meshes asked for before), release (the old "
        "generation's groups destroyed, its store keys deleted, then a full gc.collect(): the "
        "groups' last references sit in reference cycles)",
        "rebuild less release: the slowest survivor's rebuild without its release phase (what "
        "the rebuild costs before the old generation is cleaned up)",
        "fake: one node of 8 ranks (one replica) lost out of the simulated world; one process",
    ]
    return table, summary
