"""The spawned torchtitan worlds of one test session: each trains once, only what the tests need.

Starting a world (forking ranks, importing torchtitan, the first training's warm-up: about 30 s of
a 4-rank world on 2 cores) is the expensive part on CPU, so the matrix and the scenario tests
share worlds: a :class:`Job` (an entry under one spmd backend) belongs to the world of its
entry's size, and the first test that asks for a world's results trains, in one spawn, every job
of that size that the session's selected tests ask for (``-k`` and ``-m`` included), whatever its
spmd backend; the other tests read the same results.
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
from tests.titan.scenario import RUN_NAMES

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
        self._done: dict[int, dict[str, Any]] = {}

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
        size = job.entry.world_size
        if size not in self._done:
            self._done[size] = self._run(size, job)
        done = self._done[size]
        assert "error" not in done, f"world of {size} ranks failed:\n{done['error']}"
        return JobRuns(done["jobs"][job.id], done["root"] / job.entry.name / job.backend,
                       done["seconds"], done["names"])

    def _run(self, world_size: int, asked: Job) -> dict[str, Any]:
        jobs = tuple(sorted({asked} | {j for j in self._needed if j.entry.world_size == world_size},
                            key=lambda j: j.id))
        root = self._tmp.mktemp(f"titan-world{world_size}")
        assets = self._assets_dir()
        started = time.monotonic()
        # Each training takes 10-40 s on 2 cores: the deadline grows with the world's jobs.
        trainings = sum(len(RUN_NAMES) if job.entry.scenario else 2 for job in jobs)
        reports = run_local_world(world_rank, world_size, jobs, str(root), str(assets),
                                  timeout_s=600 + 120 * trainings, preload=PRELOAD)
        seconds = time.monotonic() - started
        names = tuple(job.id for job in jobs)
        print(f"\n[world of {world_size} ranks ({', '.join(names)}) took {seconds:.0f}s]")
        failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
        missing = sorted(set(range(world_size)) - set(reports))
        if failed or missing:
            return {"error": "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
                    or f"ranks missing: {missing}"}
        by_job = {job.id: {run: [reports[r].value[job.id][run] for r in range(world_size)]
                           for run in reports[0].value[job.id]} for job in jobs}
        return {"jobs": by_job, "root": root, "seconds": seconds, "names": names}
