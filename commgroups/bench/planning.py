"""Planning: one rank's groups and every group of every role, from 1,024 to 1,048,576 ranks, against
DeviceMesh's own layout computation for the same dims.

DeviceMesh computes each dim's rank rows with its private ``_MeshLayout.remap_to_tensor`` over the
whole world and turns each row into a list (what ``_init_one_process_group`` loops over); a flattened
dim (fsdp) collapses the sliced layout first, as ``_flatten`` does. It has no one-rank path: a rank
learns its own row only from the full computation, so the DeviceMesh column is the same in both tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from commgroups import torch_internals
from commgroups.bench.config import BenchConfig
from commgroups.bench.creation import bench_layout
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan

__all__ = ["devicemesh_rows", "run"]

VARIANTS: tuple[str, ...] = ("plan one rank", "plan all groups", "devicemesh layout")


def devicemesh_rows(layout: Layout) -> list[list[int]] | None:
    """Every group DeviceMesh would compute for the layout's dims, its fsdp flatten and the world
    (checkpoint metadata), as lists; None when this torch lacks the private layout API."""
    return torch_internals.devicemesh_rows(tuple(layout.dims.values()))


def _plan_one_rank(layout: Layout) -> object:
    plan = Plan(layout)
    rank = layout.world_size - 1  # the last rank: no shortcut for rank 0
    return [plan.ranks_of(role, rank) for role in plan.role_names]


def _plan_all(layout: Layout) -> object:
    plan = Plan(layout)
    return [plan.rank_groups(role) for role in plan.role_names]


def _time(fn: Callable[[Layout], object], layout: Layout) -> float:
    start = time.perf_counter()
    fn(layout)
    return time.perf_counter() - start


def run(config: BenchConfig, progress: Progress) -> tuple[Table, dict[str, Any]]:
    """Time the three computations per world size, interleaved, in this process."""
    functions: dict[str, Callable[[Layout], object]] = {
        "plan one rank": _plan_one_rank,
        "plan all groups": _plan_all,
        "devicemesh layout": devicemesh_rows,
    }
    available = devicemesh_rows(bench_layout(8)) is not None
    variants = VARIANTS if available else VARIANTS[:2]
    table = Table(
        "planning",
        "Planning: commgroups Plan vs DeviceMesh's layout computation (dp_shard x cp, 4 roles)",
        ["world", "variant", "time ms", "ratio vs devicemesh"],
    )
    progress.describe("planning")
    progress.add_total(len(config.plan_worlds) * config.plan_repetitions)
    largest: dict[str, float] = {}
    for world in config.plan_worlds:
        layout = bench_layout(world)
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for repetition in range(config.plan_repetitions):
            for variant in interleaved(variants, repetition):
                samples[variant].append(_time(functions[variant], layout))
            progress.advance()
        for variant in variants:
            ratio: Any = "-"
            if available:
                ratio = summarize(paired_ratios(samples[variant], samples["devicemesh layout"]))
            table.add(world, variant, summarize(samples[variant]).scaled(1e3), ratio)
            largest[variant] = summarize(samples[variant]).median
    table.notes += [
        "plan one rank: Plan(layout) + group_of for every role, for the last rank",
        "plan all groups: Plan(layout) + groups() for every role (every rank list materialised)",
        "devicemesh layout: _MeshLayout.remap_to_tensor per dim + the fsdp collapse, rows as lists",
    ]
    summary: dict[str, Any] = {"planning_largest_world": max(config.plan_worlds)}
    summary["planning_one_rank_ms_at_largest"] = 1e3 * largest["plan one rank"]
    return table, summary
