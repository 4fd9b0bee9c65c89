"""DeviceMeshes built from a registry's own groups, checked against the plan.

``DeviceMesh.from_group`` wraps groups without creating any and without checking that they match the
mesh rows; this module builds the mesh tensor from the plan and checks every row itself. It never calls
``_flatten()``: a flattened dim that spans the world comes back as the default group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commgroups.plan import Plan

__all__ = ["build_mesh", "mesh_block"]


def mesh_block(plan: Plan, rank: int, dims: Sequence[str]) -> np.ndarray:
    """The block of the global rank grid that holds ``rank``, over ``dims`` (others fixed)."""
    coords = plan.coords(rank)
    base = sum(
        coords[name] * stride
        for name, stride in zip(plan.dim_names, plan.dim_strides)
        if name not in dims
    )
    block = np.full((1,) * 0, base, dtype=np.int64)
    for dim in dims:
        i = plan.dim_names.index(dim)
        steps = np.arange(plan.dim_sizes[i], dtype=np.int64) * plan.dim_strides[i]
        block = block[..., None] + steps
    return block


def build_mesh(
    plan: Plan,
    rank: int,
    dims: Sequence[str],
    groups: Sequence[dist.ProcessGroup],
    device_type: str,
    names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A DeviceMesh over ``dims`` whose dim ``i`` uses ``groups[i]``; rows checked against the plan."""
    block = mesh_block(plan, rank, dims)
    coords = plan.coords(rank)
    for axis, (dim, group) in enumerate(zip(dims, groups)):
        index = tuple(
            slice(None) if j == axis else coords[other] for j, other in enumerate(dims)
        )
        expected = block[index].tolist()
        actual = dist.get_process_group_ranks(group)
        if actual != expected:
            raise RuntimeError(
                f"group for mesh dim {dim!r} has ranks {actual}, but the plan's row through rank "
                f"{rank} is {expected}; this is a commgroups bug, please report it"
            )
    mesh_names = tuple(names or dims)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=mesh_names)
    return DeviceMesh.from_group(
        list(groups),
        device_type,
        mesh=torch.from_numpy(block).to(torch.int),
        mesh_dim_names=mesh_names,
    )
