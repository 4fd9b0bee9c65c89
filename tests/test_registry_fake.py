"""The registry on the fake backend: one process plays one rank of a 4,096-rank world."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import commgroups as cg
from tests import torch_private
from tests.strategies import layouts

FakeStore = torch_private.fake_store()  # registers backend "fake"

pytestmark = pytest.mark.heavy  # fake worlds of thousands of ranks: left out of make test-fast


@pytest.mark.parametrize("rank", [0, 5, 2047, 4095])
def test_4096_ranks_plan_and_groups(fake_world: Callable[..., None], rank: int) -> None:
    fake_world(4096, rank)
    layout = cg.Layout(dims={"pp": 4, "dp_shard": 128, "cp": 2, "tp": 4})
    plan = cg.plan(layout)
    default = torch_private.default_group()
    with cg.GroupRegistry(layout) as registry:
        assert registry.role_names == ("pp", "dp_shard", "cp", "tp", "fsdp", "checkpoint-metadata")
        for role in registry.role_names:
            group = registry.group(role)
            assert group.group_name != default.group_name
            assert dist.get_backend(group) == "fake"  # every role is simulated under fake
            assert registry.ranks(role) == plan.group_of(role, rank)
            assert dist.get_process_group_ranks(group) == list(plan.group_of(role, rank) or ())
        assert registry.backend("checkpoint-metadata") == "fake"
        mesh = registry.device_mesh(["pp", "dp_shard", "cp", "tp"])
        assert tuple(mesh.shape) == (4, 128, 2, 4)
        assert mesh.get_group("tp") is registry.group("tp")
        assert mesh.get_group("dp_shard") is registry.group("dp_shard")
        fsdp = registry.device_mesh("fsdp")
        assert fsdp.size() == 256 and fsdp.get_group() is registry.group("fsdp")
        assert "fake" in registry.describe()


@settings(max_examples=40, deadline=None)
@given(layouts(), st.data())
def test_no_role_is_ever_the_default_group(layout: cg.Layout, data: st.DataObject) -> None:
    """Invariant 1 for random layouts (world-spanning roles included), on a fake world."""
    rank = data.draw(st.integers(0, layout.world_size - 1))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        default = torch_private.default_group()
        plan = cg.plan(layout)
        with cg.GroupRegistry(layout) as registry:
            for role in registry.role_names:
                group = registry.group(role)
                assert group is not default and group.group_name != default.group_name
                assert registry.ranks(role) == plan.group_of(role, rank)
    finally:
        dist.destroy_process_group()


@settings(max_examples=40, deadline=None)
@given(layouts(), st.data())
def test_torch_finds_only_compute_roles_on_registry_meshes(layout: cg.Layout,
                                                           data: st.DataObject) -> None:
    """Invariant 7: whatever DTensor or FSDP2 can find on a registry mesh, by name or by layout (the
    root mesh's flatten mapping), is the group of a compute role over exactly those dims; a role
    marked ``purpose="checkpoint"`` (a random subset here) is never among them."""
    marked = {role.name for role in layout.roles if data.draw(st.booleans())}
    layout = cg.Layout(dims=layout.dims, roles=[
        role.model_copy(update={"purpose": "checkpoint" if role.name in marked else "compute"})
        for role in layout.roles])
    rank = data.draw(st.integers(0, layout.world_size - 1))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        # dims without a role get groups only when their mesh is declared: declare it
        with cg.GroupRegistry(layout, meshes=[list(layout.dims)]) as registry:
            compute = {registry.group(r).group_name: r for r in registry.role_names
                       if r not in marked}
            meshes = [registry.device_mesh(list(layout.dims))]
            meshes += [registry.device_mesh(r) for r in compute.values()]
            for mesh in meshes:
                for key, flat in torch_private.flatten_mapping(mesh).items():  # what DTensor reads
                    name = flat.get_group().group_name
                    assert name in compute, (key, name, marked)
                    role = registry.spec(compute[name])
                    assert key in {compute[name], "_".join(role.dims if role.dims != "world"
                                                           else layout.dims)}
            for role in marked:
                with pytest.raises(cg.errors.LayoutError, match="purpose 'checkpoint'"):
                    registry.device_mesh(role)
    finally:
        dist.destroy_process_group()


def test_set_timeout_on_fake_groups_is_silent(fake_world: Callable[..., None]) -> None:
    # Fake groups never time out; torch warns when asked to change their timeout, so the registry
    # does not ask (the fake adapter has no timeout).
    import warnings

    fake_world(8)
    with cg.GroupRegistry(cg.Layout(dims={"dp_shard": 2, "cp": 4})) as registry, \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.set_timeout(30)
        registry.set_timeout(60, role="cp")


def test_on_rebuilt_follows_each_rebuild_until_removed(fake_world: Callable[..., None]) -> None:
    # What mirrors the registry's groups elsewhere (Megatron's parallel_state) is told of each
    # new generation, after it is current; a removed callback hears nothing more.
    fake_world(16, 0)
    layout = cg.Layout(dims={"dp_replicate": 4, "dp_shard": 4},
                       elastic={"dims": {"dp_replicate": 1}})
    heard: list[tuple[int, str, int]] = []
    # all_ranks: member-only names of a second rebuild repeat the first's under the fake backend
    with cg.GroupRegistry(layout, creation_mode="all_ranks") as registry:
        def seen(report: cg.RebuildReport) -> None:  # the new generation is current already
            heard.append((report.generation, report.place, registry.generation))
            assert registry.group("dp_shard") is not None

        remove = registry.on_rebuilt(seen)
        registry.rebuild([r for r in range(16) if r not in (12, 13, 14, 15)])
        assert heard == [(1, "member", 1)]
        remove()
        remove()  # idempotent
        registry.rebuild([r for r in range(12) if r not in (8, 9, 10, 11)])
        assert heard == [(1, "member", 1)] and registry.generation == 2
