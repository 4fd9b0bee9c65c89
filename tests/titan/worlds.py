"""The spawned torchtitan worlds of one test session: each trains once, only what the tests need.

Starting a world (forking ranks, importing torchtitan, the first training's warm-up) is the
expensive part on CPU, so the matrix and the scenario tests share worlds: a :class:`Job` (an entry
under one spmd backend) belongs to the world its entry names, and the first test that asks for a
world's results trains, in one spawn, every job of that world and backend that the session's
selected tests ask for (``-k`` and ``-m`` included); the other tests read the same results.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from commgroups.util.local_world import run_local_world
from tests.titan.matrix import Job, world_rank
from tests.titan.run import RankResult

__all__ = ["TORCH", "JobRuns", "TitanWorlds", "jobs_of"]

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
"""(major, minor) of the running torch."""

# Preloaded by the forkserver the ranks fork from: torchtitan and its CPU patches are imported
# once per session instead of once per rank and world.
PRELOAD = ("torch", "torch.distributed", "commgroups", "tests.titan.preload")


@dataclass(frozen=True)
class JobRuns:
    """What every rank reported for one job: run name -> per-rank results."""

    runs: dict[str, list[RankResult]]
    folder: Path
    """The job's dump folder (``<run name>/checkpoint/step-N`` below it)."""
    world_seconds: float
    """How long the whole world took (it trained every job listed in ``world_jobs``)."""
    world_jobs: tuple[str, ...]


def jobs_of(items: Iterable[pytest.Item]) -> set[Job]:
    """The jobs the collected (selected) tests ask for through their parameters."""
    jobs: set[Job] = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            jobs |= {value for value in callspec.params.values() if isinstance(value, Job)}
    return jobs


class TitanWorlds:
    """Runs each (world, backend) once, on first use, with every needed job of it."""

    def __init__(self, needed: Iterable[Job], tmp: pytest.TempPathFactory) -> None:
        self._needed = {job for job in needed if job.skip_reason(TORCH) is None}
        self._tmp = tmp
        self._assets: Path | None = None
        self._done: dict[tuple[str, str], dict[str, Any]] = {}

    def _assets_dir(self) -> Path:
        if self._assets is None:
            from tests.titan.assets import make_assets

            self._assets = self._tmp.mktemp("titan-assets")
            make_assets(self._assets)
        return self._assets

    def runs(self, job: Job) -> JobRuns:
        """The results of ``job``; the first call for its world trains that world."""
        reason = job.skip_reason(TORCH)
        if reason is not None:
            pytest.skip(reason)
        key = (job.entry.world, job.backend)
        if key not in self._done:
            self._done[key] = self._run(key, job)
        done = self._done[key]
        assert "error" not in done, f"world {key} failed:\n{done['error']}"
        return JobRuns(done["jobs"][job.entry.name], done["root"] / job.entry.name / job.backend,
                       done["seconds"], done["names"])

    def _run(self, key: tuple[str, str], asked: Job) -> dict[str, Any]:
        world, backend = key
        jobs = sorted({asked} | {j for j in self._needed if (j.entry.world, j.backend) == key},
                      key=lambda j: j.entry.name)
        entries = tuple(job.entry for job in jobs)
        sizes = {e.world_size for e in entries}
        assert len(sizes) == 1, f"world {world}: entries need {sizes} ranks"
        world_size = sizes.pop()
        root = self._tmp.mktemp(f"titan-{world}-{backend}")
        assets = self._assets_dir()
        started = time.monotonic()
        reports = run_local_world(world_rank, world_size, entries, str(root), str(assets), backend,
                                  timeout_s=3000, preload=PRELOAD)
        seconds = time.monotonic() - started
        names = tuple(e.name for e in entries)
        print(f"\n[world {world} ({backend}, {world_size} ranks: {', '.join(names)}) took "
              f"{seconds:.0f}s]")
        failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
        missing = sorted(set(range(world_size)) - set(reports))
        if failed or missing:
            return {"error": "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
                    or f"ranks missing: {missing}"}
        by_job = {e.name: {run: [reports[r].value[e.name][run] for r in range(world_size)]
                           for run in reports[0].value[e.name]} for e in entries}
        return {"jobs": by_job, "root": root, "seconds": seconds, "names": names}
