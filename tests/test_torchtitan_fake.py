"""torchtitan's meshes from the registry at scale: one process plays one rank of a 65,536-rank world.

Every mesh name torchtitan asks for resolves with torchtitan's sizes, no mesh is the default group,
FSDP2's own ``_flatten("dp_shard_cp")`` returns the fsdp role's group, and the MoE view (efsdp x ep)
is registry groups, under each spmd backend (full_dtensor too: what torchtitan's own full_dtensor
code asks of the meshes). Skipped only when torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch.distributed as dist

from tests import torch_private

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    pytest.mark.heavy,  # seconds a test: left out of make test-fast
]

LAYOUTS = {
    # name: (pp, dp_replicate, dp_shard, cp, tp, ep, spmd_backend)
    "dense-spmd_types": (8, 1, 512, 4, 4, 1, "spmd_types"),
    "dense-partial_dtensor": (8, 1, 512, 4, 4, 1, "partial_dtensor"),
    "dense-full_dtensor": (8, 1, 512, 4, 4, 1, "full_dtensor"),
    "moe-hsdp-spmd_types": (8, 2, 256, 4, 4, 8, "spmd_types"),
    "moe-hsdp-full_dtensor": (8, 2, 256, 4, 4, 8, "full_dtensor"),
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
        # stock's flatten name (batch x cp -> "loss_mesh"), on the loss role's group
        assert pd.get_mesh("loss").mesh_dim_names == ("loss_mesh",)
        assert pd.get_mesh("loss").get_group() is registry.group("loss")
        if backend == "spmd_types":
            dense = pd.spmd_dense_mesh()
            assert dense.mesh_dim_names == ("dp", "cp", "tp")
        if backend != "partial_dtensor":
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


@pytest.mark.parametrize(("dims", "shard"), [
    # (dp_replicate, dp_shard, cp, tp), FSDP2's shard axes
    ((1, 2, 2, 1), ("dp_shard", "cp")),
    ((2, 2, 1, 2), "dp_shard"),
    ((1, 1, 4, 1), ("dp_shard", "cp")),
    ((1, 1, 1, 4), "dp_shard"),
])
def test_full_dtensor_meshes_are_registry_groups(fake_world: Callable[..., None],
                                                 dims: tuple[int, int, int, int],
                                                 shard: object) -> None:
    """``--parallelism.spmd_backend full_dtensor`` (torchtitan 0.3.0): what torchtitan's own
    full_dtensor code asks of the meshes (``resolve_fsdp_mesh``, ``parallelize_inputs``'
    activated dense mesh, ``resolve_mesh``, the tp mesh) resolves to registry groups, never the
    default group, and FSDP2's ``dp_shard_cp`` flatten is the fsdp role's group."""
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

    import commgroups as cg
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    dp_replicate, dp_shard, cp, tp = dims
    world = dp_replicate * dp_shard * cp * tp
    fake_world(world, world - 1)
    default = torch_private.default_group()
    degrees = TitanDegrees(pp=1, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                           ep=1, spmd_backend="full_dtensor")
    with cg.GroupRegistry(titan_layout(degrees)) as registry:
        pd = RegistryParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                                  pp=1, ep=1, world_size=world, spmd_backend="full_dtensor",
                                  registry=registry)
        pd.build_mesh()
        for name, mesh in single_axis_meshes(pd).items():
            if name in ("efsdp", "ep"):
                continue  # placeholders (ep == 1): test_every_torchtitan_mesh_resolves
            assert mesh.get_group() is not default, name
        # full_dtensor keeps dp_shard even at size 1 (FSDP2 picks its DP submesh by name)
        assert pd.get_optional_mesh("dp_shard") is not None
        active = [n for n, size in zip(("dp_replicate", "dp_shard", "cp", "tp"), dims)
                  if size > 1 or n == "dp_shard"]
        storage, dp_mesh_dims = resolve_fsdp_mesh(pd)
        assert storage.mesh_dim_names == tuple(active)
        assert storage in pd.spmd_meshes()
        assert dp_mesh_dims is not None and dp_mesh_dims.shard == shard
        for axis in storage.mesh_dim_names:
            group = storage[axis].get_group()
            assert group is not default, axis
            if storage.size(storage.mesh_dim_names.index(axis)) > 1:
                assert group is registry.group(axis)
        assert pd.resolve_mesh(["dp", "cp", "tp"]) is storage  # no "does not match any" error
        if tp > 1:
            assert pd.get_dense_tp_mesh().get_group() is registry.group("tp")
        if isinstance(shard, tuple):  # what fully_shard(dp_mesh_dims=...) flattens
            flat = torch_private.flatten(storage[shard], "_".join(shard))
            assert flat.get_group() is registry.group("fsdp")


def test_full_dtensor_is_refused_where_torchtitan_removed_it(
        fake_world: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan main removed the full_dtensor backend (#4217): where its module is gone,
    build_mesh refuses the option, naming the field and the backends that remain."""
    import sys

    import commgroups as cg
    from commgroups.errors import LayoutError
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import (
        FULL_DTENSOR_MODULE,
        has_full_dtensor,
        spmd_backends,
    )

    assert has_full_dtensor() and "full_dtensor" in spmd_backends()  # torchtitan 0.3.0
    # None in sys.modules: importing the module fails, as where torchtitan no longer ships it.
    monkeypatch.setitem(sys.modules, FULL_DTENSOR_MODULE, None)
    assert not has_full_dtensor()
    assert spmd_backends() == ("partial_dtensor", "spmd_types")
    fake_world(4, 0)
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1,
                           spmd_backend="full_dtensor")
    with cg.GroupRegistry(titan_layout(degrees)) as registry:
        for backend, says in (("full_dtensor", "torchtitan main removed it"),
                              ("bogus", "not one commgroups builds meshes for")):
            pd = RegistryParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, ep=1,
                                      world_size=4, spmd_backend=backend, registry=registry)
            with pytest.raises(LayoutError, match=says) as info:
                pd.build_mesh()
            text = str(info.value)
            assert info.value.field == "parallelism.spmd_backend"
            assert "fix:" in text and "partial_dtensor, spmd_types" in text and len(text) <= 300


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
