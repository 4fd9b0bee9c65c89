"""One launched world, four trainings: the checks of the torchtitan tests share it.

On every rank, in order (each a fresh trainer; stock torchtitan and commgroups differ only in
``--module``):

1. ``registry``: through commgroups from scratch (first, so nothing stock exists in the process yet
   when its default-group count is taken);
2. ``stock``: stock torchtitan from scratch, same seed;
3. ``registry_resume``: through commgroups, resuming from stock's first checkpoint (a stock
   checkpoint loads through commgroups; resume equals the uninterrupted run), under
   ``COMMGROUPS_AUDIT_DIR`` (the audit switch: every rank writes its file; nothing on the default
   group, no error);
4. ``stock_resume``: stock, resuming from commgroups' first checkpoint.

The first checkpoint is the one at step ``checkpoint_interval`` (:func:`resume_step`). Rank 0 copies
it into the resume runs' folders between 2 and 3 (torchtitan's fault-tolerance resume: the folder
holds ``step-N``); ranks meet through the store, not a collective.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests import torch_private
from tests.titan.run import TitanRun, train_rank

__all__ = ["RUN_NAMES", "resume_step", "scenario_rank"]

RUN_NAMES = ("registry", "stock", "registry_resume", "stock_resume")


def _store_barrier(name: str, rank: int, world_size: int) -> None:
    from commgroups.creation.agreement import store_barrier

    store = torch_private.default_store()
    store_barrier(store, f"tests/titan/{name}", rank, world_size, timedelta(seconds=300), name)


def resume_step(base: TitanRun) -> int:
    """The step the resumed runs start after: the first checkpoint's."""
    assert 0 < base.checkpoint_interval < base.steps, "a scenario resumes before its last step"
    return base.checkpoint_interval


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
            step = f"step-{resume_step(base)}"
            if rank == 0:
                for src, dst in (("stock", "registry_resume"), ("registry", "stock_resume")):
                    shutil.copytree(root / src / "checkpoint" / step,
                                    root / dst / "checkpoint" / step)
            _store_barrier(f"copied{root}", rank, world_size)
        started = time.monotonic()
        results[name] = train_rank(rank, world_size, post, runs[name])
        results[name].notes["seconds"] = time.monotonic() - started
    return results
