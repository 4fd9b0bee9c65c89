"""torchtitan's meshes from the registry at scale: one process plays one rank of a 65,536-rank world.

Every mesh name torchtitan asks for resolves with torchtitan's sizes, no mesh is the default group,
FSDP2's own ``_flatten("dp_shard_cp")`` returns the fsdp role's group, and the MoE view (efsdp x ep)
is registry groups. Skipped only when torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch.distributed as dist

from tests import torch_private

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')",
)

LAYOUTS = {
    # name: (pp, dp_replicate, dp_shard, cp, tp, ep, spmd_backend)
    "dense-spmd_types": (8, 1, 512, 4, 4, 1, "spmd_types"),
    "dense-partial_dtensor": (8, 1, 512, 4, 4, 1, "partial_dtensor"),
    "moe-hsdp-spmd_types": (8, 2, 256, 4, 4, 8, "spmd_types"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 65_535])
def test_every_torchtitan_mesh_resolves(fake_world: Callable[..., None], name: str,
                                        rank: int) -> None:
    import commgroups as cg
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    pp, dp_replicate, dp_shard, cp, tp, ep, backend = LAYOUTS[name]
    degrees = TitanDegrees(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                           ep=ep, spmd_backend=backend)
    assert degrees.world_size == 65_536
    fake_world(65_536, rank)
    default = torch_private.default_group()
    with cg.GroupRegistry(titan_layout(degrees)) as registry:
        pd = RegistryParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                                  pp=pp, ep=ep, world_size=65_536, spmd_backend=backend,
                                  registry=registry)
        pd.build_mesh()  # torchtitan's own size checks (_validate_meshes) run inside
        for mesh_name, mesh in single_axis_meshes(pd).items():
            assert pd.get_optional_mesh(mesh_name, include_singleton_axes=True) is mesh
            if mesh_name in ("efsdp", "ep") and ep == 1:
                # torchtitan's size-only placeholders: no group at all, and a clear refusal
                # (stock returns a fake-backend group whose collectives move no data)
                with pytest.raises(cg.errors.MeshRequestError, match="ep == 1") as info:
                    mesh.get_group()
                assert info.value.field == "parallelism.expert_parallel_degree"
                assert "get_optional_mesh" in str(info.value) and len(str(info.value)) <= 300
                assert pd.get_optional_mesh(mesh_name) is None
                assert pd.mesh_groups()[mesh_name] is None
                continue
            group = mesh.get_group()
            assert group is not default and group.group_name != default.group_name, mesh_name
            assert rank in dist.get_process_group_ranks(group)
            if mesh_name in registry.role_names:
                assert group is registry.group(mesh_name)

        if hasattr(pd, "spmd_meshes"):  # torchtitan 0.3.0; main dropped it (and _spmd_meshes)
            assert pd.spmd_meshes(), "no SPMD mesh"
        assert pd.get_activated_mesh(["tp"]) is pd.get_mesh("tp")
        names = ["dp_replicate", "fsdp"] if backend == "partial_dtensor" else ["dp_shard", "cp"]
        names = [n for n in names if pd.get_optional_mesh(n) is not None]
        assert pd.get_mesh(names).mesh_dim_names == tuple(names)
        if backend == "spmd_types":
            dense = pd.spmd_dense_mesh()
            assert dense.mesh_dim_names == ("dp", "cp", "tp")
            flat = torch_private.flatten(pd.get_optional_mesh(["dp_shard", "cp"]), "dp_shard_cp")
            assert flat.get_group() is registry.group("fsdp")  # FSDP2's own flatten
        if ep > 1:
            assert pd.get_mesh("ep").get_group() is registry.group("ep")
            assert pd.get_mesh("efsdp").get_group() is registry.group("efsdp")
            assert pd.get_mesh("efsdp").size() == dp_shard * cp * tp // ep
            assert pd.spmd_sparse_mesh() is not None if backend == "spmd_types" else True


def test_torchtitans_own_mesh_log_lines(fake_world: Callable[..., None],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """The two lines stock build_mesh logs (parallelism, active dimensions) still appear."""
    import logging

    import commgroups as cg
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims

    fake_world(64, 0)
    degrees = TitanDegrees(pp=2, dp_replicate=1, dp_shard=8, cp=2, tp=2, ep=1,
                           spmd_backend="partial_dtensor")
    with cg.GroupRegistry(titan_layout(degrees)) as registry, caplog.at_level(logging.INFO):
        pd = RegistryParallelDims(dp_replicate=1, dp_shard=8, cp=2, tp=2, pp=2, ep=1,
                                  world_size=64, spmd_backend="partial_dtensor",
                                  registry=registry)
        pd.build_mesh()
        active = list(pd.get_all_one_dimensional_meshes())
    said = [r.getMessage() for r in caplog.records]
    assert ("Building device mesh with parallelism: pp=2, dp_replicate=1, dp_shard=8, cp=2, "
            "tp=2, ep=1") in said
    assert f"Successfully created meshes with active dimensions: {active}" in said
    assert {"pp", "cp", "tp", "fsdp", "loss"} <= set(active)


def test_full_dtensor_is_refused(fake_world: Callable[..., None]) -> None:
    """torchtitan main removed the full_dtensor backend (#4217); commgroups builds no meshes
    for it and says so, instead of an untested path."""
    import commgroups as cg
    from commgroups.errors import LayoutError
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims

    fake_world(4, 0)
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1,
                           spmd_backend="partial_dtensor")
    with cg.GroupRegistry(titan_layout(degrees)) as registry:
        pd = RegistryParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, ep=1,
                                  world_size=4, spmd_backend="full_dtensor", registry=registry)
        with pytest.raises(LayoutError, match=r"full_dtensor.*partial_dtensor, spmd_types"):
            pd.build_mesh()


def test_build_mesh_without_a_created_registry_is_refused(fake_world: Callable[..., None]) -> None:
    """The one "not created" class, still a RuntimeError as this error was before."""
    import commgroups as cg
    from commgroups.errors import RegistryNotCreatedError
    from commgroups.integrations.torchtitan import TitanDegrees, fit_titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims

    fake_world(4, 0)
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1)
    for registry in (None, cg.GroupRegistry(fit_titan_layout(None, degrees))):
        pd = RegistryParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, ep=1,
                                  world_size=4, registry=registry)
        with pytest.raises(RegistryNotCreatedError, match="needs a created GroupRegistry"):
            pd.build_mesh()
        with pytest.raises(RuntimeError, match=r"fix: set parallel_dims\.registry"):
            pd.build_mesh()
