"""torchtitan's ``ParallelDims`` with every mesh built from a GroupRegistry's dedicated groups.

Stock ``ParallelDims.build_mesh()`` makes a world mesh with ``init_device_mesh`` and unflattens views
of it; a view dim that spans the world (cp when cp == world size, fsdp over dp_shard x cp, the loss
flatten) is then the *default* group. :class:`RegistryParallelDims` keeps torchtitan's names, sizes and
lookups (``get_mesh``, ``get_optional_mesh``, ``spmd_meshes`` ...) and only replaces where the meshes
come from: ``registry.device_mesh([...])`` over roles and dims, so every name torchtitan asks for is a
registry group, never the default group. Flattening a registry mesh (FSDP2's
``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``) returns the fsdp role's group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh

from commgroups.errors import LayoutError, MeshRequestError, RegistryNotCreatedError
from commgroups.integrations.torchtitan.titan_internals import (
    FULL_DTENSOR,
    ParallelDims,
    fill_meshes,
    log_mesh_building,
    log_meshes_built,
    set_spmd_meshes,
    single_axis_meshes,
    spmd_backends,
    validate_meshes,
)
from commgroups.torch_internals import groupless_mesh

if TYPE_CHECKING:
    from commgroups.registry import GroupRegistry

__all__ = ["LOSS_MESH_DIM", "PlaceholderMesh", "RegistryParallelDims", "placeholder_mesh"]

DENSE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

LOSS_MESH_DIM = "loss_mesh"
"""The dim name of torchtitan's loss mesh: stock's ``dataloading["batch", "cp"]._flatten("loss_mesh")``
(0.3.0). ``get_mesh("loss")`` finds it by torchtitan's key ``"loss"``, as stock's."""


class PlaceholderMesh(DeviceMesh):
    """A size-only DeviceMesh (the MoE ``efsdp``/``ep`` view when ep == 1): asking it for a group
    raises :class:`~commgroups.errors.MeshRequestError` that names the dims and what to use.

    Stock torchtitan returns a fake-backend group there, whose collectives silently move no data;
    commgroups refuses instead (the guide's torchtitan section lists this difference).
    """

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """Refused: the placeholder has no process group (see the class docs)."""
        names = ", ".join(self.mesh_dim_names or ())
        raise MeshRequestError(
            f"torchtitan's {names} mesh is a placeholder with ep == 1: it has no process group; "
            "fix: use parallel_dims.get_optional_mesh(...) (None when ep == 1) or set "
            "parallelism.expert_parallel_degree > 1",
            field="parallelism.expert_parallel_degree",
        )

    def get_all_groups(self) -> list[Any]:
        """Refused, as :meth:`get_group`."""
        return [self.get_group()]


def placeholder_mesh(shape: tuple[int, ...], names: tuple[str, ...], device: str) -> DeviceMesh:
    """A DeviceMesh with torchtitan's shape and names but no process group at all.

    torchtitan keeps meshes it never communicates on (the MoE ``efsdp``/``ep`` view when ep == 1)
    only for their sizes, on torch's fake backend. Here they get no group: ``get_group()`` raises
    :class:`~commgroups.errors.MeshRequestError` (a :class:`PlaceholderMesh`) and nothing runs
    anywhere. The mesh holds this rank's block of the world, row-major.

    (:func:`commgroups.torch_internals.groupless_mesh`.)
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    size = 1
    for s in shape:
        size *= s
    first = rank - rank % size
    mesh = torch.arange(first, first + size, dtype=torch.int).reshape(shape)
    placeholder: DeviceMesh = groupless_mesh(device, mesh, names)
    # torch_internals builds the mesh (DeviceMesh's private constructor arguments); the subclass
    # changes only what asking it for a group says.
    placeholder.__class__ = PlaceholderMesh
    return placeholder


@dataclass
class RegistryParallelDims(ParallelDims):
    """``ParallelDims`` whose ``build_mesh()`` takes every mesh from ``registry``.

    Fills the same attributes as stock (through
    :func:`~commgroups.integrations.torchtitan.titan_internals.fill_meshes`), so torchtitan's lookups
    behave as stock does. ``_world_mesh`` is the registry's
    dense mesh ``(pp, dp_replicate, dp_shard, cp, tp)``: torchtitan uses it only for its device
    (DTensor's RNG seed), and a 1-D world group would be one more communicator for nothing.

    Example::

        pd = RegistryParallelDims.from_config(config.parallelism, world_size)
        pd.registry = registry            # a created GroupRegistry for titan_layout(...)
        pd.build_mesh()
        pd.get_mesh("cp").get_group() is registry.group("cp")
    """

    registry: GroupRegistry | None = field(default=None, repr=False, compare=False)

    def _registry(self) -> GroupRegistry:
        if self.registry is None or not self.registry.created:
            raise RegistryNotCreatedError(
                "RegistryParallelDims.build_mesh() needs a created GroupRegistry; fix: set "
                "parallel_dims.registry (commgroups.integrations.torchtitan.with_registry does)"
            )
        return self.registry

    def build_mesh(self) -> DeviceMesh:
        """Build every mesh torchtitan asks for from the registry's groups; returns the world mesh.

        Logs torchtitan's own two mesh lines (parallelism, then the active dimensions), as stock.

        Raises:
            RegistryNotCreatedError: ``registry`` is unset or not created (a RuntimeError).
            LayoutError: ``spmd_backend`` is not one the installed torchtitan has
                (:func:`~commgroups.integrations.torchtitan.titan_internals.spmd_backends`:
                ``full_dtensor`` only where torchtitan still ships it).
        """
        registry = self._registry()
        self._check_backend()
        log_mesh_building(self)
        mesh = registry.device_mesh
        world = mesh(list(DENSE))
        dataloading = mesh(["pp", "batch", "cp", "tp"])
        loss = self._loss_mesh(mesh("loss"))
        spmd_dense: DeviceMesh | None = None
        if self.spmd_backend == "spmd_types":
            candidate_dense = ["dp", "cp", "tp"]
            dense = world
            spmd_dense = mesh(["pp", "dp", "cp", "tp"])["dp", "cp", "tp"]
        elif self.spmd_backend == FULL_DTENSOR:
            # Parameters carry a cp axis of their own (activations are sharded on it), so dp_shard
            # and cp stay two axes; FSDP2 flattens them itself (dp_shard_cp: the fsdp role's group).
            candidate_dense = ["dp_replicate", "dp_shard", "cp", "tp"]
            dense = world
        else:
            candidate_dense = ["dp_replicate", "fsdp", "tp"]
            dense = mesh(["pp", "dp_replicate", "fsdp", "tp"])
        sparse_names = ("pp", "dp_replicate", "efsdp", "ep")
        if self.ep > 1:
            sparse = mesh(list(sparse_names))
            efsdp_mesh, ep_mesh = sparse["efsdp"], sparse["ep"]
        else:
            # torchtitan never communicates on the MoE view without expert parallelism: it keeps
            # it for sizes only (on torch's fake backend). No group at all here.
            efsdp = self.dp_shard * self.cp * self.tp
            device = dense.device_type
            sparse = placeholder_mesh((self.pp, self.dp_replicate, efsdp, 1), sparse_names, device)
            efsdp_mesh = placeholder_mesh((efsdp,), ("efsdp",), device)
            ep_mesh = placeholder_mesh((1,), ("ep",), device)

        global_meshes = {"dataloading": dataloading, "loss": loss, "dense": dense,
                         "sparse": sparse}
        if spmd_dense is not None:
            global_meshes["spmd_dense_for_fwdbwd"] = spmd_dense
        if self.spmd_backend == "spmd_types" and self.ep > 1:
            global_meshes["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
        single_axis = {
            "pp": dataloading["pp"],
            "batch": dataloading["batch"],
            "loss": loss,
            "dp_replicate": dense["dp_replicate"],
            "cp": dataloading["cp"],
            "tp": dataloading["tp"],
            "ep": ep_mesh,
            "efsdp": efsdp_mesh,
        }
        if spmd_dense is not None:
            single_axis["dp"] = spmd_dense["dp"]
        if self.spmd_backend in ("spmd_types", FULL_DTENSOR):
            single_axis["dp_shard"] = dense["dp_shard"]
        else:
            single_axis["fsdp"] = dense["fsdp"]
        fill_meshes(self, world=world, global_meshes=global_meshes, single_axis=single_axis)
        validate_meshes(self)
        activated = [self.get_activated_mesh(candidate_dense),
                     self.get_activated_mesh(["dp_replicate", "efsdp", "ep"])]
        set_spmd_meshes(self, [m for m in activated if m is not None])
        log_meshes_built(self)
        return world

    def _check_backend(self) -> None:
        backends = spmd_backends()
        if self.spmd_backend in backends:
            return
        if self.spmd_backend == FULL_DTENSOR:
            raise LayoutError(
                "parallelism.spmd_backend='full_dtensor': this torchtitan has no full_dtensor "
                "backend (torchtitan main removed it, pytorch/torchtitan#4217); fix: use "
                f"--parallelism.spmd_backend with one of {', '.join(backends)}",
                field="parallelism.spmd_backend",
            )
        raise LayoutError(
            f"parallelism.spmd_backend={self.spmd_backend!r} is not one commgroups builds meshes "
            f"for; fix: use one of {', '.join(backends)}",
            field="parallelism.spmd_backend",
        )

    @staticmethod
    def _loss_mesh(role_mesh: DeviceMesh) -> DeviceMesh:
        """The loss role's group as a 1-D mesh named as stock names it (:data:`LOSS_MESH_DIM`).

        Stock flattens ``batch x cp`` into a dim named ``loss_mesh``; the registry names a role's
        mesh after the role. Code that reads ``mesh_dim_names`` sees stock's name; the group is the
        loss role's (``DeviceMesh.from_group`` wraps it, creating nothing).
        """
        return DeviceMesh.from_group(role_mesh.get_group(), role_mesh.device_type,
                                     mesh_dim_names=(LOSS_MESH_DIM,))

    def mesh_groups(self) -> dict[str, Any]:
        """Name -> the ProcessGroup of each 1-D mesh torchtitan holds (None for placeholders)."""
        groups: dict[str, Any] = {}
        for name, one in single_axis_meshes(self).items():
            try:
                groups[name] = one.get_group()
            except (MeshRequestError, RuntimeError, AttributeError, AssertionError, IndexError):
                groups[name] = None
        return groups

