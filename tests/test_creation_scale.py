"""Creation at scale, simulated: one process is one rank of a 65,536-rank fake-backend world.

The default group is made to raise on any collective (FakeProcessGroup.Options.error_on_collective),
so every role working proves it never touches the default group. new_group calls are counted by
wrapping torch.distributed.new_group and compared with init_device_mesh + _flatten for the same dims.
Timings are ``commgroups bench``'s business (its creation scenario), not the tests'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups.registry import GroupRegistry
from tests import torch_private

WORLD = 65_536
DIMS = {"dp_shard": 8_192, "cp": 8}
RANK = 12_345  # an arbitrary rank in the middle of the world
ROLES = ("fsdp", "cp", "dp_shard", "checkpoint-metadata")


def _layout() -> cg.Layout:
    return cg.Layout(
        dims=dict(DIMS),
        roles=[
            cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
            cg.RoleSpec(name="cp", dims=["cp"]),
            cg.RoleSpec(name="dp_shard", dims=["dp_shard"]),
            cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo"),
        ],
    )


@pytest.fixture
def guarded_world() -> Iterator[None]:
    """A fake world of 65,536 ranks whose default group raises on any collective."""
    store = torch_private.fake_store()()  # registers backend "fake"
    options = torch_private.fake_world_options(error_on_collective=True)
    dist.init_process_group("fake", store=store, rank=RANK, world_size=WORLD,
                            pg_options=options)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def new_group_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every torch.distributed.new_group call made while the test runs, with its keywords."""
    calls: list[dict[str, Any]] = []
    original: Callable[..., Any] = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(kwargs, nranks=len(args[0]) if args else len(kwargs.get("ranks") or [])))
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", counting)
    # DeviceMesh imported the function by name: count its calls too.
    import torch.distributed.device_mesh as device_mesh

    if hasattr(device_mesh, "new_group"):
        monkeypatch.setattr(device_mesh, "new_group", counting)
    return calls


def _check_roles(registry: GroupRegistry) -> None:
    for role in ROLES:
        group = registry.group(role)
        assert group is not dist.group.WORLD
        assert group.size() == registry.plan.role(role).group_size
        assert tuple(dist.get_process_group_ranks(group)) == registry.plan.group_of(role, RANK)
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=group)  # raises if it lands on the default group
        dist.broadcast(tensor, group_src=0, group=group)


@pytest.mark.usefixtures("guarded_world")
def test_default_group_raises_on_collectives() -> None:
    """The detector works: a collective on the default group raises."""
    with pytest.raises(RuntimeError, match="error_on_collective"):
        dist.all_reduce(torch.ones(2))


@pytest.mark.usefixtures("guarded_world")
@pytest.mark.parametrize("mode", ["local", "auto"])
def test_one_new_group_call_per_role(mode: str, new_group_calls: list[dict[str, Any]]) -> None:
    """Local and auto creation make one new_group call per role on a rank, member-only."""
    registry = GroupRegistry(_layout(), creation_mode=mode).create()
    try:
        assert len(new_group_calls) == len(ROLES)
        assert all(call["use_local_synchronization"] for call in new_group_calls)
        assert {registry.creation_method(role) for role in ROLES} == {"local"}
        _check_roles(registry)
        assert "local" in registry.describe()
    finally:
        registry.close()


@pytest.mark.usefixtures("guarded_world")
def test_registry_vs_device_mesh(new_group_calls: list[dict[str, Any]]) -> None:
    """Compare creation calls with all_ranks and with init_device_mesh + _flatten (same dims)."""
    from torch.distributed.device_mesh import init_device_mesh

    local = GroupRegistry(_layout(), creation_mode="auto").create()
    local_calls = len(new_group_calls)
    _check_roles(local)
    local.close()

    new_group_calls.clear()
    every = GroupRegistry(_layout(), creation_mode="all_ranks").create()
    all_ranks_calls = len(new_group_calls)
    _check_roles(every)
    every.close()

    new_group_calls.clear()
    mesh = init_device_mesh("cpu", tuple(DIMS.values()), mesh_dim_names=tuple(DIMS))
    flat = torch_private.flatten(mesh["dp_shard", "cp"])
    mesh_calls = len(new_group_calls)

    assert local_calls == len(ROLES)
    # all_ranks: one call per group of every role (1 + 8192 + 8 + 1).
    assert all_ranks_calls == sum(_layout_groups(role) for role in ROLES)
    # What the registry exists to avoid: the world-spanning flattened dim is the default group here.
    assert flat.get_group() is dist.group.WORLD
    # DeviceMesh makes one call per group of every dim (and its flatten): far more than the registry.
    assert mesh_calls > all_ranks_calls // 2 > local_calls


def _layout_groups(role: str) -> int:
    return cg.plan(_layout()).role(role).num_groups


@pytest.mark.usefixtures("guarded_world")
def test_rebuild_after_losing_a_node_is_member_local(new_group_calls: list[dict[str, Any]]) -> None:
    """HSDP over 8,192 replicas of 8 loses one node (8 ranks, one replica): replan drops that
    replica, and rebuild makes one member-only new_group call per role on this rank."""
    dims = {"dp_replicate": WORLD // 8, "dp_shard": 8}
    layout = cg.Layout(dims=dims, elastic={"dims": {"dp_replicate": 1}})
    registry = GroupRegistry(layout).create()
    try:
        new_group_calls.clear()
        lost = set(range(8, 16))  # the second node
        report = registry.rebuild([r for r in range(WORLD) if r not in lost])
        assert report.lost == tuple(sorted(lost)) and report.place == "member"
        assert dict(report.layout.dims) == {"dp_replicate": WORLD // 8 - 1, "dp_shard": 8}
        assert registry.generation == 1 and len(registry.members) == WORLD - 8
        roles = registry.role_names
        assert len(new_group_calls) == len(roles)
        assert all(call["use_local_synchronization"] for call in new_group_calls)
        for role in roles:
            group = registry.group(role)
            assert group is not dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(group))
            assert ranks == registry.ranks(role) and RANK in ranks and not lost & set(ranks)
            dist.all_reduce(torch.ones(2), group=group)  # raises on the default group
        # The replica dim's group skips the lost replica: RANK 12,345 (dp_shard coordinate 1)
        # meets rank 1 of replica 0, then rank 17 of replica 2.
        assert registry.ranks("dp_replicate")[:3] == (1, 17, 25)
    finally:
        registry.close()
