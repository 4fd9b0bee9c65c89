"""Side by side: torchtitan's own ``ParallelDims`` and commgroups' ``RegistryParallelDims`` on one world.

:func:`compare` builds both for the same degrees on the current default group (fake, or real gloo)
and returns every way commgroups' answers differ from stock's through torchtitan's own lookups
(``get_mesh``, ``get_optional_mesh``, ``get_activated_mesh``, ``get_all_one_dimensional_meshes``,
``spmd_meshes``, ``resolve_mesh`` ...), leaving out only the differences the guide's torchtitan
section documents, which it checks instead (:func:`documented_differences`). Used by
tests/test_torchtitan_parallel_dims.py (fake worlds, one rank in process) and
tests/test_torchtitan_parallel_dims_world.py (gloo worlds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tests import torch_private

__all__ = ["ACTIVATED", "BACKENDS", "COMBOS", "Degrees", "built_pair", "compare", "outcome",
           "stock_on_cpu"]

BACKENDS = ("partial_dtensor", "full_dtensor", "spmd_types")
"""torchtitan 0.3.0's ``parallelism.spmd_backend`` values."""

COMBOS: tuple[tuple[str, ...], ...] = (
    ("dp_replicate", "fsdp"), ("dp_replicate", "dp_shard"), ("dp_shard", "cp"),
    ("dp_replicate", "dp_shard", "cp", "tp"), ("dp", "cp", "tp"), ("cp", "tp"),
    ("pp", "batch", "cp", "tp"), ("batch", "cp"), ("dp_replicate", "efsdp", "ep"),
    ("dp_replicate", "efsdp"), ("efsdp", "ep"), ("fsdp", "tp"), ("tp", "cp"),
)
"""Multi-axis requests torchtitan's code makes (and a few it refuses: out of order, unknown)."""

ACTIVATED: tuple[tuple[str, ...], ...] = (
    ("dp_replicate", "fsdp", "tp"), ("dp_replicate", "dp_shard", "cp", "tp"), ("dp", "cp", "tp"),
    ("dp_replicate", "efsdp", "ep"), ("tp",), ("pp",), ("dp_replicate", "fsdp"),
)
"""``get_activated_mesh`` candidates: the dense and sparse SPMD axes of each backend, and more."""


@dataclass(frozen=True)
class Degrees:
    """torchtitan's parallelism degrees (``dp_shard=-1``: the ranks left)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def world_size(self) -> int:
        """Ranks these degrees need (``dp_shard=-1`` counts as 1: pass the world explicitly)."""
        return self.pp * self.dp_replicate * max(self.dp_shard, 1) * self.cp * self.tp

    def kwargs(self, world_size: int, backend: str) -> dict[str, Any]:
        """``ParallelDims(**...)`` arguments."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "cp": self.cp, "tp": self.tp, "ep": self.ep, "world_size": world_size,
                "spmd_backend": backend}

    def __str__(self) -> str:
        return "-".join(f"{k}{v}" for k, v in vars(self).items() if v != 1) or "all1"


@contextlib.contextmanager
def stock_on_cpu() -> Iterator[None]:
    """Stock ``build_mesh`` makes its world mesh on torchtitan's ``device_type``, bound when
    torchtitan is imported (``"cuda"`` on a machine without a device); on CPU it must be "cpu", as
    torchtitan's own unit tests set it. Restored on exit."""
    import torchtitan.distributed.parallel_dims as titan_pd

    before = titan_pd.device_type
    titan_pd.device_type = "cpu"
    try:
        yield
    finally:
        titan_pd.device_type = before


@contextlib.contextmanager
def built_pair(degrees: Degrees, world_size: int, backend: str) -> Iterator[tuple[Any, Any, Any]]:
    """(stock, ours, registry), both built on the current default group; the registry (created for
    ``titan_layout`` of the resolved degrees) is closed on exit."""
    import commgroups as cg
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import ParallelDims

    kwargs = degrees.kwargs(world_size, backend)
    with stock_on_cpu():
        stock = ParallelDims(**kwargs)
        stock.build_mesh()
    resolved = TitanDegrees(pp=stock.pp, dp_replicate=stock.dp_replicate, dp_shard=stock.dp_shard,
                            cp=stock.cp, tp=stock.tp, ep=stock.ep, spmd_backend=backend)
    with cg.GroupRegistry(titan_layout(resolved)) as registry:
        ours = RegistryParallelDims(registry=registry, **kwargs)
        ours.build_mesh()
        yield stock, ours, registry


def _shape(mesh: Any) -> tuple[Any, ...]:
    return ("mesh", mesh.mesh_dim_names, tuple(mesh.shape), mesh.mesh.tolist())


def outcome(call: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What ``call(*args)`` gave, comparable across the two: None, a mesh's names, shape and ranks,
    a list of those, or the exception's type and text."""
    try:
        value = call(*args)
    except (ValueError, AssertionError, KeyError) as error:
        return ("raised", type(error).__name__, str(error))
    if value is None:
        return ("none",)
    if isinstance(value, list):
        return ("list", [_shape(m) for m in value])
    return _shape(value)


def _ours_only(name: str, ours: Any) -> bool:
    """The MoE view without expert parallelism: a placeholder (the guide: no group, where stock
    has a fake-backend one)."""
    return name in ("efsdp", "ep") and ours.ep == 1


def documented_differences(stock: Any, ours: Any, registry: Any) -> list[str]:
    """Where commgroups differs from stock on purpose (the guide's torchtitan section), what it
    does instead; returns what is wrong."""
    from commgroups.errors import MeshRequestError
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    problems: list[str] = []
    default = torch_private.default_group()
    # world_mesh: stock's is the 1-D ("world",) mesh, the default group itself; ours is the dense
    # 5-D mesh over registry groups (torchtitan uses it only for its device type).
    world = ours.world_mesh
    if stock.world_mesh.mesh_dim_names != ("world",):
        problems.append(f"stock's world mesh is {stock.world_mesh} (expected ('world',))")
    if world.mesh_dim_names != ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        problems.append(f"world_mesh dims {world.mesh_dim_names}")
    if world.size() != stock.world_mesh.size() or sorted(world.mesh.flatten().tolist()) != \
            sorted(stock.world_mesh.mesh.flatten().tolist()):
        problems.append(f"world_mesh {world} covers other ranks than stock's {stock.world_mesh}")
    for dim in world.mesh_dim_names:
        if world[dim].get_group() is default:
            problems.append(f"world_mesh[{dim!r}] is the default group")
    # Every 1-D mesh is a registry group, never the default group; ep == 1's MoE view is a
    # placeholder that refuses to give a group (stock: a fake-backend group moving no data).
    for name, mesh in single_axis_meshes(ours).items():
        if _ours_only(name, ours):
            try:
                mesh.get_group()
                problems.append(f"{name}: the ep == 1 placeholder gave a group")
            except MeshRequestError:
                pass
            continue
        group = mesh.get_group()
        if group is default or group.group_name == default.group_name:
            problems.append(f"{name} is the default group")
        if name in registry.role_names and mesh.size() > 1 and group is not registry.group(name):
            problems.append(f"{name} is not the registry's {name} role")
    return problems


def compare(stock: Any, ours: Any, registry: Any) -> list[str]:
    """Every difference between ``ours`` and ``stock`` through torchtitan's lookups, plus what
    :func:`documented_differences` finds; empty when they agree."""
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    problems: list[str] = []

    def same(what: str, theirs: Any, mine: Any) -> None:
        if theirs != mine:
            problems.append(f"{what}: stock {theirs!r}, commgroups {mine!r}")

    def both(method: str, *args: Any) -> None:
        """The same lookup asked of each."""
        same(f"{method}{args!r}", outcome(getattr(stock, method), *args),
             outcome(getattr(ours, method), *args))

    names = list(single_axis_meshes(stock))
    same("1-D mesh names", names, list(single_axis_meshes(ours)))
    for name in names:
        both("get_optional_mesh", name)
        both("get_mesh", name)
        # With singleton axes: the same size and ranks (the placeholders included).
        theirs = stock.get_optional_mesh(name, include_singleton_axes=True)
        mine = ours.get_optional_mesh(name, include_singleton_axes=True)
        same(f"{name} with singleton axes", (theirs.mesh_dim_names, theirs.mesh.tolist()),
             (mine.mesh_dim_names, mine.mesh.tolist()))
    same("get_all_one_dimensional_meshes",
         {k: _shape(v) for k, v in stock.get_all_one_dimensional_meshes().items()},
         {k: _shape(v) for k, v in ours.get_all_one_dimensional_meshes().items()})
    for combo in COMBOS:
        both("get_optional_mesh", list(combo))
    for axes in ACTIVATED:
        both("get_activated_mesh", list(axes))
        both("resolve_mesh", list(axes))
    both("get_optional_mesh", "bogus")
    if hasattr(stock, "spmd_meshes"):  # 0.3.0
        both("spmd_meshes")
    if stock.spmd_backend == "spmd_types":
        both("spmd_dense_mesh")
        both("spmd_sparse_mesh")
    if stock.tp > 1:
        both("get_dense_tp_mesh")
    return problems + documented_differences(stock, ours, registry)


def rank_compare(rank: int, world_size: int, cases: list[tuple[Degrees, str]]) -> dict[str, Any]:
    """A :func:`tests.worlds.run_world` rank function: :func:`compare` for each case, then one
    all-reduce on each enabled 1-D mesh of ours (real data over the registry's groups)."""
    import torch

    results: dict[str, Any] = {}
    for degrees, backend in cases:
        with built_pair(degrees, world_size, backend) as (stock, ours, registry):
            problems = compare(stock, ours, registry)
            sums = {}
            for name, mesh in ours.get_all_one_dimensional_meshes().items():
                value = torch.tensor([float(rank)])
                dist.all_reduce(value, group=mesh.get_group())
                sums[name] = (value.item(), float(sum(mesh.mesh.tolist())))
            results[f"{degrees}-{backend}"] = {"problems": problems, "sums": sums,
                                               "active": sorted(stock.get_all_one_dimensional_meshes())}
    return results
