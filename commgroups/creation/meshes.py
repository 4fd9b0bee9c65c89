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

from commgroups import torch_internals
from commgroups.errors import ArgumentError, DimOrderError, UnknownDimError
from commgroups.layout import limits
from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan
from commgroups.util.error_text import listed

__all__ = [
    "axes_in_order",
    "build_mesh",
    "check_mesh_request",
    "forget_flattenings",
    "mesh_block",
    "mesh_names",
    "register_flattening",
]

Axis = Sequence[str]
"""One mesh axis: the layout dims it spans (one dim, or a role's dims flattened row-major)."""


def mesh_block(plan: Plan, rank: int, axes: Sequence[Axis]) -> np.ndarray:
    """The block of global ranks that holds ``rank``, one array dim per axis (others fixed).

    Axes may take their dims from the layout's dims or from any view. Example: dims
    ``{"dp_shard": 2, "cp": 2}``, axes ``[["dp_shard"], ["cp"]]``: every rank gets
    ``[[0, 1], [2, 3]]``; axes ``[["cp"]]``: rank 0 and 1 get ``[0, 1]``, rank 2 and 3 ``[2, 3]``.
    On a plan with ``members`` (after a rank loss) the block holds their global ranks.
    """
    return plan.block(rank, axes)


def axes_in_order(plan: Plan, axes: Sequence[Axis]) -> bool:
    """True when ``axes`` are a mesh in layout order: disjoint, outermost first.

    That is exactly when the block, read row-major, lists its ranks in increasing order (a repeated
    rank or a transposed pair of axes breaks it), whichever factorizations the axes come from.
    """
    first = plan.members[0] if plan.members is not None else 0
    block = mesh_block(plan, first, axes).reshape(-1)
    return bool(np.all(block[1:] > block[:-1]))


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
    position = [plan.index_along(rank, axis) for axis in axes]
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


def register_flattening(mesh: DeviceMesh, dim_names: Sequence[str], key: str,
                        group: dist.ProcessGroup) -> bool:
    """Make ``mesh[dim_names]._flatten(key)`` return a 1-D mesh on ``group``, creating nothing.

    Third-party code flattens meshes it was handed (FSDP2's ``fully_shard(..., dp_mesh_dims=...)``
    calls ``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``); torch then makes a new group, the
    *default* group when the flattened dims span the world. torch returns an existing entry of the
    root mesh's flatten mapping when its layout matches, so the registry pre-registers its role's
    mesh there. Returns False (nothing registered) where this torch's DeviceMesh lacks the
    internals; the caller logs it.

    The DeviceMesh internals this needs are reached through
    :func:`commgroups.torch_internals.register_flattened_mesh` (checked on 2.10-2.15).
    """
    return torch_internals.register_flattened_mesh(mesh, dim_names, key, group)


def forget_flattenings(mesh: DeviceMesh) -> None:
    """Drop ``mesh``'s flatten mapping, breaking the root <-> flattened-mesh reference cycle.

    Without it the meshes (and through them the destroyed groups' gloo sockets) live until the
    garbage collector's next cycle pass: 100 create/close cycles leaked ~3 fds each.

    The mapping is private torch, reached through :mod:`commgroups.torch_internals`.
    """
    torch_internals.clear_flatten_mapping(mesh)


def mesh_names(request: object, field: str = "dims_or_role") -> tuple[str, ...]:
    """``request`` (a name or a list of names) as a tuple of names, else an ArgumentError naming
    ``field`` (``device_mesh``'s argument, or ``meshes`` for a declared mesh)."""
    names = (request,) if isinstance(request, str) else (
        tuple(request) if isinstance(request, (list, tuple)) else ())
    if not names or not all(isinstance(name, str) for name in names):
        raise ArgumentError(
            f"{field}: {limits.short_repr(request)} is not a dim or role name, nor a list of "
            "them; fix: e.g. registry.device_mesh(['dp_shard', 'cp']) or device_mesh('fsdp')",
            field=field,
        )
    return names


def check_mesh_request(layout: Layout, the_plan: Plan, names: tuple[str, ...]) -> None:
    """A declared mesh's names exist and are in layout order: checked before any group exists."""
    spans: list[tuple[str, ...]] = []
    for name in names:
        if name in layout.role_names:
            dims = the_plan.role(name).dim_names
            spans.append(dims if dims is not None else ())
        elif name in the_plan.all_dim_names:
            spans.append((name,))
        else:
            raise UnknownDimError(
                f"meshes: {name!r} is neither a dim nor a role; fix: use a dim "
                f"({listed(the_plan.all_dim_names, 80)}) or a role ({listed(layout.role_names, 80)})",
                field="meshes",
            )
    if not all(spans) or not axes_in_order(the_plan, spans):
        raise DimOrderError(
            f"meshes: {list(names)} must name distinct dims or roles over dims, in layout order "
            f"({', '.join(layout.dims)}); fix: reorder or drop overlapping names",
            field="meshes",
        )
