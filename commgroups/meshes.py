"""DeviceMeshes built from a registry's own groups, checked against the plan.

``DeviceMesh.from_group`` wraps groups without creating any and without checking that they match the
mesh rows; this module builds the mesh tensor from the plan and checks every row itself. It never calls
``_flatten()``: a flattened dim that spans the world comes back as the default group. A mesh axis is a
layout dim or a whole role (its dims flattened row-major, on the role's own group), so an HSDP mesh
``(dp_replicate, fsdp)`` is two dedicated groups, not a flatten.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commgroups.plan import Plan

__all__ = ["build_mesh", "mesh_block"]

Axis = Sequence[str]
"""One mesh axis: the layout dims it spans (one dim, or a role's dims flattened row-major)."""


def _axis_index(plan: Plan, coords: dict[str, int], axis: Axis) -> int:
    index = 0
    for dim in axis:
        index = index * plan.layout.dims[dim] + coords[dim]
    return index


def mesh_block(plan: Plan, rank: int, axes: Sequence[Axis]) -> np.ndarray:
    """The block of the global rank grid that holds ``rank``, one array dim per axis (others fixed)."""
    coords = plan.coords(rank)
    spanned = {dim for axis in axes for dim in axis}
    base = sum(
        coords[name] * stride
        for name, stride in zip(plan.dim_names, plan.dim_strides)
        if name not in spanned
    )
    block = np.full((), base, dtype=np.int64)
    for axis in axes:
        block = block[..., None] + plan.offsets(axis)
    return block


def build_mesh(
    plan: Plan,
    rank: int,
    axes: Sequence[Axis],
    groups: Sequence[dist.ProcessGroup],
    device_type: str,
    names: Sequence[str],
) -> DeviceMesh:
    """A DeviceMesh whose dim ``i`` spans ``axes[i]`` on ``groups[i]``; rows checked against the plan."""
    block = mesh_block(plan, rank, axes)
    coords = plan.coords(rank)
    position = [_axis_index(plan, coords, axis) for axis in axes]
    for i, (name, group) in enumerate(zip(names, groups)):
        index = tuple(slice(None) if j == i else position[j] for j in range(len(axes)))
        expected = block[index].tolist()
        actual = dist.get_process_group_ranks(group)
        if actual != expected:
            raise RuntimeError(
                f"group for mesh dim {name!r} has ranks {actual}, but the plan's row through rank "
                f"{rank} is {expected}; this is a commgroups bug, please report it"
            )
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=tuple(names))
    return DeviceMesh.from_group(
        list(groups),
        device_type,
        mesh=torch.from_numpy(block).to(torch.int),
        mesh_dim_names=tuple(names),
    )
