"""The flight recorder's cost per collective: a 4 KiB all_reduce on a 1-rank gloo group, through
two ``RoleCollectives`` on that one group, one recording and one not, call by call in one run.

Only rank 0 measures (a 1-rank group needs no peer; the other ranks wait at a barrier, so they load
no core). The calls alternate recorded/unrecorded (the order flipped every pair), so load from
other processes hits both alike; each repetition's medians give one added-microseconds sample and
one ratio. Reported: ``flight_recorder_us_per_collective`` (median added microseconds; the bound
is 10, the goal 2) and ``flight_recorder_ratio``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, summarize
from commgroups.collectives.role_collectives import RoleCollectives
from commgroups.flight_recorder.recorder import RoleRecorder

__all__ = ["CALLS_PER_REPETITION", "VARIANTS", "measure", "tables"]

VARIANTS: tuple[str, ...] = ("unrecorded", "recorded")
CALLS_PER_REPETITION = 400
"""Pairs of calls per repetition (one sample of each variant's median)."""


def _repetition(handles: dict[str, RoleCollectives], tensor: torch.Tensor, calls: int,
                repetition: int) -> dict[str, float]:
    times: dict[str, list[int]] = {variant: [] for variant in VARIANTS}
    clock = time.perf_counter_ns
    for call in range(calls):
        order = VARIANTS if (call + repetition) % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            handle = handles[variant]
            start = clock()
            handle.all_reduce(tensor)
            times[variant].append(clock() - start)
    return {variant: statistics.median(values) / 1e3 for variant, values in times.items()}


def measure(rank: int, world_size: int, progress: Progress, config: BenchConfig) -> dict[str, Any]:
    """On rank 0: per-call microseconds of each variant per repetition; others wait."""
    progress.describe("flight recorder cost, 1-rank gloo group")
    progress.add_total(1)
    # every rank makes all; torch >= 2.14 types new_group as ProcessGroup | NON_GROUP_MEMBER
    groups: list[Any] = [dist.new_group([r], backend="gloo") for r in range(world_size)]
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    if rank == 0:
        group = groups[0]
        handles = {
            "unrecorded": RoleCollectives(group, role="cp", async_and_wait=True),
            "recorded": RoleCollectives(group, role="cp", async_and_wait=True,
                                        flight=RoleRecorder("cp", group)),
        }
        tensor = torch.zeros(1024)  # 4 KiB; zeros stay zeros under SUM
        _repetition(handles, tensor, 50, 0)  # warm up both paths (the call-site cache too)
        calls = CALLS_PER_REPETITION if config.name != "smoke" else 20
        for repetition in range(max(3, config.audit_repetitions)):
            for variant, value in _repetition(handles, tensor, calls, repetition).items():
                samples[variant].append(value)
    dist.barrier()
    for group in groups:
        dist.destroy_process_group(group)
    progress.advance()
    return {"samples": samples}


def tables(measured: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    """The flight-recorder cost table and ``flight_recorder_us_per_collective``."""
    table = Table(
        "flight_recorder_cost",
        "Flight recorder cost: 4 KiB all_reduce on a 1-rank gloo group, recorded vs unrecorded",
        ["workload", "unrecorded us", "recorded us", "ratio", "added us per call"],
    )
    plain, recorded = measured["samples"]["unrecorded"], measured["samples"]["recorded"]
    ratio = summarize([r / p for r, p in zip(recorded, plain) if p > 0])
    added = summarize([r - p for r, p in zip(recorded, plain)])
    table.add("all_reduce 4 KiB", summarize(plain), summarize(recorded), ratio, added)
    table.notes += [
        "per-call median of each repetition, then median [p25-p75] over repetitions; recorded and "
        "unrecorded calls alternate call by call on one group through registry.collectives' "
        "RoleCollectives (async-and-wait on in both)",
        "bound 10 us, goal 2 us per collective",
    ]
    return table, {"flight_recorder_us_per_collective": added.median,
                   "flight_recorder_ratio": ratio.median}
