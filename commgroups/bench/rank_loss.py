"""Rank loss, end to end: one rank SIGKILLed mid-step to every survivor rebuilt, and what N
rebuilds leave behind.

**Kill to rebuilt.** Each repetition is a fresh gloo world (one process per rank) with HSDP
(``dp_replicate x dp_shard=2``, replicas elastic) and every role at a production timeout (600 s).
The ranks create the registry and its HSDP mesh (timed: first creation), each forks a stand-in
for a ``DataLoader`` worker (a child holding every descriptor of its rank, idle, that outlives
the victim: a peer of the victim sees its sockets close only because the child lets go of
them, :func:`~commgroups.creation.sockets.detach_on_fork`), then run steps of
all_reduce on dp_shard, dp_replicate and checkpoint-metadata. The victim (the last rank) writes
its wall-clock time to the store after its dp_shard all_reduce of the kill step and SIGKILLs
itself. Every survivor notes when its collective failed and calls ``registry.rebuild()`` (variant
``rebuild()``: nobody says who died) or ``registry.rebuild(alive=survivors)``. A sample is the
slowest member of the new generation: kill -> rebuilt, split into detection (kill -> its collective
failed) and its rebuild's phases (:data:`~commgroups.rank_loss.rebuild_report.PHASES`); what
neither covers is reported as ``unaccounted``. The victim's replica partner is dropped by the new
layout and returns at once; it is not a member and not counted.

**Resources.** One world: a registry is created, then every rank calls ``rebuild()`` N times
(nobody lost: a new generation each time). File descriptors, OS threads, process groups and store
keys before creation, after it, after the first and the last rebuild and after ``close()`` (the
largest count over ranks), next to one generation's cost (after creation minus before). Off Linux
(no ``/proc``) fds and threads are not counted (None).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.bench.config import BenchConfig
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, summarize
from commgroups.bench.world import WorldFailed, run_world
from commgroups.errors import ArgumentError
from commgroups.generation import STORE_PREFIX
from commgroups.layout.specs import ElasticSpec, Layout, RoleSpec, default_roles
from commgroups.rank_loss.rebuild_report import PHASES
from commgroups.registry import DEFAULT_DEAD_AFTER_S, DEFAULT_HEARTBEAT_S, GroupRegistry

__all__ = ["PRODUCTION_TIMEOUT_S", "VARIANTS", "gather_resources", "measure_kill",
           "measure_resources", "production_layout", "ratio_result", "run", "tables", "units"]

PRODUCTION_TIMEOUT_S = 600.0
"""Every role's ``timeout_s``: a survivor that waited out a collective would take ten minutes."""

VARIANTS: tuple[str, ...] = ("rebuild()", "rebuild(alive=)")
"""How the survivors rebuild: without being told who died, or with ``alive=`` the survivors."""

KILL_STEP = 1
"""The step whose dp_shard all_reduce the victim completes before it dies (one warm step before)."""

_KILLED_AT = "commgroups-bench/killed_at"
_CHILD = "commgroups-bench/child/"
_CHILD_S = 60.0  # the stand-in worker's life at most (the world ends it long before)
_RESULT = "commgroups-bench/result/"
_WAIT = timedelta(seconds=120)  # rank 0 waits this long for every survivor's result
_LAUNCHER = "commgroups/local_world/"  # the local launcher's rendezvous keys, not the registry's
_FDS = Path("/proc/self/fd")
_TASKS = Path("/proc/self/task")


def production_layout(world_size: int, timeout_s: float = PRODUCTION_TIMEOUT_S) -> Layout:
    """HSDP over ``world_size`` ranks (2 a replica, replicas elastic down to one), every built-in
    role timing out after ``timeout_s``."""
    dims = {"dp_replicate": world_size // 2, "dp_shard": 2}
    roles = [RoleSpec(**{**role.model_dump(), "timeout_s": timeout_s})
             for role in default_roles(dims)]
    return Layout(dims=dims, roles=roles, elastic=ElasticSpec(dims={"dp_replicate": 1}))


def _slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _fork_worker() -> int:
    """A stand-in for a ``DataLoader`` worker (``num_workers > 0`` forks on Linux): a child
    that holds every descriptor the fork gave it and idles; returns its pid."""
    pid = os.fork()
    if pid == 0:
        time.sleep(_CHILD_S)
        os._exit(0)
    return pid


def _end_worker(pid: int, own: bool) -> None:
    """End a stand-in worker (``own``: this rank's child, reaped here)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if own:
        os.waitpid(pid, 0)


def _step(registry: GroupRegistry, rank: int, victim: int, step: int) -> None:
    """One step of three roles' collectives; the victim dies inside the kill step."""
    registry.collectives("dp_shard").all_reduce(torch.ones(1 << 12))
    if rank == victim and step == KILL_STEP:
        store = torch_internals.default_store()
        store.set(_KILLED_AT, repr(time.time()))  # acknowledged by the store before the kill
        os.kill(os.getpid(), signal.SIGKILL)
    # Ranks whose replica lacks the victim block here on live peers that left this collective.
    registry.collectives("dp_replicate").all_reduce(torch.ones(1 << 12))
    registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))


def measure_kill(rank: int, world_size: int, progress: Progress, variant: str) -> dict[str, Any]:
    """On every rank of a fresh gloo world: create, train, lose the last rank, rebuild.

    Rank 0 returns the world's sample (see the module docstring); other ranks an empty dict.
    Raises :class:`~commgroups.bench.world.WorldFailed` (on rank 0) when a survivor saw no
    failure, or the new generation lost another rank or sums wrongly.
    """
    if variant not in VARIANTS:
        raise ArgumentError(f"variant: {variant!r} is unknown; fix: use one of {', '.join(VARIANTS)}",
                            field="variant")
    victim = world_size - 1
    survivors = [r for r in range(world_size) if r != victim]
    store = torch_internals.default_store()
    progress.describe(f"kill to rebuilt, gloo x{world_size}, {variant}")
    dist.barrier()
    start = time.perf_counter()
    registry = GroupRegistry(production_layout(world_size), create_timeout_s=60).create()
    registry.device_mesh(["dp_replicate", "fsdp"])
    created = _slowest(time.perf_counter() - start)
    worker = _fork_worker()
    store.set(f"{_CHILD}{rank}", str(worker))
    result: dict[str, Any] = {"rank": rank}
    for step in range(KILL_STEP + 3):
        try:
            _step(registry, rank, victim, step)
        except Exception as error:  # any failure of a step means: rebuild
            failed_at = time.time()
            report = (registry.rebuild() if variant == "rebuild()"
                      else registry.rebuild(alive=survivors))
            rebuilt_at = time.time()
            result.update(place=report.place, failed_at=failed_at, rebuilt_at=rebuilt_at,
                          seconds=report.seconds, error=type(error).__name__,
                          lost=list(report.lost), members=list(report.members))
            if report.place == "member":  # the new generation carries a collective
                total = torch.ones(1)
                registry.collectives("checkpoint-metadata").all_reduce(total)
                result["sum"] = float(total.item())
            break
    registry.close()
    _end_worker(worker, own=True)
    store.set(f"{_RESULT}{rank}", json.dumps(result))
    if rank != 0:
        return {}
    store.wait([f"{_RESULT}{r}" for r in survivors], _WAIT)
    _end_worker(int(bytes(store.get(f"{_CHILD}{victim}")).decode()), own=False)  # an orphan now
    seen = [json.loads(bytes(store.get(f"{_RESULT}{r}")).decode()) for r in survivors]
    killed_at = float(bytes(store.get(_KILLED_AT)).decode())
    progress.advance()
    return _sample(world_size, variant, victim, killed_at, created, seen)


def _sample(world_size: int, variant: str, victim: int, killed_at: float, created: float,
            seen: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest member's kill -> rebuilt and its parts, checked for sense."""
    missed = [s["rank"] for s in seen if "place" not in s]
    if missed:
        raise WorldFailed(f"ranks {missed} saw no failure after rank {victim} was killed")
    members = [s for s in seen if s["place"] == "member"]
    for s in members:
        if s["lost"] != [victim] or s.get("sum") != float(len(members)):
            raise WorldFailed(f"rank {s['rank']}: rebuilt wrongly: lost {s['lost']}, "
                               f"sum {s.get('sum')} on {len(members)} members")
    slowest = max(members, key=lambda s: s["rebuilt_at"])
    total = slowest["rebuilt_at"] - killed_at
    detection = slowest["failed_at"] - killed_at
    phases = {p: float(slowest["seconds"].get(p, 0.0)) for p in PHASES}
    return {
        "world": world_size, "variant": variant, "create": created,
        "kill_to_rebuilt": total, "detection": detection, "phases": phases,
        "unaccounted": total - detection - sum(phases.values()),
        # The ratio table's figure, as before: the slowest member's rebuild from its call.
        "rebuild": max(sum(s["seconds"].values()) for s in members),
        "rebuild_less_release": max(sum(s["seconds"].values()) - s["seconds"].get("release", 0.0)
                                    for s in members),
        "rebuild_phases": {p: max(float(s["seconds"].get(p, 0.0)) for s in members)
                           for p in PHASES},
        "first_detection": min(s["failed_at"] for s in seen) - killed_at,
        "members": len(members), "dropped": len(seen) - len(members),
    }


# ---------------------------------------------------------------------------------- resources
def _store_keys() -> tuple[int, int | None]:
    """Every key in the job's store, and how many of them are the registry's (its namespace,
    less the launcher's keys); None where the store cannot list its keys."""
    store: Any = torch_internals.default_store()
    total = int(store.num_keys())
    for _ in range(8):  # the TCPStore under the default group's PrefixStores lists every key
        if not hasattr(store, "underlying_store"):
            break
        store = store.underlying_store
    try:
        keys = [str(key) for key in store.list_keys()]
    except (AttributeError, RuntimeError):  # older torch, or a store that cannot list
        return total, None
    ours = [k for k in keys if f"{STORE_PREFIX}/" in k and _LAUNCHER not in k]
    return total, len(ours)


def _counts() -> dict[str, int | None]:
    """This process's fds and threads (None off Linux), process groups, the store's keys."""
    names = torch_internals.registered_group_names()
    total, ours = _store_keys()
    return {
        "fds": len(os.listdir(_FDS)) if _FDS.is_dir() else None,
        "threads": len(os.listdir(_TASKS)) if _TASKS.is_dir() else None,
        "process groups": None if names is None else len(names),
        "store keys": total,
        "store keys, commgroups'": ours,
        "store keys, others' (torch's)": None if ours is None else total - ours,
    }


def _settle() -> None:
    """Meet every rank on the default group (a gloo barrier: no store key, unlike a store
    barrier, so the count is the registry's alone), then let the counts settle (the last rank to
    release a generation deletes its shared keys; collected groups' threads exit)."""
    dist.barrier()
    gc.collect()
    time.sleep(0.3)
    dist.barrier()


def measure_resources(rank: int, world_size: int, progress: Progress,
                      cycles: int) -> dict[str, Any]:
    """On every rank: counts before and after one registry and ``cycles`` lone rebuilds; rank 0
    returns every rank's counts by stage (other ranks: their own)."""
    progress.describe(f"resources over {cycles} rebuilds, gloo x{world_size}")
    layout = production_layout(world_size)
    # A first registry, created and closed: torch's lazy set-up and the job's one-time keys
    # (the registry epoch counter, each rank's group-naming history) are paid before counting.
    GroupRegistry(layout, create_timeout_s=60).create().close()
    _settle()
    stages: dict[str, dict[str, int | None]] = {"before create": _counts()}
    registry = GroupRegistry(layout, create_timeout_s=60).create()
    registry.device_mesh(["dp_replicate", "fsdp"])
    _settle()
    stages["after create"] = _counts()
    for cycle in range(cycles):
        report = registry.rebuild()  # every rank: nobody lost, a new generation each time
        if report.lost or report.place != "member":
            raise WorldFailed(f"rank {rank}: a lone rebuild lost {list(report.lost)}")
        dist.barrier(group=registry.group("checkpoint-metadata"))
        # Every rank out of that barrier before any rebuilds again: a rank that left it first
        # would report itself leaving this generation, and a peer still finishing the barrier
        # with it would be interrupted (the default group is no registry group: never severed).
        dist.barrier()
        if cycle in (0, cycles - 1):  # settled where counted only: back to back in between
            _settle()
        if cycle == 0:
            stages["after 1 rebuild"] = _counts()
        progress.advance()
    stages[f"after {cycles} rebuilds"] = _counts()
    registry.close()
    _settle()
    stages["after close"] = _counts()
    del registry, report  # what a closed registry still holds goes with its last reference
    _settle()
    stages["registry dropped"] = _counts()
    return {"world": world_size, "cycles": cycles, "stages": stages}


def gather_resources(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's result with ``ranks``: every rank's stages (from the results of every rank)."""
    return {**results[0], "ranks": [r["stages"] for r in results]}


# ------------------------------------------------------------------------------------ tables
def ratio_result(samples: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The ``rebuild(alive=)`` kill worlds of ``world_size`` in the ratio table's form
    (:func:`commgroups.bench.rebuild.tables`): first creation, rebuild from its call, phases."""
    chosen = [s for s in samples if s["world"] == world_size and s["variant"] == "rebuild(alive=)"]
    out: dict[str, list[float]] = {
        "create": [s["create"] for s in chosen], "rebuild": [s["rebuild"] for s in chosen],
        "rebuild less release": [s["rebuild_less_release"] for s in chosen]}
    for phase in PHASES:
        out[f"phase {phase}"] = [s["rebuild_phases"][phase] for s in chosen]
    return {"world": world_size, "backend": "gloo", "samples": out}


def _kill_table(samples: list[dict[str, Any]]) -> tuple[Table, dict[str, Any]]:
    table = Table(
        "kill_to_rebuilt",
        f"Kill to rebuilt: one rank SIGKILLed mid-step, every role at "
        f"{PRODUCTION_TIMEOUT_S:g} s timeout (HSDP, gloo), slowest member, by part",
        ["world", "variant", "what", "time ms", "worst ms", "worlds"],
    )
    summary: dict[str, Any] = {}
    worlds = sorted({s["world"] for s in samples})
    for world in worlds:
        for variant in VARIANTS:
            chosen = [s for s in samples if s["world"] == world and s["variant"] == variant]
            if not chosen:
                continue
            rows: list[tuple[str, list[float]]] = [
                ("kill -> rebuilt", [s["kill_to_rebuilt"] for s in chosen]),
                ("detection", [s["detection"] for s in chosen]),
                *((f"phase {p}", [s["phases"][p] for s in chosen]) for p in PHASES),
                ("unaccounted", [s["unaccounted"] for s in chosen]),
                ("first survivor's detection", [s["first_detection"] for s in chosen]),
            ]
            for what, values in rows:
                table.add(world, variant, what, summarize(values).scaled(1e3),
                          max(values) * 1e3, len(values))
            if variant == "rebuild()":
                summary[f"kill_to_rebuilt_s_gloo{world}"] = summarize(
                    [s["kill_to_rebuilt"] for s in chosen]).median
                summary[f"kill_to_rebuilt_s_gloo{world}_max"] = max(
                    s["kill_to_rebuilt"] for s in chosen)
    summary["kill_to_rebuilt_s"] = {str(w): summary[f"kill_to_rebuilt_s_gloo{w}"]
                                    for w in worlds if f"kill_to_rebuilt_s_gloo{w}" in summary}
    table.notes += [
        "one fresh world per sample; the last rank SIGKILLs itself after its dp_shard all_reduce "
        "of step 1, its time written to the store first; steps: all_reduce on dp_shard, "
        "dp_replicate, checkpoint-metadata (as tests/test_liveness.py)",
        "every rank has forked a child first, a DataLoader worker's stand-in that outlives the "
        "victim: the victim's peers see its sockets close only because its child let go of them "
        "at the fork (detach_on_fork; without: 40 s on 4 ranks, the backstop beat)",
        "kill -> rebuilt: wall clock from the kill to rebuild() returning on the slowest member of "
        "the new generation; detection and phases are that member's (median [p25-p75] over "
        "worlds); unaccounted: the rest (exception handling, the call itself)",
        "detection: kill -> that member's collective raised (a direct peer of the victim sees the "
        "closed socket; the others are interrupted when the first rebuild() reports the loss); "
        "first survivor's detection: the earliest survivor's",
        f"rebuild(): no alive=, the check-in ends when every absent member left the loss report "
        f"unanswered for dead_after_s ({DEFAULT_DEAD_AFTER_S:g} s; backstop beat every "
        f"{DEFAULT_HEARTBEAT_S:g} s, the defaults); rebuild(alive=): ends when the given "
        "survivors are in",
        "the victim's replica partner is dropped by the new layout (HSDP replicas are elastic): "
        "not a member, not counted",
    ]
    return table, summary


RESOURCES: dict[str, str] = {
    "fds": "fds", "threads": "threads", "process groups": "process_groups",
    "store keys": "store_keys", "store keys, commgroups'": "store_keys_ours",
    "store keys, others' (torch's)": "store_keys_torch",
}
"""What the resource count counts (row -> its summary keys' suffix), per rank; the store's keys
are the same on every rank."""


def _resource_table(result: dict[str, Any]) -> tuple[Table, dict[str, Any]]:
    cycles = result["cycles"]
    stages = ["before create", "after create", "after 1 rebuild", f"after {cycles} rebuilds",
              "after close", "registry dropped"]
    table = Table(
        "rebuild_resources",
        f"What {cycles} rebuilds leave behind ({result['world']} gloo ranks, every rank calls "
        "rebuild(), nobody lost), largest count over ranks",
        ["resource", *stages, f"{cycles} rebuilds' growth", "one generation's cost"],
    )
    ranks: list[dict[str, dict[str, int | None]]] = result["ranks"]
    summary: dict[str, Any] = {}
    for resource, key in RESOURCES.items():
        def values(stage: str, what: str = resource) -> list[int] | None:
            found = [r[stage][what] for r in ranks]
            return None if any(v is None for v in found) else found  # type: ignore[return-value]

        def growth(later: str, earlier: str) -> int | None:
            after, before = values(later), values(earlier)
            if after is None or before is None:
                return None
            return max(a - b for a, b in zip(after, before, strict=True))

        counts = [values(stage) for stage in stages]
        grown = growth(f"after {cycles} rebuilds", "after create")
        cost = growth("after create", "before create")
        table.add(resource, *(None if c is None else max(c) for c in counts), grown, cost)
        summary[f"rebuild_growth_{key}"] = grown
        summary[f"generation_cost_{key}"] = cost
    table.notes += [
        f"growth: after {cycles} rebuilds minus after create (the largest over ranks); one "
        "generation's cost: after create minus before create (registry, its groups, its mesh, "
        "its heartbeat thread and store connection)",
        "process groups: the groups this rank is a member of, the default group included; store "
        "keys: every key in the job's store (the same on every rank)",
        "store keys, commgroups': under the registry's namespace (commgroups/, the launcher's "
        "own keys excluded); others': torch's rendezvous keys of each new group (one per member: "
        "torch's names, never deleted by torch, not ours to delete)",
        "before create: after a first registry was created and closed (torch's lazy set-up and "
        "the job's one-time keys paid); registry dropped: after close() and the last reference "
        "to the registry gone",
    ]
    return table, summary


def tables(samples: list[dict[str, Any]],
           resources: dict[str, Any]) -> tuple[list[Table], dict[str, Any]]:
    """The kill-to-rebuilt table, the resource table and their summary figures
    (``kill_to_rebuilt_s`` per world, ``rebuild_growth_*``, ``generation_cost_*``)."""
    kill_table, summary = _kill_table(samples)
    resource_table, resource_summary = _resource_table(resources)
    return [kill_table, resource_table], {**summary, **resource_summary}


def units(config: BenchConfig) -> int:
    """Progress units :func:`run` reports: one per kill world, one per rebuild cycle."""
    return (len(config.gloo_worlds) * config.kill_repetitions * len(VARIANTS)
            + config.rebuild_cycles)


def run(config: BenchConfig, progress: Progress) -> tuple[list[Table], dict[str, Any],
                                                           list[dict[str, Any]]]:
    """Every kill world (``kill_repetitions`` per gloo world size and variant, interleaved) and
    the resource world (the smallest size); returns the two tables, their summary and the
    ratio table's gloo results (:func:`ratio_result`, one per world size)."""
    # A world that loses a rank has nothing to wait for past its rebuild: a hang fails fast.
    kill_timeout_s = min(config.timeout_s, 180.0)
    samples: list[dict[str, Any]] = []
    for world in config.gloo_worlds:
        for repetition in range(config.kill_repetitions):
            for variant in interleaved(VARIANTS, repetition):
                samples.append(run_world(measure_kill, world, variant, timeout_s=kill_timeout_s,
                                         progress=progress, lost=(world - 1,))[0])
    resources = gather_resources(run_world(measure_resources, min(config.gloo_worlds),
                                           config.rebuild_cycles, timeout_s=config.timeout_s,
                                           progress=progress))
    found, summary = tables(samples, resources)
    return found, summary, [ratio_result(samples, world) for world in config.gloo_worlds]
