"""Async-and-wait overhead: raw collectives against the registry's async-and-wait wrapper, on gloo.

Both variants run on the same dedicated group, so the only difference is the wrapper (issue with
``async_op=True``, wait at once, plus the role/sequence bookkeeping). Each repetition runs enough calls
per variant to last about ``async_and_wait_target_s``, alternating raw and wrapped call by call, and the
ratio is taken per repetition, so load from other processes on a shared machine hits both alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.layout.specs import Layout
from commgroups.registry import GroupRegistry

__all__ = ["RATIO_MIN_BYTES", "VARIANTS", "measure", "tables"]

VARIANTS: tuple[str, ...] = ("raw", "async-and-wait")
RATIO_MIN_BYTES = 64 * 1024
"""``async_and_wait_overhead_ratio`` is taken over sizes from here up (small messages measure the timer)."""


def _ops(registry: GroupRegistry, role: str, op: str, numel: int, world: int
         ) -> dict[str, Callable[[], Any]]:
    group = registry.group(role)
    safe = registry.collectives(role)
    # Zeros stay zeros under repeated SUM: no overflow to inf changing the arithmetic's speed.
    tensor = torch.zeros(numel, dtype=torch.float32)
    output = torch.zeros(numel * world, dtype=torch.float32)
    if op == "all_reduce":
        return {"raw": lambda: dist.all_reduce(tensor, group=group),
                "async-and-wait": lambda: safe.all_reduce(tensor)}
    if op == "all_gather_into_tensor":
        return {"raw": lambda: dist.all_gather_into_tensor(output, tensor, group=group),
                "async-and-wait": lambda: safe.all_gather_into_tensor(output, tensor)}
    raise ValueError(f"unknown op {op!r}")


def _block(fn: Callable[[], Any], calls: int, group: dist.ProcessGroup) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _alternating(fns: dict[str, Callable[[], Any]], calls: int, group: dist.ProcessGroup,
                 repetition: int) -> dict[str, float]:
    """Per-call time of each variant, the variants alternating call by call (order rotated every
    call), so a burst of load from other processes hits both variants alike."""
    totals = dict.fromkeys(VARIANTS, 0.0)
    dist.barrier(group=group)
    for call in range(calls):
        for variant in interleaved(VARIANTS, repetition + call):
            start = time.perf_counter()
            fns[variant]()
            totals[variant] += time.perf_counter() - start
    return {variant: total / calls for variant, total in totals.items()}


def _slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def measure(rank: int, world_size: int, progress: Progress, config: BenchConfig) -> dict[str, Any]:
    """On every rank: per-call time of each op, size and variant (slowest rank), interleaved."""
    layout = Layout(dims={"cp": world_size})
    results: list[dict[str, Any]] = []
    progress.describe(f"async-and-wait overhead, gloo x{world_size}")
    progress.add_total(len(config.async_and_wait_ops) * len(config.async_and_wait_sizes))
    with GroupRegistry(layout) as registry:
        group = registry.group("cp")
        for op in config.async_and_wait_ops:
            for size in config.async_and_wait_sizes:
                fns = _ops(registry, "cp", op, max(1, size // 4), world_size)
                for fn in fns.values():  # warm up: first calls allocate buffers and connect pairs
                    _block(fn, 2, group)
                # Every rank must make the same number of calls: agree on the slowest estimate.
                once = _slowest(_block(fns["raw"], 2, group))
                calls = max(1, min(2000, round(config.async_and_wait_target_s / max(once, 1e-7))))
                samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for repetition in range(config.async_and_wait_repetitions):
                    for variant, value in _alternating(fns, calls, group, repetition).items():
                        samples[variant].append(_slowest(value))
                results.append({"op": op, "bytes": size, "calls": calls, "samples": samples})
                progress.advance()
    return {"world": world_size, "results": results}


def _size_text(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def tables(measured: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    """The overhead table and ``async_and_wait_overhead_ratio``."""
    table = Table(
        "async_and_wait",
        f"Async-and-wait overhead: raw vs async-and-wait on gloo, {measured['world']} ranks",
        ["op", "size", "bytes", "calls per rep", "raw us", "async-and-wait us", "ratio"],
    )
    big_medians: list[float] = []
    big_pooled: list[float] = []
    for result in measured["results"]:
        raw, safe = result["samples"]["raw"], result["samples"]["async-and-wait"]
        ratios = paired_ratios(safe, raw)
        ratio = summarize(ratios)
        table.add(result["op"], _size_text(result["bytes"]), result["bytes"], result["calls"],
                  summarize(raw).scaled(1e6), summarize(safe).scaled(1e6), ratio)
        if result["bytes"] >= RATIO_MIN_BYTES:
            big_medians.append(ratio.median)
            big_pooled.extend(ratios)
    summary: dict[str, Any] = {}
    if big_medians:
        summary["async_and_wait_overhead_ratio"] = summarize(big_medians).median
        summary["async_and_wait_overhead_ratio_spread"] = summarize(big_pooled).to_dict()
    table.notes += [
        "per-call time of the slowest rank, median [p25-p75] over repetitions; ratio: "
        "async-and-wait / raw per repetition, median [p25-p75]",
        "async_and_wait_overhead_ratio: median over sizes >= 64 KiB of the per-size median ratios; "
        "its spread pools every paired ratio of those sizes",
        "on gloo wait() blocks the host, so this measures the wrapper's CPU cost, not stream effects",
    ]
    return table, summary
