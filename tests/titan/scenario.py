"""One launched world, four trainings: the checks of the torchtitan tests share it.

On every rank, in order (each a fresh trainer; stock torchtitan and commgroups differ only in
``--module``):

1. ``registry``: through commgroups from scratch (first, so nothing stock exists in the process yet
   when its default-group count is taken);
2. ``stock``: stock torchtitan from scratch, same seed;
3. ``registry_resume``: through commgroups, resuming from stock's step-2 checkpoint (a stock
   checkpoint loads through commgroups; resume equals the uninterrupted run), under
   ``COMMGROUPS_AUDIT_DIR`` (the audit switch: every rank writes its file; nothing on the default
   group, no error);
4. ``stock_resume``: stock, resuming from commgroups' step-2 checkpoint.

Rank 0 copies the step-2 checkpoints into the resume runs' folders between 2 and 3 (torchtitan's
fault-tolerance resume: the folder holds ``step-2``); ranks meet through the store, not a collective.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.titan.run import TitanRun, train_rank

__all__ = ["RUN_NAMES", "pair_rank", "scenario_rank"]

RUN_NAMES = ("registry", "stock", "registry_resume", "stock_resume")


def _store_barrier(name: str, rank: int, world_size: int) -> None:
    from commgroups.agreement import store_barrier

    store = dist.distributed_c10d._get_default_store()
    store_barrier(store, f"tests/titan/{name}", rank, world_size, timedelta(seconds=300), name)


def scenario_rank(rank: int, world_size: int, post: Any, base: TitanRun) -> dict[str, Any]:
    """Run the four trainings on this rank; returns name -> RankResult (plus seconds taken)."""
    root = Path(base.dump_folder)
    runs = {
        name: dataclasses.replace(base, dump_folder=str(root / name),
                                  registry=name.startswith("registry"),
                                  audit=name == "registry_resume")
        for name in RUN_NAMES
    }
    results: dict[str, Any] = {}
    for name in RUN_NAMES:
        if name == "registry_resume":
            if rank == 0:
                for src, dst in (("stock", "registry_resume"), ("registry", "stock_resume")):
                    shutil.copytree(root / src / "checkpoint" / "step-2",
                                    root / dst / "checkpoint" / "step-2")
            _store_barrier("copied", rank, world_size)
        started = time.monotonic()
        results[name] = train_rank(rank, world_size, post, runs[name])
        results[name].notes["seconds"] = time.monotonic() - started
    return results


def pair_rank(rank: int, world_size: int, post: Any, base: TitanRun) -> dict[str, Any]:
    """Only the first two trainings (commgroups, then stock), without checkpoints."""
    root = Path(base.dump_folder)
    results: dict[str, Any] = {}
    for name in RUN_NAMES[:2]:
        run = dataclasses.replace(base, dump_folder=str(root / name), registry=name == "registry")
        started = time.monotonic()
        results[name] = train_rank(rank, world_size, post, run)
        results[name].notes["seconds"] = time.monotonic() - started
    return results
