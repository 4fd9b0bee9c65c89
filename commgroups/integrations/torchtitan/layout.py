"""The commgroups Layout of a torchtitan job, derived from its parallelism degrees (no torchtitan import).

torchtitan factorizes the world as ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first) and
asks for meshes by name. Every name becomes a registry role, so each gets a dedicated group:

- one role per dim of size > 1 (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``);
- ``batch`` and ``dp`` over ``dp_replicate x dp_shard`` (data loading; spmd_types' data axis),
  ``loss`` over ``dp_replicate x dp_shard x cp``, ``fsdp`` over ``dp_shard x cp``;
- with expert parallelism, the view ``sparse`` re-factorizes the same world as
  ``pp x dp_replicate x efsdp x ep`` (``efsdp = dp_shard * cp * tp / ep``), with roles ``efsdp``,
  ``ep`` and (when efsdp > 1 and cp == tp == 1) ``efsdp_ep`` on it, the last for the experts'
  grad-norm reduction;
- ``checkpoint-metadata`` over the world on gloo (DCP's plan exchange).

A layout the user gives (object or file) may set per-role backend, options and timeouts; it must
agree with the degrees, and roles it leaves out are added from the derived layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commgroups.errors import InvalidSizeError, InvalidViewError, UnknownDimError
from commgroups.layout.layout_io import load_layout_data
from commgroups.layout.specs import Layout, RoleSpec, checkpoint_role, dim_roles
from commgroups.util.error_text import first_fitting

__all__ = [
    "DENSE_DIMS",
    "EXPERT_NORM_ROLE",
    "SPARSE_VIEW",
    "LayoutArg",
    "TitanDegrees",
    "derived_roles",
    "fit_titan_layout",
    "resolve_layout",
    "titan_layout",
]

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's world factorization, outermost first (``ParallelDims.build_mesh``)."""

EXPERT_NORM_ROLE = "efsdp_ep"
"""The role over the MoE region ``efsdp x ep`` (torch's default flatten name for those dims):
carries the experts' merged grad-norm reduction (:func:`derived_roles`)."""

SPARSE_VIEW = "sparse"
"""The name of the MoE view ``pp x dp_replicate x efsdp x ep`` in the layout."""

LayoutArg = Layout | Mapping[str, Any] | str | Path | None
"""What ``with_registry(layout=...)`` takes: a Layout, a dict in the layout-file shape, a file."""

# Roles over several dims, named as torchtitan names the meshes (each a 1-D mesh axis).
_COMPOSITE_ROLES: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "fsdp": ("dp_shard", "cp"),
}

# ParallelismConfig field -> dim.
_CONFIG_FIELDS: dict[str, str] = {
    "pipeline_parallel_degree": "pp",
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "context_parallel_degree": "cp",
    "tensor_parallel_degree": "tp",
    "expert_parallel_degree": "ep",
}


@dataclass(frozen=True)
class TitanDegrees:
    """torchtitan's parallelism degrees, ``dp_shard`` resolved (``-1`` takes the remaining ranks).

    Example::

        degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1)
        degrees.efsdp   # 4
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    spmd_backend: str = "spmd_types"

    @property
    def dense(self) -> dict[str, int]:
        """The dense factorization, outermost first."""
        return {dim: getattr(self, dim) for dim in DENSE_DIMS}

    @property
    def world_size(self) -> int:
        """The product of the dense degrees."""
        return math.prod(self.dense.values())

    @property
    def efsdp(self) -> int:
        """FSDP degree inside the MoE region: ``dp_shard * cp * tp / ep``."""
        return self.dp_shard * self.cp * self.tp // self.ep


def derived_roles(degrees: TitanDegrees) -> list[RoleSpec]:
    """The roles torchtitan's mesh names need, in creation order (see the module docs).

    Built from the same definitions as the built-in roles (:func:`commgroups.layout.specs.dim_roles` first,
    :func:`commgroups.layout.specs.checkpoint_role` last), with torchtitan's composite names between.
    """
    roles = dim_roles(degrees.dense)
    roles += [RoleSpec(name=name, dims=list(dims)) for name, dims in _COMPOSITE_ROLES.items()]
    if degrees.spmd_backend == "spmd_types":
        # spmd_types' forward/backward mesh calls dp_replicate x dp_shard "dp".
        roles.append(RoleSpec(name="dp", dims=["dp_replicate", "dp_shard"]))
    if degrees.ep > 1:
        roles += [RoleSpec(name="efsdp", dims=["efsdp"]), RoleSpec(name="ep", dims=["ep"])]
        if degrees.efsdp > 1 and degrees.cp == degrees.tp == 1:
            # The experts' grad norm is Partial over efsdp and ep; DTensor merges the two reductions
            # into one on a flattening of the root mesh with their layout. Stock finds one (a
            # world-spanning flatten of its world mesh, the default group); this role is that
            # flattening on the sparse mesh, so the norm takes one collective, as stock's
            # (moe-dps4-ep2). With cp or tp the dense grads are Partial over several dims of the
            # same ranks, and DTensor would find this role by layout for their reduction too,
            # where stock merges nothing (moe-dps2-tp2-ep2: one collective a step moved onto it).
            roles.append(RoleSpec(name=EXPERT_NORM_ROLE, dims=["efsdp", "ep"]))
    roles.append(checkpoint_role())
    return roles


def _views(degrees: TitanDegrees) -> dict[str, dict[str, int]]:
    if degrees.ep == 1:
        return {}
    return {SPARSE_VIEW: {"pp": degrees.pp, "dp_replicate": degrees.dp_replicate,
                          "efsdp": degrees.efsdp, "ep": degrees.ep}}


def _layout(dims: dict[str, int], roles: list[RoleSpec], degrees: TitanDegrees) -> Layout:
    return Layout(dims=dims, roles=roles, views=_views(degrees))


def titan_layout(degrees: TitanDegrees) -> Layout:
    """The layout commgroups derives for torchtitan's ``degrees`` (see the module docs).

    Example::

        layout = titan_layout(TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1))
        layout.role("fsdp").dims   # ['dp_shard', 'cp']
    """
    return _layout(degrees.dense, derived_roles(degrees), degrees)


def _role_dims(role: RoleSpec) -> Any:
    return role.dims if role.ranks is None else role.ranks


def _shown(dims: Mapping[str, int]) -> str:
    return " x ".join(f"{d}={s}" for d, s in dims.items()) or "(none)"


def _given_data(layout: Layout | Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The given layout as a mapping, not yet validated (its size-1 dims may be missing)."""
    if isinstance(layout, Layout):
        return layout.model_dump(mode="json")
    if isinstance(layout, (str, Path)):
        return load_layout_data(layout)
    if isinstance(layout, Mapping):
        return dict(layout)
    raise TypeError(
        f"with_registry(layout=...) takes a commgroups.Layout, a dict or a layout file path, got "
        f"{type(layout).__name__}"
    )


def _check_dims(given: Any, degrees: TitanDegrees) -> None:
    """The given dims must be torchtitan dims with torchtitan's sizes (missing ones are size 1)."""
    if not isinstance(given, Mapping):
        raise UnknownDimError(
            f"layout dims: expected a table of torchtitan dims ({', '.join(DENSE_DIMS)}) with their "
            f"sizes, got {given!r}; fix: e.g. dims = {{ cp = 4 }}",
            field="dims",
        )
    for dim in given:
        if dim not in DENSE_DIMS:
            raise UnknownDimError(
                f"layout dims: {dim!r} is not a torchtitan dim; fix: use only "
                f"{', '.join(DENSE_DIMS)} (expert parallelism is set by "
                "parallelism.expert_parallel_degree)",
                field=f"dims.{dim}",
            )
    wanted = degrees.dense
    have = {dim: given.get(dim, 1) for dim in DENSE_DIMS}
    if have == wanted:
        return
    layout_ranks = math.prod(v for v in have.values() if isinstance(v, int))
    flags = " ".join(f"--parallelism.{option} {have[dim]}" for option, dim in _CONFIG_FIELDS.items()
                     if dim in wanted and have[dim] != wanted[dim])
    if layout_ranks == degrees.world_size:
        launches = [f"or launch with {flags}",
                    "or launch with the layout's degrees (--parallelism.*_degree)"]
    else:
        launches = [f"(it covers {layout_ranks} ranks, the job {degrees.world_size}, so no launch "
                    "option can match it)"] * 2
    # The whole of both factorizations (size-1 dims left out count as 1), not the first mismatch.
    target = f"{{ {', '.join(f'{d} = {s}' for d, s in wanted.items() if s > 1) or 'pp = 1'} }}"
    candidates = [
        f"layout dims {_shown(have)} ({layout_ranks} ranks) vs torchtitan's parallelism {titan}; "
        f"fix: set the layout's dims to {target} {launch}"
        for titan in (f"{_shown(wanted)} ({degrees.world_size} ranks)", f"({degrees.world_size} ranks)")
        for launch in launches
    ]
    raise InvalidSizeError(first_fitting(*candidates), field="dims")


def fit_titan_layout(layout: LayoutArg, degrees: TitanDegrees, *,
                     async_and_wait: bool = True) -> Layout:
    """The layout a torchtitan job runs on: derived from ``degrees``, or ``layout`` checked against them.

    Not :func:`commgroups.resolve_layout` (which sizes an AutoLayout's ``"auto"`` dim by the world
    size): this one fits a layout to torchtitan's parallelism degrees. ``resolve_layout`` here is
    its old name, kept as an alias.

    A given layout (a :class:`~commgroups.Layout`, a dict in the layout-file shape, or a TOML/YAML/
    JSON file) names torchtitan dims with torchtitan's sizes; dims of size 1 may be left out, also
    when a role names them (they are added, in torchtitan's order). Its roles override the derived
    roles of the same name (which must span the same dims) and keep their backend, options,
    timeout and async_and_wait; derived roles it does not declare are added.

    Args:
        layout: None (the derived layout), or the given layout.
        degrees: torchtitan's parallelism degrees.
        async_and_wait: False turns async-and-wait off for every role, the given ones included.

    Raises:
        InvalidSizeError: the layout's dims disagree with the degrees; the message shows both
            factorizations whole and what would make them agree.
        UnknownDimError: a dim that is not torchtitan's, or a role spanning other dims than
            torchtitan's mesh of that name.
        LayoutError: anything else wrong with the given layout (see :class:`~commgroups.Layout`).
    """
    derived = titan_layout(degrees)
    if layout is None:
        roles = list(derived.roles)
    else:
        data = _given_data(layout)
        _check_dims(data.get("dims", {}), degrees)
        views = data.get("views") or {}
        if views and views != derived.views:
            raise InvalidViewError(
                f"layout views {views} differ from torchtitan's {derived.views or '(none)'}; fix: "
                "leave views out (commgroups derives the MoE view from the parallelism degrees)",
                field="views",
            )
        given = Layout.model_validate({**data, "dims": derived.dims, "views": derived.views})
        wanted = {role.name: role for role in derived.roles}
        for index, role in enumerate(given.roles):
            want = wanted.get(role.name)
            if want is not None and _role_dims(role) != _role_dims(want):
                raise UnknownDimError(
                    f"layout roles[{index}] {role.name!r} spans {_role_dims(role)} but torchtitan's "
                    f"{role.name!r} mesh spans {_role_dims(want)}; fix: set dims = "
                    f"{_role_dims(want)} or rename the role",
                    field=f"roles[{index}].dims",
                )
        given_names = {role.name for role in given.roles}
        roles = list(given.roles) + [r for r in derived.roles if r.name not in given_names]
    if not async_and_wait:
        roles = [r.model_copy(update={"async_and_wait": False}) for r in roles]
    return _layout(degrees.dense, roles, degrees)


resolve_layout = fit_titan_layout
"""Alias of :func:`fit_titan_layout` (the name before 0.2; :func:`commgroups.resolve_layout` is
another function)."""
