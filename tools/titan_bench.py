"""torchtitan through commgroups vs stock torchtitan: step time, communicators, mesh building.

Repository tooling, not part of the package: ``benchmarks/run.py`` adds this scenario to
``commgroups bench`` when regenerating the committed results. torchtitan targets accelerators; on
CPU it needs the process-local patches and assets of the test tree (``tests/titan``), which the
package does not ship. Skipped, with a note, when torchtitan is not installed.

Three measurements:

- step time and start-up: torchtitan's llama3 debug model, cp=4 on a 4-rank gloo world
  (spmd_types on torch >= 2.14, else partial_dtensor), through commgroups (flight recorder on, as
  by default; off; audit on) and stock, interleaved trainings after one uncounted warm-up
  training, each starting on every rank at once (a barrier, as a launcher starts its ranks); per
  training the median step time (step 1, the warm-up, left out), and its start-up: building the
  trainer (``config.build()``: distributed init, the registry, meshes, model, parallelization)
  plus step 1. Ratios and differences are per repetition, against the stock
  training of the same repetition.
- communicators per rank and mesh building: one process plays rank 0 of a fake 65,536-rank world
  (pp=8 x dp_shard=512 x cp=4 x tp=4, and one with ep=8 over dp_replicate=2): stock
  ``ParallelDims.build_mesh()`` vs ``GroupRegistry(...).create()`` + ``RegistryParallelDims
  .build_mesh()``; creation calls this rank makes; communicators a real job would open on this rank
  (groups of more than one rank on a real backend) and meshes that alias the default group.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from commgroups import torch_internals
from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.bench.world import run_world
from commgroups.errors import MeshRequestError
from commgroups.torch_internals.version import torch_version

__all__ = ["FAKE_LAYOUTS", "TitanConfig", "TitanScenario", "available", "measure_meshes",
           "measure_steps", "tables", "titan_config"]

FAKE_LAYOUTS: dict[str, tuple[int, int, int, int, int, int]] = {
    # name: (pp, dp_replicate, dp_shard, cp, tp, ep); 65,536 ranks each
    "dense pp8 dp512 cp4 tp4": (8, 1, 512, 4, 4, 1),
    "moe pp8 dr2 dp256 cp4 tp4 ep8": (8, 2, 256, 4, 4, 8),
}
VARIANTS = ("commgroups", "commgroups-no-flight", "commgroups+audit", "stock")
"""Trainings per repetition: through commgroups (its flight recorder on, the default), the same
with the recorder off (``COMMGROUPS_FLIGHT_RECORDER=0``), the same with the audit switched on
(``COMMGROUPS_AUDIT_DIR``), and stock."""
MESH_VARIANTS = ("commgroups", "stock")
"""Mesh building at fake scale: the registry against stock ``ParallelDims.build_mesh``."""


@dataclass(frozen=True)
class TitanConfig:
    """How much torchtitan to run, per ``commgroups bench`` size (:func:`titan_config`)."""

    repetitions: int
    """Interleaved pairs of torchtitan trainings (commgroups, stock); 0 leaves torchtitan out."""
    steps: int = 6
    fake_world: int = 65536
    fake_repetitions: int = 3


def titan_config(name: str) -> TitanConfig:
    """The torchtitan sizes that go with the ``commgroups bench`` configuration called ``name``."""
    if name == "full":
        return TitanConfig(repetitions=5, steps=8, fake_repetitions=5)
    if name == "quick":
        return TitanConfig(repetitions=2, steps=5, fake_repetitions=2)
    return TitanConfig(repetitions=0)


def available() -> str | None:
    """None when the scenario can run here, else why not."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install 'commgroups[torchtitan]')"
    return None


def _spmd_backend() -> str:
    return "spmd_types" if torch_version() >= (2, 14, 0) else "partial_dtensor"


# ------------------------------------------------------------------------------------- step time
def measure_steps(rank: int, world_size: int, progress: Progress, config: TitanConfig,
                  directory: str) -> dict[str, Any] | None:
    """Interleaved trainings on this gloo world; rank 0 returns step times per variant."""
    from commgroups.creation.agreement import store_barrier
    from tests.titan.assets import make_assets
    from tests.titan.run import TitanRun, train_rank

    assets = f"{directory}/assets"
    if rank == 0:
        make_assets(Path(assets))
    store = torch_internals.default_store()
    store_barrier(store, "bench/titan/assets", rank, world_size, timedelta(seconds=300), "assets")
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    builds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    first_steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    progress.describe("torchtitan step time")
    # The world's first training pays for everything done once per process (imports, torch's
    # compile and dispatch caches: 30 s and more of its step 1 on 2 cores), whichever variant
    # it is: a two-step stock training, not counted, takes that cost out of the comparison.
    train_rank(rank, world_size, None, TitanRun(
        dump_folder=f"{directory}/titan-warm-up", assets=assets, cp=world_size,
        spmd_backend=_spmd_backend(), steps=2, checkpoint_interval=0))
    for repetition in range(config.repetitions):
        for variant in interleaved(VARIANTS, repetition):
            run = TitanRun(dump_folder=f"{directory}/titan-{variant}-{repetition}", assets=assets,
                           registry=variant != "stock", cp=world_size,
                           spmd_backend=_spmd_backend(), steps=config.steps,
                           checkpoint_interval=0, step_times=True, aligned_start=True,
                           audit=variant == "commgroups+audit",
                           flight_recorder=variant != "commgroups-no-flight")
            # torchtitan turns automatic collection off while it trains and runs a full one
            # while building the next trainer: whichever variant comes next would pay for the
            # previous training's garbage (0.4 s after a stock training; a closed registry
            # collects its own). Each training starts from a collected heap instead.
            gc.collect()
            result = train_rank(rank, world_size, None, run)
            times = result.notes["step_seconds"]
            steps[variant].append(float(summarize(times[1:]).median))  # step 1 warms caches
            builds[variant].append(float(result.notes["build_seconds"]))
            first_steps[variant].append(float(times[0]))
        progress.advance()
    if rank != 0:
        return None
    return {"steps": steps, "build": builds, "first_step": first_steps,
            "backend": _spmd_backend(), "world": world_size}


# ------------------------------------------------------------------------ meshes at fake scale
@contextmanager
def _noting_new_groups() -> Iterator[list[tuple[Any, Any]]]:
    """Every ``new_group`` call this process makes in the block: (backend asked for, group).

    device_mesh and commgroups hold their own reference to ``new_group``: every loaded module
    attribute that is the original is swapped for the noting wrapper and restored afterwards.
    """
    calls: list[tuple[Any, Any]] = []
    original = dist.distributed_c10d.new_group

    def noting(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        calls.append((kwargs.get("backend"), group))
        return group

    patched = [module for name, module in list(sys.modules.items())
               if module is not None and name.startswith(("torch.distributed", "commgroups"))
               and getattr(module, "new_group", None) is original]
    for module in patched:
        setattr(module, "new_group", noting)  # noqa: B010  (a module attribute, not a field)
    try:
        yield calls
    finally:
        for module in patched:
            setattr(module, "new_group", original)  # noqa: B010


def _communicators(calls: list[tuple[Any, Any]], gloo_groups: tuple[Any, ...] = ()) -> tuple[int, int]:
    """(device, gloo) communicators this rank opens: member groups of > 1 rank, not fake."""
    device = gloo = 0
    for backend, group in calls:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        if len(dist.get_process_group_ranks(group)) < 2:
            continue
        if any(group is g for g in gloo_groups) or backend == "gloo":
            gloo += 1
        elif backend != "fake":
            device += 1
    return device, gloo


def measure_meshes(rank: int, world_size: int, progress: Progress,
                   config: TitanConfig) -> dict[str, Any]:
    """Rank 0 of a fake world: stock build_mesh vs registry meshes, per layout, interleaved."""
    fake_store = torch_internals.import_fake_backend()  # registers backend "fake"
    from tests.titan.cpu import apply_cpu_patches

    apply_cpu_patches()  # torchtitan picks its device type when imported
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import ParallelDims, single_axis_meshes
    from commgroups.layout.specs import CHECKPOINT_ROLE
    from commgroups.registry import GroupRegistry

    backend = _spmd_backend()
    out: dict[str, Any] = {}
    progress.describe(f"torchtitan meshes, fake x{world_size}")
    for name, (pp, dr, ds, cp, tp, ep) in FAKE_LAYOUTS.items():
        degrees = TitanDegrees(pp=pp, dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp, ep=ep,
                               spmd_backend=backend)
        layout = titan_layout(degrees)
        samples: dict[str, list[float]] = {v: [] for v in MESH_VARIANTS}
        facts: dict[str, dict[str, Any]] = {}
        for repetition in range(config.fake_repetitions):
            for variant in interleaved(MESH_VARIANTS, repetition):
                dist.init_process_group("fake", store=fake_store(), rank=rank,
                                        world_size=world_size)
                default = torch_internals.default_group()
                registry = None
                try:
                    with _noting_new_groups() as calls:
                        started = time.perf_counter()
                        if variant == "stock":
                            pd: Any = ParallelDims(dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp,
                                                   pp=pp, ep=ep, world_size=world_size,
                                                   spmd_backend=backend)
                        else:
                            registry = GroupRegistry(layout).create()
                            pd = RegistryParallelDims(dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp,
                                                      pp=pp, ep=ep, world_size=world_size,
                                                      spmd_backend=backend, registry=registry)
                        pd.build_mesh()
                        samples[variant].append(time.perf_counter() - started)
                    if registry is not None:
                        # Under a fake world the registry makes fake groups; a real job opens the
                        # device backend for every role but the gloo checkpoint one.
                        calls = [(None, g) for _, g in calls]
                        gloo_groups: tuple[Any, ...] = (registry.group(CHECKPOINT_ROLE),)
                    else:
                        gloo_groups = ()
                    device, gloo = _communicators(calls, gloo_groups)
                    aliases = 0
                    for one in single_axis_meshes(pd).values():
                        try:
                            group = one.get_group()
                        except (RuntimeError, IndexError, AttributeError, AssertionError,
                                MeshRequestError):  # commgroups' placeholder (ep == 1)
                            continue
                        aliases += int(group is default and one.size() > 1)
                    facts[variant] = {"calls": len(calls), "device": device, "gloo": gloo,
                                      "aliases": aliases}
                finally:
                    if registry is not None:
                        registry.close()
                    dist.destroy_process_group()
            progress.advance()
        out[name] = {"samples": samples, "facts": facts}
    return out


# ------------------------------------------------------------------------------------- report
def tables(steps: dict[str, Any] | None, meshes: dict[str, Any] | None, world: int,
           reason: str | None = None) -> tuple[list[Table], dict[str, Any]]:
    """The torchtitan tables and summary figures."""
    step_table = Table("torchtitan_steps", "torchtitan step time: through commgroups vs stock",
                       ["model", "world", "spmd backend", "variant", "step s",
                        "ratio vs stock"])
    startup_table = Table(
        "torchtitan_startup", "torchtitan start-up: building the trainer, then step 1",
        ["model", "world", "spmd backend", "variant", "build s", "step 1 s", "start-up s",
         "start-up minus stock s"])
    mesh_table = Table(
        "torchtitan_meshes",
        f"torchtitan meshes at {world:,} fake ranks: registry vs stock ParallelDims.build_mesh",
        ["layout", "variant", "time ms", "creation calls / rank", "device communicators / rank",
         "gloo communicators / rank", "meshes on the default group", "ratio vs stock"])
    summary: dict[str, Any] = {}
    if reason is not None:
        for table in (step_table, startup_table, mesh_table):
            table.notes.append(f"not run: {reason}")
        return [step_table, startup_table, mesh_table], summary
    if steps is not None:
        summary.update(_step_rows(steps, step_table, startup_table))
    if meshes is not None:
        for name, measured in meshes.items():
            base = measured["samples"]["stock"]
            for variant in MESH_VARIANTS:
                times = measured["samples"][variant]
                facts = measured["facts"][variant]
                mesh_table.add(name, variant, summarize(times).scaled(1e3), facts["calls"],
                               facts["device"], facts["gloo"], facts["aliases"],
                               summarize(paired_ratios(times, base)))
            if name == next(iter(meshes)):
                ratio = summarize(paired_ratios(measured["samples"]["commgroups"], base))
                summary["torchtitan_mesh_ratio_vs_stock"] = ratio.median
        mesh_table.notes += [
            "commgroups = GroupRegistry(titan_layout).create() + RegistryParallelDims.build_mesh(); "
            "stock = ParallelDims.build_mesh() (init_device_mesh + _unflatten, fake backend for "
            "size-1 dims); floor: ratio <= 1.0",
            "communicators: groups of > 1 rank this rank would open on a real job (stock's world "
            "mesh is the default group: counted under 'meshes on the default group', not as new)",
        ]
    return [step_table, startup_table, mesh_table], summary


def _step_rows(steps: dict[str, Any], step_table: Table, startup_table: Table) -> dict[str, Any]:
    """Fill the step and start-up tables from :func:`measure_steps`; the summary figures."""
    model = ("llama3 debug cp=4", steps["world"], steps["backend"])
    step_times = steps["steps"]
    base = step_times["stock"]
    startups = {v: [b + f for b, f in zip(steps["build"][v], steps["first_step"][v])]
                for v in VARIANTS}
    for variant in VARIANTS:
        step_table.add(*model, variant, summarize(step_times[variant]),
                       summarize(paired_ratios(step_times[variant], base)))
        delta = [a - b for a, b in zip(startups[variant], startups["stock"])]
        startup_table.add(*model, variant, summarize(steps["build"][variant]),
                          summarize(steps["first_step"][variant]), summarize(startups[variant]),
                          summarize(delta))
    summary: dict[str, Any] = {}
    for key, numerators, denominators in (
            ("torchtitan_step_ratio", "commgroups", "stock"),
            ("torchtitan_flight_recorder_step_ratio", "commgroups", "commgroups-no-flight"),
            ("torchtitan_audit_step_ratio", "commgroups+audit", "commgroups")):
        ratio = summarize(paired_ratios(step_times[numerators], step_times[denominators]))
        summary[key] = ratio.median
        summary[f"{key}_spread"] = ratio.to_dict()
    startup_delta = summarize([a - b for a, b in zip(startups["commgroups"], startups["stock"])])
    summary["torchtitan_startup_delta_s"] = startup_delta.median
    summary["torchtitan_startup_delta_s_spread"] = startup_delta.to_dict()
    step_table.notes += [
        "step s: per training the median step time (step 1 left out), median [p25-p75] over "
        "trainings; ratio: per interleaved repetition variant / stock (floor: <= 1.02 on CPU; "
        "with the flight recorder on, as commgroups runs by default: within 1% of stock)",
        "commgroups-no-flight: COMMGROUPS_FLIGHT_RECORDER=0; torchtitan_flight_recorder_step_ratio: "
        "per repetition commgroups / commgroups-no-flight",
        "commgroups+audit: the same training with COMMGROUPS_AUDIT_DIR set (every rank records "
        "and writes its file); torchtitan_audit_step_ratio: per repetition commgroups+audit / "
        "commgroups",
    ]
    startup_table.notes += [
        "build s: config.build() on rank 0 (distributed init, registry creation and meshes, the "
        "model, its parallelization); step 1 s: the first step (compiles and warms caches); "
        "start-up = both; minus stock: per repetition (floor: within 1 s of stock)",
    ]
    return summary


class TitanScenario:
    """The torchtitan measurements as an extra scenario of :func:`commgroups.bench.runner.run_bench`."""

    def units(self, config: BenchConfig) -> int:
        """Progress units a run reports (0 when it is left out)."""
        titan = titan_config(config.name)
        if titan.repetitions == 0 or available() is not None:
            return 0
        return titan.repetitions + titan.fake_repetitions * len(FAKE_LAYOUTS)

    def run(self, config: BenchConfig, progress: Progress,
            directory: str) -> tuple[list[Table], dict[str, Any]]:
        """Both measurements (each in its own world) and their tables."""
        titan = titan_config(config.name)
        reason = available()
        if reason is not None or titan.repetitions == 0:
            return tables(None, None, titan.fake_world, reason or "disabled in this configuration")
        meshes = run_world(measure_meshes, titan.fake_world, titan, backend="fake",
                           timeout_s=config.timeout_s, progress=progress)[0]
        steps = run_world(measure_steps, 4, titan, directory, timeout_s=config.timeout_s * 2,
                          progress=progress)[0]
        return tables(steps, meshes, titan.fake_world)
