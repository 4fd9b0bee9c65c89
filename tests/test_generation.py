"""commgroups.generation: one generation's groups; only create() and rebuild() make communicators.

Every getter after ``create()`` is counted against torch's own table of process groups: zero new
ones, on the fake backend at scale (here) and on a real 4-rank gloo world (test_generation_world.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import commgroups as cg
from commgroups import torch_internals
from commgroups.errors import MeshNotPlannedError
from commgroups.generation import dims_needing_groups
from commgroups.registry import RegistryState


def _group_count() -> int:
    names = torch_internals.registered_group_names()
    assert names is not None
    return len(names)


def _every_getter(registry: cg.GroupRegistry, meshes: list[list[str] | str]) -> list[Any]:
    """Call every lookup the registry has, on every role and mesh, twice (the second is cached)."""
    seen: list[Any] = []
    for _ in range(2):
        for role in registry.role_names:
            seen += [registry.group(role), registry.ranks(role), registry.resolved_backend(role),
                     registry.creation_method(role), registry.timeout(role), registry.spec(role)]
            if registry.spec(role).purpose == "compute":
                seen.append(registry.device_mesh(role))
            seen.append(registry.collectives(role))
        seen += [registry.device_mesh(names) for names in meshes]
        seen += [registry.process_groups(), registry.describe(), registry.members,
                 registry.generation, registry.layout, registry.plan]
    return seen


def _fsdp_only() -> cg.Layout:
    return cg.Layout(dims={"dp_shard": 2, "cp": 2}, roles=[
        cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo", purpose="checkpoint"),
    ])


def test_no_getter_makes_a_group_fake_backend(fake_world: Callable[..., None]) -> None:
    fake_world(64, rank=5)
    layout = cg.Layout(dims={"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 4})
    with cg.GroupRegistry(layout) as registry:
        before = _group_count()
        _every_getter(registry, [["dp_replicate", "fsdp"], ["pp", "dp_shard", "cp", "tp"],
                                 ["pp", "dp_replicate", "dp_shard", "cp", "tp"], "pp"])
        assert _group_count() == before
        # one word per idea: the requested backend is the spec's, the resolved one the registry's
        assert registry.spec("cp").backend == "device"
        assert registry.resolved_backend("cp") == registry.backend("cp") == "fake"


def test_a_dim_no_role_covers_is_refused_unless_declared_fake_backend(
        fake_world: Callable[..., None]) -> None:
    """The issue's measurement: fsdp (dp_shard x cp) and checkpoint-metadata only; a mesh over
    dp_shard and cp made 2 groups on first call. Now it is refused, or planned at creation."""
    fake_world(4, rank=1)
    with cg.GroupRegistry(_fsdp_only()) as registry:
        before = _group_count()
        with pytest.raises(MeshNotPlannedError, match=r"dim 'dp_shard' has no group.*fix: declare"):
            registry.device_mesh(["dp_shard", "cp"])
        assert _group_count() == before
    with cg.GroupRegistry(_fsdp_only(), meshes=[["dp_shard", "cp"]]) as registry:
        before = _group_count()
        mesh = registry.device_mesh(["dp_shard", "cp"])
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert mesh is registry.device_mesh(["dp_shard", "cp"])
        assert set(registry.process_groups()) == {"fsdp", "checkpoint-metadata", "mesh-dp_shard",
                                                  "mesh-cp"}
        assert _group_count() == before


def test_declared_meshes_are_checked_before_any_group(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    before = _group_count()
    with pytest.raises(cg.errors.UnknownDimError, match="meshes: 'tp'"):
        cg.GroupRegistry(_fsdp_only(), meshes=[["tp"]])
    with pytest.raises(cg.errors.DimOrderError, match="meshes:"):
        cg.GroupRegistry(_fsdp_only(), meshes=[["cp", "dp_shard"]])
    with pytest.raises(cg.errors.ArgumentError, match=r"meshes: \[3\] is not a dim or role name"):
        cg.GroupRegistry(_fsdp_only(), meshes=[[3]])  # type: ignore[list-item]
    assert _group_count() == before


def test_only_planned_and_size_one_dims_get_groups(fake_world: Callable[..., None]) -> None:
    """Dims without a role get a group when a declared mesh needs it (a communicator each on
    NCCL), or when of size 1 (a single-rank group, no communicator); covered dims never do."""
    from commgroups.creation.role_groups import CreationContext

    fake_world(8)
    layout = cg.Layout(dims={"pp": 1, "dp_shard": 4, "cp": 2},
                       roles=[cg.RoleSpec(name="cp", dims=["cp"]),
                              cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"])])
    plan = cg.plan(layout)
    context = CreationContext.detect()
    assert dims_needing_groups(layout, plan, [], context) == ("pp",)
    assert dims_needing_groups(layout, plan, [("dp_shard", "cp"), ("fsdp",)], context) == (
        "dp_shard", "pp")


def test_state_is_an_enum_and_layout_is_read_only(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": 2, "cp": 2}))
    assert registry.state is RegistryState.NEW and registry.state == "new"
    registry.create()
    assert registry.state is RegistryState.CREATED
    with pytest.raises(AttributeError):
        registry.layout = cg.Layout(dims={"cp": 4})  # type: ignore[misc]
    registry.close()
    assert registry.state is RegistryState.CLOSED
