"""Creation: the registry against ``init_device_mesh`` (+ ``_flatten`` for fsdp) and against an
all-ranks ``new_group`` loop (Megatron's way), for the same dims and roles.

Every variant builds the same four roles over ``dp_shard x cp``: dp_shard, cp, fsdp (dp_shard x cp,
which spans the world) and checkpoint-metadata (the world, on gloo where gloo is real). The table
reports the slowest rank's wall time, how many ``new_group``/``split_group`` calls one rank made, and
how many roles came back as the default group (DeviceMesh aliases any dim that spans the world).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, interleaved, paired_ratios, summarize
from commgroups.bench.world import run_world
from commgroups.creation.descriptor_table import table_size
from commgroups.layout.specs import CHECKPOINT_ROLE, Layout
from commgroups.planning.plan import Plan
from commgroups.registry import GroupRegistry

__all__ = [
    "FIRST_VARIANTS",
    "VARIANTS",
    "CallCounter",
    "bench_layout",
    "counting_creation_calls",
    "first_tables",
    "measure_fake",
    "measure_first",
    "measure_gloo",
    "merge",
    "tables",
]

VARIANTS: tuple[str, ...] = ("registry", "registry all_ranks", "devicemesh",
                             "devicemesh + own fsdp", "new_group loop")
"""``registry`` uses creation_mode="auto" (the fastest safe path); ``registry all_ranks`` forces torch's
default contract, the same calls as the loop. ``devicemesh + own fsdp`` is what a DeviceMesh user does
to keep FSDP off the default group: the same mesh plus a dedicated world group for fsdp, i.e. the same
communicators as the registry."""

_COUNTED = ("new_group", "split_group")

FIRST_VARIANTS: tuple[str, ...] = ("registry", "devicemesh")
"""What :func:`measure_first` compares: one creation, the first in a fresh world."""


def bench_layout(world_size: int) -> Layout:
    """``dp_shard x cp`` with cp = 4 (2 on 4 ranks) and the built-in roles."""
    cp = 4 if world_size >= 8 else 2
    return Layout(dims={"dp_shard": world_size // cp, "cp": cp})


@dataclass
class CallCounter:
    """Creation calls this process made, and the groups they returned."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTED, 0))
    groups: list[Any] = field(default_factory=list)

    @property
    def total(self) -> int:
        """new_group plus split_group calls."""
        return sum(self.calls.values())


@contextmanager
def counting_creation_calls() -> Iterator[CallCounter]:
    """Count ``new_group``/``split_group`` calls made in this process while the block runs.

    torch.distributed, device_mesh and commgroups modules may hold their own reference to the
    functions (``from ... import new_group``), so every loaded module attribute that *is* one of the
    originals is swapped for a counting wrapper, and restored afterwards.
    """
    counter = CallCounter()
    originals: dict[str, Callable[..., Any]] = {
        name: getattr(dist.distributed_c10d, name) for name in _COUNTED
    }

    def wrap(name: str) -> Callable[..., Any]:
        original = originals[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter.calls[name] += 1
            group = original(*args, **kwargs)
            counter.groups.append(group)
            return group

        return counted

    wrappers = {name: wrap(name) for name in _COUNTED}
    patched: list[tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("torch.distributed", "commgroups")):
            continue
        for name in _COUNTED:
            if getattr(module, name, None) is originals[name]:
                patched.append((module, name, originals[name]))
                setattr(module, name, wrappers[name])
    try:
        yield counter
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


@dataclass
class Created:
    """What one variant made: each role's group on this rank, how, and how to tear it down."""

    groups: dict[str, Any]
    teardown: Callable[[], None]
    method: str
    """The creation path(s) taken (the registry may fall back from local/split to all_ranks)."""
    settle: Callable[[], None] = lambda: None
    """Waits, untimed, for what the variant left running in the background (the registry's
    heartbeat start-up), so that it does not slow the next variant down."""


def _checkpoint_backend() -> str | None:
    return None if dist.get_backend() == "fake" else "gloo"


def _destroy(groups: list[Any]) -> Callable[[], None]:
    def teardown() -> None:
        default = torch_internals.default_group()
        for group in groups:
            if isinstance(group, dist.ProcessGroup) and group is not default:
                # Already destroyed: DeviceMesh may hand out one group twice.
                with suppress(RuntimeError, ValueError):
                    dist.destroy_process_group(group)

    return teardown


def _create_registry(layout: Layout, creation: str, counter: CallCounter) -> Created:
    registry = GroupRegistry(layout, creation_mode=creation).create()
    methods = sorted({registry.creation_method(role) for role in registry.role_names})
    return Created({role: registry.group(role) for role in registry.role_names}, registry.close,
                   "+".join(methods), registry._recovery.wait_started)


def _create_devicemesh(layout: Layout, counter: CallCounter, own_fsdp: bool = False) -> Created:
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(layout.dims)
    mesh = init_device_mesh("cpu", tuple(layout.dims.values()), mesh_dim_names=names)
    fsdp_group = torch_internals.flatten_mesh(mesh[names], "fsdp").get_group()
    if own_fsdp:  # fsdp spans the world here (dp_shard x cp): a group of its own, not the default
        own = dist.new_group(group_desc="fsdp")
        # torch >= 2.14 types new_group as ProcessGroup | NON_GROUP_MEMBER; every rank is a member.
        assert isinstance(own, dist.ProcessGroup)
        fsdp_group = own
    # torchtitan makes its gloo checkpoint group by hand; DeviceMesh has no role for it.
    checkpoint = dist.new_group(backend=_checkpoint_backend(), group_desc=CHECKPOINT_ROLE)
    # torch >= 2.14 types new_group as ProcessGroup | NON_GROUP_MEMBER; every rank is a member here.
    assert isinstance(checkpoint, dist.ProcessGroup)
    groups = {name: mesh.get_group(name) for name in names}
    groups["fsdp"] = fsdp_group
    groups[CHECKPOINT_ROLE] = checkpoint
    return Created(groups, _destroy(counter.groups), "devicemesh")


def _create_loop(layout: Layout, counter: CallCounter) -> Created:
    plan = Plan(layout)
    rank = dist.get_rank()
    groups: dict[str, Any] = {}
    for role in layout.roles:
        backend = _checkpoint_backend() if role.backend == "gloo" else None
        for ranks in plan.rank_groups(role.name):
            group = dist.new_group(list(ranks), backend=backend, group_desc=role.name)
            if rank in ranks:
                groups[role.name] = group
    return Created(groups, _destroy(counter.groups), "all_ranks")


def _create(variant: str, layout: Layout, counter: CallCounter) -> Created:
    if variant == "registry":
        return _create_registry(layout, "auto", counter)
    if variant == "registry all_ranks":
        return _create_registry(layout, "all_ranks", counter)
    if variant == "devicemesh":
        return _create_devicemesh(layout, counter)
    if variant == "devicemesh + own fsdp":
        return _create_devicemesh(layout, counter, own_fsdp=True)
    return _create_loop(layout, counter)


def _aliases(created: Created) -> int:
    default = torch_internals.default_group()
    return sum(1 for group in created.groups.values() if group is default)


def _timed(variant: str, layout: Layout) -> tuple[float, int, Created]:
    with counting_creation_calls() as counter:
        start = time.perf_counter()
        created = _create(variant, layout, counter)
        elapsed = time.perf_counter() - start
    created.settle()
    return elapsed, counter.total, created


def measure_gloo(rank: int, world_size: int, progress: Progress, repetition: int) -> dict[str, Any]:
    """On every rank of a fresh real gloo world: time every variant once, in the order of
    ``repetition`` (:func:`~commgroups.bench.stats.interleaved`); :func:`merge` joins the worlds.

    One world per repetition: a job creates its registry once, and closing it and creating the same
    layout again would make torch (< 2.14) reuse the member-only group names, which the registry
    refuses (falling back to all_ranks); keeping every repetition's groups open in one world
    instead slowed every variant down as they piled up (8 ranks: 60 ms to 300 ms over 12
    repetitions). A throw-away group first takes the world's one-time costs (and the bench's
    worlds grow each rank's descriptor table as they start: ``bench.world``). A sample is the
    slowest rank's time (the job waits for it), taken with an all_reduce(MAX) outside the timed
    region.
    """
    layout = bench_layout(world_size)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    calls: dict[str, list[int]] = {v: [] for v in VARIANTS}
    methods: dict[str, set[str]] = {v: set() for v in VARIANTS}
    aliases: dict[str, int] = {}
    kept: list[tuple[str, Created]] = []
    progress.describe(f"creation, gloo x{world_size}")
    warm_up = dist.new_group(group_desc="bench-warm-up")
    dist.barrier(group=warm_up)  # type: ignore[arg-type]  # every rank is a member
    for variant in interleaved(VARIANTS, repetition):
        dist.barrier()
        elapsed, count, created = _timed(variant, layout)
        calls[variant].append(count)
        methods[variant].add(created.method)
        aliases[variant] = _aliases(created)
        # Also a barrier: a rank may return from new_group while a peer is still connecting
        # to it, and destroying the group then would reset that peer's connection.
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        samples[variant].append(float(slowest.item()))
        kept.append((variant, created))
    progress.advance()
    # Teardown is timed too (a job that rebuilds, or a test that makes many registries, pays it
    # each time): each variant's, in creation order, the slowest rank's, after a barrier.
    closes: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for variant, created in kept:
        dist.barrier()
        start = time.perf_counter()
        created.teardown()
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        closes[variant].append(float(slowest.item()))
    return {"world": world_size, "backend": "gloo", "samples": samples, "calls": calls,
            "methods": {v: sorted(m) for v, m in methods.items()}, "aliases": aliases,
            "roles": len(layout.roles), "closes": closes}


def measure_first(rank: int, world_size: int, progress: Progress, variant: str
                  ) -> dict[str, Any]:
    """On every rank of a fresh real gloo world, started with ``run_world(grow_table=False)``:
    ``variant``'s creation, the first in it (after a throw-away group only: a job's first
    creation, each rank's descriptor table as its process left it). Returns the slowest rank's
    time and whether any rank's descriptor table grew meanwhile."""
    layout = bench_layout(world_size)
    progress.describe(f"first creation, gloo x{world_size}")
    warm_up = dist.new_group(group_desc="bench-warm-up")
    dist.barrier(group=warm_up)  # type: ignore[arg-type]  # every rank is a member
    dist.barrier()
    size = table_size()
    elapsed, _, created = _timed(variant, layout)
    grew = table_size() != size
    measured = torch.tensor([elapsed, float(grew)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    dist.barrier()
    created.teardown()
    progress.advance()
    return {"world": world_size, "variant": variant, "sample": float(measured[0].item()),
            "grew": bool(measured[1].item())}


def first_tables(results: list[dict[str, Any]]) -> tuple[Table, dict[str, Any]]:
    """The first-creation table (:func:`measure_first`'s samples, in the order taken: the
    variants alternate, so the i-th of each pair is compared) and its summary figures
    (``creation_first_ratio_vs_devicemesh_gloo{N}``)."""
    table = Table(
        "creation_first",
        "Creation, the first in a fresh process: registry vs DeviceMesh (dp_shard x cp, 4 roles)",
        ["world", "variant", "time ms", "ratio vs devicemesh", "descriptor table grew"],
    )
    summary: dict[str, Any] = {}
    for world in sorted({result["world"] for result in results}):
        samples = {variant: [r for r in results if r["world"] == world and r["variant"] == variant]
                   for variant in FIRST_VARIANTS}
        base = [r["sample"] for r in samples["devicemesh"]]
        for variant in FIRST_VARIANTS:
            times = [r["sample"] for r in samples[variant]]
            ratio = summarize(paired_ratios(times, base))
            grew = sum(r["grew"] for r in samples[variant])
            table.add(world, variant, summarize(times).scaled(1e3), ratio,
                      f"{grew} of {len(times)}")
        summary[f"creation_first_ratio_vs_devicemesh_gloo{world}"] = summarize(
            paired_ratios([r["sample"] for r in samples["registry"]], base)).median
    table.notes += [
        "one fresh gloo world per sample, the variants alternating; time: slowest rank's wall "
        "time, median [p25-p75]; ratio: per pair, median [p25-p75]",
        "descriptor table grew: in how many samples a rank's table grew during creation (on 8 "
        "ranks the registry's groups take a process past 64 descriptors and DeviceMesh's do not; "
        "the registry grows it before its agreement, so the growth's grace period passes while "
        "ranks wait for each other)",
    ]
    return table, summary


def steady_worlds(world_size: int, repetitions: int, timeout_s: float,
                  progress: Progress | None = None) -> dict[str, Any]:
    """:func:`measure_gloo` in ``repetitions`` fresh worlds of ``world_size`` gloo ranks (one
    world per repetition: see there), merged (:func:`merge`): a result for :func:`tables`."""
    return merge([run_world(measure_gloo, world_size, repetition, timeout_s=timeout_s,
                            progress=progress)[0] for repetition in range(repetitions)])


def first_worlds(world_size: int, pairs: int, timeout_s: float,
                 progress: Progress | None = None) -> list[dict[str, Any]]:
    """:func:`measure_first`: each of :data:`FIRST_VARIANTS` the first creation in a fresh world
    of ``world_size`` gloo ranks, ``pairs`` times, alternating; samples for
    :func:`first_tables`."""
    return [run_world(measure_first, world_size, variant, timeout_s=timeout_s,
                      progress=progress, grow_table=False)[0]
            for repetition in range(pairs)
            for variant in interleaved(FIRST_VARIANTS, repetition)]


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several worlds' results of the same size (samples and calls joined)."""
    merged: dict[str, Any] = {**results[0], "samples": {v: [] for v in VARIANTS},
                              "closes": {v: [] for v in VARIANTS},
                              "calls": {v: [] for v in VARIANTS},
                              "methods": {v: set() for v in VARIANTS}}
    for result in results:
        for variant in VARIANTS:
            merged["samples"][variant].extend(result["samples"][variant])
            merged["closes"][variant].extend(result["closes"][variant])
            merged["calls"][variant].extend(result["calls"][variant])
            merged["methods"][variant].update(result["methods"][variant])
    merged["methods"] = {v: sorted(m) for v, m in merged["methods"].items()}
    return merged


def measure_fake(rank: int, world_size: int, progress: Progress, repetitions: int) -> dict[str, Any]:
    """In one process, rank 0 of a simulated world: each sample starts from a fresh fake default
    group, so group counters and c10d's tables do not grow across repetitions."""
    FakeStore = torch_internals.import_fake_backend()

    layout = bench_layout(world_size)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    closes: dict[str, list[float]] = {v: [] for v in VARIANTS}
    calls: dict[str, list[int]] = {v: [] for v in VARIANTS}
    methods: dict[str, set[str]] = {v: set() for v in VARIANTS}
    aliases: dict[str, int] = {}
    progress.describe(f"creation, fake x{world_size}")
    progress.add_total(repetitions)
    for repetition in range(repetitions):
        for variant in interleaved(VARIANTS, repetition):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                elapsed, count, created = _timed(variant, layout)
                calls[variant].append(count)
                methods[variant].add(created.method)
                aliases[variant] = _aliases(created)
                start = time.perf_counter()
                created.teardown()
                closes[variant].append(time.perf_counter() - start)
            finally:
                dist.destroy_process_group()
            samples[variant].append(elapsed)
        progress.advance()
    return {"world": world_size, "backend": "fake", "samples": samples, "calls": calls,
            "methods": {v: sorted(m) for v, m in methods.items()}, "aliases": aliases,
            "roles": len(layout.roles), "closes": closes}


def _span(values: list[int]) -> int | str:
    low, high = min(values), max(values)
    return low if low == high else f"{low}-{high}"


def tables(results: list[dict[str, Any]]) -> tuple[Table, dict[str, Any]]:
    """The creation table and the summary figures (``creation_ratio_vs_devicemesh``)."""
    table = Table(
        "creation",
        "Creation: registry vs DeviceMesh vs all-ranks new_group loop (dp_shard x cp, 4 roles)",
        ["world", "backend", "variant", "method", "time ms", "creation calls / rank",
         "roles aliasing default group", "ratio vs devicemesh", "close ms",
         "close ratio vs devicemesh"],
    )
    summary: dict[str, Any] = {}
    for result in sorted(results, key=lambda r: (r["backend"] != "gloo", r["world"])):
        base, close_base = result["samples"]["devicemesh"], result["closes"]["devicemesh"]
        for variant in VARIANTS:
            times, closes = result["samples"][variant], result["closes"][variant]
            ratio = summarize(paired_ratios(times, base))
            table.add(result["world"], result["backend"], variant,
                      " / ".join(result["methods"][variant]), summarize(times).scaled(1e3),
                      _span(result["calls"][variant]), result["aliases"][variant], ratio,
                      summarize(closes).scaled(1e3),
                      summarize(paired_ratios(closes, close_base)))
    for result in results:
        if result["backend"] != "gloo":
            continue
        registry = result["samples"]["registry"]
        for key, base_variant in (("devicemesh", "devicemesh"),
                                  ("devicemesh_own_fsdp", "devicemesh + own fsdp")):
            summary[f"creation_ratio_vs_{key}_gloo{result['world']}"] = summarize(
                paired_ratios(registry, result["samples"][base_variant])).median
        summary[f"close_ratio_vs_devicemesh_gloo{result['world']}"] = summarize(
            paired_ratios(result["closes"]["registry"], result["closes"]["devicemesh"])).median
    simulated = [r for r in results if r["backend"] == "fake"]
    if simulated:
        largest = max(simulated, key=lambda r: r["world"])
        ratio = summarize(paired_ratios(largest["samples"]["registry"],
                                        largest["samples"]["devicemesh"]))
        summary["creation_ratio_vs_devicemesh"] = ratio.median
        summary["creation_ratio_vs_devicemesh_spread"] = ratio.to_dict()
        summary["creation_ratio_world"] = largest["world"]
        summary["registry_calls_per_role"] = max(largest["calls"]["registry"]) / largest["roles"]
    table.notes += [
        "time: slowest rank's wall time per creation (median [p25-p75]); ratio: per-repetition "
        "variant / devicemesh, median [p25-p75]",
        "devicemesh = init_device_mesh + _flatten('fsdp') + a gloo new_group for checkpoint metadata "
        "(fsdp spans the world, so _flatten returns the default group: one communicator fewer than "
        "the registry); devicemesh + own fsdp = the same plus a dedicated world group for fsdp",
        "registry = creation_mode='auto' (method: the paths it took); fake worlds simulate rank 0 in one "
        "process (no data moves)",
        "gloo: one fresh world per repetition, every variant once in it (a job creates its groups "
        "once; groups piling up in one world slowed every variant down)",
        "close: registry.close() (its threads and keys too) vs destroy_process_group on every group "
        "the variant made, slowest rank, after a barrier; the variants close in creation order",
    ]
    return table, summary
