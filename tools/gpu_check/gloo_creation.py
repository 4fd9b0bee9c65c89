"""Collect: creation on 4 and 8 real gloo ranks against DeviceMesh, on the GPU machine's CPU cores.

On the 2-core machines where ``commgroups bench`` runs, 8 gloo ranks share 2 cores and creation is
CPU-bound: each millisecond of a rank's CPU is about four of the job's wall time, so the registry's
world-spanning fsdp group (DeviceMesh's flattened fsdp is the default group) and its safety parts
(the agreement, the socket ledger, the heartbeat and the flight recorder's start) weigh four times
over (benchmarks/README.md, the creation floor). The GPU machine has a core for each rank: this
part runs the bench's own creation scenarios there (``commgroups.bench.creation``: every variant
once in each fresh world, counterbalanced; and each variant the first creation in a fresh world,
alternating), so the ratio is measured where creation is not CPU-bound. No GPU is used.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["WORLDS", "collect_gloo_creation"]

WORLDS: tuple[int, ...] = (4, 8)


def collect_gloo_creation(smoke: bool) -> dict[str, Any]:
    """Both creation tables, as JSON-ready dicts, and the registry's ratios to DeviceMesh."""
    from commgroups.bench import creation

    worlds = WORLDS[:1] if smoke else WORLDS
    steady_worlds, first_pairs = (1, 1) if smoke else (10, 6)
    steady = [creation.steady_worlds(world, steady_worlds, 120.0) for world in worlds]
    first = [sample for world in worlds
             for sample in creation.first_worlds(world, first_pairs, 120.0)]
    steady_table, steady_summary = creation.tables(steady)
    first_table, first_summary = creation.first_tables(first)
    ratios = {}
    for world in worlds:
        ratios[str(world)] = {
            "steady": steady_summary[f"creation_ratio_vs_devicemesh_gloo{world}"],
            "steady_vs_devicemesh_own_fsdp":
                steady_summary[f"creation_ratio_vs_devicemesh_own_fsdp_gloo{world}"],
            "first": first_summary[f"creation_first_ratio_vs_devicemesh_gloo{world}"],
        }
    return {"nproc": os.cpu_count(), "worlds": list(worlds), "steady_worlds": steady_worlds,
            "first_pairs": first_pairs, "ratios": ratios, "steady": steady_table.to_dict(),
            "first": first_table.to_dict()}
