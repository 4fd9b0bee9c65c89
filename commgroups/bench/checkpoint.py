"""Checkpoint metadata: DCP save and load with the registry's gloo checkpoint group against the
default group, and the metadata exchange alone (gather + scatter of SavePlan-sized objects) as the
world and the plan grow.

On this CPU machine the default group is gloo too, so both variants move the same bytes over the same
transport: the table shows what a dedicated gloo group costs (nothing measurable, is the hope), not the
HCCL win of the design (device staging of pickled plans), which needs an accelerator.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.layout.specs import CHECKPOINT_ROLE
from commgroups.registry import GroupRegistry

__all__ = ["VARIANTS", "measure_dcp", "measure_exchange", "save_plan", "tables"]

VARIANTS: tuple[str, ...] = ("checkpoint group", "default group")


def save_plan(items: int, rank: int) -> Any:
    """A SavePlan with ``items`` tensor WriteItems, as DCP's default planner would make them."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    size = torch.Size([1024, 1024])
    return SavePlan([
        WriteItem(
            index=MetadataIndex(f"model.layers.{i}.rank{rank}.weight", torch.Size([0, 0])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size),
                properties=TensorProperties(dtype=torch.bfloat16),
                size=size,
            ),
        )
        for i in range(items)
    ])


def _slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """The slowest rank's wall time of ``fn(*args, **kwargs)``, every rank starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    return _slowest(time.perf_counter() - start)


def _exchange(plan: Any, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
    # DCP's reduce_scatter of plans: gather every local plan on the coordinator, scatter them back.
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(plan, gathered, dst=0, group=group)
    output: list[Any] = [None]
    dist.scatter_object_list(output, gathered, src=0, group=group)


def measure_exchange(rank: int, world_size: int, progress: Progress, config: BenchConfig,
                     registry: GroupRegistry) -> dict[str, Any]:
    """Time the plan exchange per plan size, checkpoint group vs default group, interleaved."""
    group = registry.group(CHECKPOINT_ROLE)
    groups: dict[str, dist.ProcessGroup | None] = {"checkpoint group": group, "default group": None}
    results: list[dict[str, Any]] = []
    progress.describe(f"metadata exchange, gloo x{world_size}")
    progress.add_total(len(config.metadata_items))
    for items in config.metadata_items:
        plan = save_plan(items, rank)
        for name in VARIANTS:  # warm up both groups' pairs
            _exchange(plan, rank, world_size, groups[name])
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for repetition in range(config.metadata_repetitions):
            for name in interleaved(VARIANTS, repetition):
                dist.barrier()
                start = time.perf_counter()
                _exchange(plan, rank, world_size, groups[name])
                samples[name].append(_slowest(time.perf_counter() - start))
        results.append({"items": items, "plan_bytes": len(pickle.dumps(plan)), "samples": samples})
        progress.advance()
    return {"world": world_size, "results": results}


def measure_dcp(rank: int, world_size: int, progress: Progress, config: BenchConfig,
                registry: GroupRegistry, directory: str) -> dict[str, Any]:
    """Time dcp.save and dcp.load through the registry's checkpoint group and the default group."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from commgroups.integrations import dcp as cg_dcp

    numel = max(1, config.dcp_tensor_bytes // 4)
    # Per-rank keys: every rank writes its own tensors, like a sharded model, and the global plan
    # holds every rank's items.
    state = {f"rank{rank}.t{i}": torch.full((numel,), float(i)) for i in range(config.dcp_tensors)}
    samples: dict[str, dict[str, list[float]]] = {op: {v: [] for v in VARIANTS}
                                                  for op in ("save", "load")}
    progress.describe(f"dcp save/load, gloo x{world_size}")
    progress.add_total(config.dcp_repetitions)
    for repetition in range(config.dcp_repetitions):
        for name in interleaved(VARIANTS, repetition):
            path = os.path.join(directory, f"w{world_size}-r{repetition}-{name.replace(' ', '_')}")
            writer, reader = FileSystemWriter(path, sync_files=False), FileSystemReader(path)
            ours = name == "checkpoint group"
            save = functools.partial(cg_dcp.save, registry=registry) if ours else dcp_save
            load = functools.partial(cg_dcp.load, registry=registry) if ours else dcp_load
            samples["save"][name].append(_timed(save, state, storage_writer=writer))
            samples["load"][name].append(_timed(load, state, storage_reader=reader))
        progress.advance()
    return {"world": world_size, "tensors": config.dcp_tensors,
            "tensor_bytes": config.dcp_tensor_bytes, "samples": samples}


def tables(dcp_results: list[dict[str, Any]], exchanges: list[dict[str, Any]]
           ) -> tuple[list[Table], dict[str, Any]]:
    """The DCP table and the metadata-exchange table."""
    save_load = Table(
        "checkpoint_dcp",
        "Checkpoint: DCP save/load, registry gloo checkpoint group vs default group",
        ["world", "op", "tensors per rank", "variant", "time ms", "ratio vs default group"],
    )
    summary: dict[str, Any] = {}
    for result in dcp_results:
        for op, by_variant in result["samples"].items():
            base = by_variant["default group"]
            for name in VARIANTS:
                ratio = summarize(paired_ratios(by_variant[name], base))
                save_load.add(result["world"], op, result["tensors"], name,
                              summarize(by_variant[name]).scaled(1e3), ratio)
                if name == "checkpoint group":
                    summary[f"dcp_{op}_ratio_vs_default_group"] = ratio.median
    save_load.notes += [
        "slowest rank's wall time, median [p25-p75]; ratio per repetition, median [p25-p75]",
        "both groups are gloo on this CPU machine: this shows the dedicated group costs nothing, "
        "not the accelerator-side win (no device staging of pickled plans)",
    ]
    exchange = Table(
        "checkpoint_exchange",
        "Checkpoint metadata exchange alone: gather_object + scatter_object_list of SavePlans",
        ["world", "items per plan", "plan KiB", "variant", "time ms", "ratio vs default group"],
    )
    for result in sorted(exchanges, key=lambda r: r["world"]):
        for entry in result["results"]:
            base = entry["samples"]["default group"]
            for name in VARIANTS:
                exchange.add(result["world"], entry["items"], round(entry["plan_bytes"] / 1024, 1),
                             name, summarize(entry["samples"][name]).scaled(1e3),
                             summarize(paired_ratios(entry["samples"][name], base)))
    exchange.notes.append("slowest rank's wall time per exchange; the plan is pickled per rank")
    return [save_load, exchange], summary
