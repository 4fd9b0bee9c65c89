"""Run every scenario of a :class:`~commgroups.bench.config.BenchConfig` and collect the tables.

Real gloo worlds are started once per world size and run every section that needs that size (a world
costs seconds to start on 2 cores); a rank-loss world ends with its kill, so each kill-to-rebuilt
sample gets a fresh one (:mod:`~commgroups.bench.rank_loss`); fake worlds run one process per
simulated size; planning and memory run in this process.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from commgroups.bench import (
    async_wait_cost,
    audit_cost,
    checkpoint,
    control_plane,
    creation,
    flight_cost,
    memory,
    planning,
    rank_loss,
    rebuild,
)
from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import NullProgress, Progress
from commgroups.bench.stats import Table
from commgroups.bench.world import run_world
from commgroups.layout.specs import Layout
from commgroups.registry import GroupRegistry

__all__ = ["BenchResult", "Scenario", "expected_units", "gloo_job", "machine_info", "run_bench"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class Scenario(Protocol):
    """A scenario run after the built-in ones, e.g. the repository's torchtitan measurements
    (``benchmarks/run.py``), which need more than the package ships."""

    def units(self, config: BenchConfig) -> int:
        """Progress units :meth:`run` reports for ``config``."""

    def run(self, config: BenchConfig, progress: Progress,
            directory: str) -> tuple[list[Table], dict[str, Any]]:
        """Measure; returns its tables and its summary figures."""


@dataclass
class BenchResult:
    """Every table of one run, the headline figures and the machine it ran on."""

    config: BenchConfig
    machine: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def table(self, name: str) -> Table:
        """The table called ``name``."""
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no table {name!r}; tables: {', '.join(t.name for t in self.tables)}")

    def to_dict(self) -> dict[str, Any]:
        """What ``--json`` writes: every table, the summary and the headline figures on top (the
        two ratios, ``kill_to_rebuilt_s``: world size -> median seconds from a SIGKILL to the
        slowest survivor rebuilt, no ``alive=``, and the control plane's
        ``control_plane_check_in_s`` and ``control_plane_requests_per_rank_s``: simulated ranks ->
        report to decided, idle store requests per rank per second)."""
        return {
            "schema": SCHEMA_VERSION,
            "config": asdict(self.config),
            "machine": self.machine,
            "duration_s": round(self.duration_s, 2),
            "async_and_wait_overhead_ratio": self.summary.get("async_and_wait_overhead_ratio"),
            "creation_ratio_vs_devicemesh": self.summary.get("creation_ratio_vs_devicemesh"),
            "kill_to_rebuilt_s": self.summary.get("kill_to_rebuilt_s"),
            "control_plane_check_in_s": self.summary.get("control_plane_check_in_s"),
            "control_plane_requests_per_rank_s": self.summary.get(
                "control_plane_requests_per_rank_s"),
            "summary": self.summary,
            "tables": {table.name: table.to_dict() for table in self.tables},
        }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, load, torch and Python versions: the numbers mean nothing without them."""
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        nproc = os.cpu_count() or 1
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "nproc": nproc,
        "cpu_model": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in load],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def gloo_job(rank: int, world_size: int, progress: Progress, config: BenchConfig,
             sections: tuple[str, ...], directory: str) -> dict[str, Any] | None:
    """Every gloo section for one world, on every rank; rank 0 returns the measurements."""
    out: dict[str, Any] = {}
    if "async_and_wait" in sections:
        out["async_and_wait"] = async_wait_cost.measure(rank, world_size, progress, config)
    if "audit" in sections:
        out["audit"] = audit_cost.measure(rank, world_size, progress, config)
    if "flight" in sections:
        out["flight"] = flight_cost.measure(rank, world_size, progress, config)
    if "dcp" in sections or "exchange" in sections:
        with GroupRegistry(Layout(dims={"cp": world_size})) as registry:
            if "exchange" in sections:
                out["exchange"] = checkpoint.measure_exchange(rank, world_size, progress, config,
                                                              registry)
            if "dcp" in sections:
                out["dcp"] = checkpoint.measure_dcp(rank, world_size, progress, config, registry,
                                                    directory)
    return out if rank == 0 else None


def expected_units(config: BenchConfig, scenarios: Sequence[Scenario] = ()) -> int:
    """How many progress units a run of ``config`` reports (the bar's total, known up front)."""
    per_gloo_world = config.creation_repetitions + len(config.metadata_items)
    first_world = (len(config.async_and_wait_ops) * len(config.async_and_wait_sizes)
                   + config.dcp_repetitions + len(audit_cost.WORKLOADS) + 1)  # + flight
    extra_units = sum(scenario.units(config) for scenario in scenarios)
    first_creation = len(creation.FIRST_VARIANTS) * config.first_creation_repetitions
    return (extra_units + rank_loss.units(config) + len(config.control_plane_sizes)
            + len(config.plan_worlds) * config.plan_repetitions + len(memory.layouts())
            + len(config.fake_worlds) * config.fake_repetitions + config.rebuild_repetitions
            + len(config.gloo_worlds) * (per_gloo_world + first_creation) + first_world)


class _Planned:
    """Forwards progress but announces the whole run's total once, up front, so the bar's
    percentage and remaining time mean something from the start."""

    def __init__(self, inner: Progress, total: int) -> None:
        self._inner = inner
        inner.add_total(total)

    def add_total(self, units: int) -> None:
        """Already counted in the total announced up front."""

    def advance(self, units: int = 1) -> None:
        """Forward."""
        self._inner.advance(units)

    def describe(self, text: str) -> None:
        """Forward."""
        self._inner.describe(text)


def run_bench(config: BenchConfig, progress: Progress | None = None,
              scenarios: Sequence[Scenario] = ()) -> BenchResult:
    """Run every scenario, then ``scenarios``; returns the tables and the summary (headline ratios
    included)."""
    bar: Progress = _Planned(progress if progress is not None else NullProgress(),
                             expected_units(config, scenarios))
    result = BenchResult(config=config, machine=machine_info())
    started = time.perf_counter()

    planning_table, planning_summary = planning.run(config, bar)
    memory_table, memory_summary = memory.run(bar)

    creation_results: list[dict[str, Any]] = []
    for world in config.fake_worlds:
        creation_results.append(run_world(creation.measure_fake, world, config.fake_repetitions,
                                          backend="fake", timeout_s=config.timeout_s,
                                          progress=bar)[0])
    rebuild_results = [run_world(rebuild.measure_fake, max(config.fake_worlds),
                                 config.rebuild_repetitions, backend="fake",
                                 timeout_s=config.timeout_s, progress=bar)[0]]
    gloo: dict[int, dict[str, Any]] = {}
    first_results: list[dict[str, Any]] = []
    smallest = min(config.gloo_worlds)
    with tempfile.TemporaryDirectory(prefix="commgroups-bench-") as directory:
        for world in config.gloo_worlds:
            created = creation.steady_worlds(world, config.creation_repetitions,
                                             config.timeout_s, bar)
            sections: tuple[str, ...] = ("exchange",)
            if world == smallest:
                sections += ("async_and_wait", "audit", "flight", "dcp")
            logger.info("gloo world of %d: %s", world, ", ".join(sections))
            gloo[world] = run_world(gloo_job, world, config, sections, directory,
                                    timeout_s=config.timeout_s, progress=bar)[0]
            gloo[world]["creation"] = created
            first_results += creation.first_worlds(world, config.first_creation_repetitions,
                                                   config.timeout_s, bar)
        # A kill ends its world (the victim's process is gone): one fresh world per sample.
        rank_loss_tables, rank_loss_summary, ratio_results = rank_loss.run(config, bar)
        control_tables, control_summary = control_plane.run(
            config.control_plane_sizes, config.control_plane_idle_s, bar,
            idle_max=config.control_plane_idle_ranks)
        extras = [scenario.run(config, bar, directory) for scenario in scenarios]
    creation_results += [gloo[w]["creation"] for w in config.gloo_worlds]

    creation_table, creation_summary = creation.tables(creation_results)
    first_table, first_summary = creation.first_tables(first_results)
    rebuild_table, rebuild_summary = rebuild.tables(
        ratio_results + rebuild_results)
    async_and_wait_table, async_and_wait_summary = async_wait_cost.tables(gloo[smallest]["async_and_wait"])
    audit_table, audit_summary = audit_cost.tables(gloo[smallest]["audit"])
    flight_table, flight_summary = flight_cost.tables(gloo[smallest]["flight"])
    checkpoint_tables, checkpoint_summary = checkpoint.tables(
        [gloo[smallest]["dcp"]], [gloo[w]["exchange"] for w in config.gloo_worlds]
    )
    result.tables = [creation_table, first_table, *rank_loss_tables, rebuild_table, planning_table,
                     async_and_wait_table, audit_table, flight_table, *checkpoint_tables,
                     memory_table, *control_tables,
                     *(table for tables, _ in extras for table in tables)]
    for part in (creation_summary, first_summary, rank_loss_summary, rebuild_summary, planning_summary,
                 async_and_wait_summary, audit_summary, flight_summary, checkpoint_summary,
                 memory_summary, control_summary, *(summary for _, summary in extras)):
        result.summary.update(part)
    result.duration_s = time.perf_counter() - started
    return result
