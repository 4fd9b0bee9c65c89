"""Memory: estimated communicator memory per rank for typical layouts (:mod:`commgroups.planning.memory`).

Not a measurement (there is no accelerator here): the published per-communicator figures applied to
each layout, to compare how many device communicators a layout costs, what ``split_share`` saves and
what a smaller HCCL buffer per role saves.
"""

from __future__ import annotations

from typing import Any

from commgroups.bench.progress import Progress
from commgroups.layout.specs import CHECKPOINT_ROLE, HcclOptions, Layout, RoleOptions, RoleSpec
from commgroups.planning.memory import estimate_memory

__all__ = ["layouts", "run"]


def layouts() -> dict[str, Layout]:
    """The layouts compared: the two failure cases of the design and a large 4-D job."""
    return {
        "8 GPUs: dp_shard 2 x cp 4": Layout(dims={"dp_shard": 2, "cp": 4}),
        "4 GPUs: cp 4 (cp == world)": Layout(dims={"cp": 4}),
        "512 ranks: dp_replicate 4 x dp_shard 8 x cp 2 x tp 8": Layout(
            dims={"dp_replicate": 4, "dp_shard": 8, "cp": 2, "tp": 8}
        ),
    }


def _small_hccl_buffers(layout: Layout, megabytes: int) -> Layout:
    roles = [
        role if role.backend == "gloo" else RoleSpec(
            **{**role.model_dump(exclude={"options"}),
               "options": RoleOptions(hccl=HcclOptions(buffer_size_mb=megabytes))}
        )
        for role in layout.roles
    ]
    return Layout(dims=dict(layout.dims), roles=roles)


def run(progress: Progress) -> tuple[Any, dict[str, Any]]:
    """The memory table (rank 0 of each layout) and its summary."""
    from commgroups.bench.stats import Table

    table = Table(
        "memory",
        "Memory: estimated communicator memory on rank 0 (MB; 1 MB = 10^6 bytes)",
        ["layout", "backend", "creation", "device communicators", "low MB", "high MB"],
    )
    progress.describe("memory")
    cases = layouts()
    progress.add_total(len(cases))
    summary: dict[str, Any] = {}
    for name, layout in cases.items():
        rows = [
            ("nccl", "all_ranks", None, layout),
            ("nccl", "split + split_share", True, layout),
            ("hccl", "all_ranks (200 MB buffers)", None, layout),
            ("hccl", "all_ranks (50 MB buffers)", None, _small_hccl_buffers(layout, 50)),
        ]
        for backend, label, share, variant in rows:
            creation = "split" if share else "all_ranks"
            estimate = estimate_memory(variant, 0, device_backend=backend, creation=creation,
                                       split_share=share)
            table.add(name, backend, label, estimate.device_communicators,
                      round(estimate.low_mb), round(estimate.high_mb))
        progress.advance()
    table.notes += [
        "NCCL: 544-688 MB per communicator (nccl#964, 4xA100), 512 MiB single-rank (nccl#2363); "
        "split_share=1 children share the parent's resources; the parent (default group) "
        "communicator is counted once",
        f"HCCL: hccl_buffer_size per communicator (default 200 MB); {CHECKPOINT_ROLE} is gloo: 0",
    ]
    return table, summary
