"""The audit's cost per collective: the same calls with and without ``cg.audit.record``, on gloo.

Two workloads on one registry: plain collectives on a role's group (the recorder's work per call:
schema parsing, the call site, the DCP check) and a DTensor op that needs a redistribute (the mode
sees every aten op of the thread and lets DTensor desugar first). Each repetition runs a block of
calls per variant, the variants alternating block by block, and the ratio is taken per repetition,
so load from other processes hits both alike. Reported: per-call time, the ratio, and the audit's
added microseconds per collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from commgroups.audit.recorder import record
from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.layout.specs import Layout
from commgroups.registry import GroupRegistry

__all__ = ["VARIANTS", "WORKLOADS", "measure", "tables"]

VARIANTS: tuple[str, ...] = ("plain", "audited")
WORKLOADS: tuple[str, ...] = ("all_reduce 4 KiB", "DTensor redistribute")


def _workloads(registry: GroupRegistry, rank: int) -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    group = registry.group("cp")
    tensor = torch.zeros(1024)  # zeros stay zeros under SUM: the arithmetic never changes speed
    mesh = registry.device_mesh(["cp"])
    partial = DTensor.from_local(torch.zeros(1024), mesh, [Partial()])
    return {
        "all_reduce 4 KiB": lambda: dist.all_reduce(tensor, group=group),
        "DTensor redistribute": lambda: partial.redistribute(mesh, [Replicate()]).to_local(),
    }


def _block(fn: Callable[[], Any], calls: int, scope: Callable[[], AbstractContextManager[Any]],
           group: dist.ProcessGroup) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    with scope():
        for _ in range(calls):
            fn()
    return (time.perf_counter() - start) / calls


def _slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def measure(rank: int, world_size: int, progress: Progress, config: BenchConfig) -> dict[str, Any]:
    """On every rank: per-call time of each workload with and without the audit (slowest rank)."""
    results: list[dict[str, Any]] = []
    progress.describe(f"audit cost, gloo x{world_size}")
    progress.add_total(len(WORKLOADS))
    with GroupRegistry(Layout(dims={"cp": world_size})) as registry:
        group = registry.group("cp")
        scopes: dict[str, Callable[[], AbstractContextManager[Any]]] = {
            "plain": nullcontext, "audited": lambda: record(registry)}
        for name, fn in _workloads(registry, rank).items():
            for variant in VARIANTS:  # warm up both paths
                _block(fn, 2, scopes[variant], group)
            once = _slowest(_block(fn, 4, scopes["plain"], group))
            calls = max(2, min(2000, round(config.async_and_wait_target_s / max(once, 1e-7))))
            samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for repetition in range(config.audit_repetitions):
                for variant in interleaved(VARIANTS, repetition):
                    samples[variant].append(_slowest(_block(fn, calls, scopes[variant], group)))
            results.append({"workload": name, "calls": calls, "samples": samples})
            progress.advance()
    return {"world": world_size, "results": results}


def tables(measured: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    """The audit-cost table and ``audit_cost_us_per_collective`` (plain all_reduce workload)."""
    table = Table(
        "audit_cost",
        f"Audit cost: calls with and without cg.audit.record, gloo, {measured['world']} ranks",
        ["workload", "calls per rep", "plain us", "audited us", "ratio", "added us per call"],
    )
    summary: dict[str, Any] = {}
    for result in measured["results"]:
        plain, audited = result["samples"]["plain"], result["samples"]["audited"]
        ratio = summarize(paired_ratios(audited, plain))
        added = summarize([(a - p) * 1e6 for a, p in zip(audited, plain)])
        table.add(result["workload"], result["calls"], summarize(plain).scaled(1e6),
                  summarize(audited).scaled(1e6), ratio, added)
        key = "audit_cost_us_per_collective" if result["workload"] == WORKLOADS[0] else \
            "audit_cost_us_per_dtensor_redistribute"
        summary[key] = added.median
        summary[key.replace("_us_per_", "_ratio_")] = ratio.median
    table.notes += [
        "per-call time of the slowest rank, median [p25-p75] over repetitions; ratio: audited / "
        "plain per repetition; added: audited - plain per repetition, in microseconds",
        "the DTensor workload's call is one redistribute (Partial -> Replicate: one all_reduce, "
        "plus the DTensor ops the audit's dispatch mode also sees)",
    ]
    return table, summary
