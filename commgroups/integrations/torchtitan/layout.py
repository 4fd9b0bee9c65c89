"""The commgroups Layout of a torchtitan job, derived from its parallelism degrees (no torchtitan import).

torchtitan factorizes the world as ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first) and
asks for meshes by name. Every name becomes a registry role, so each gets a dedicated group:

- one role per dim of size > 1 (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``);
- ``batch`` and ``dp`` over ``dp_replicate x dp_shard`` (data loading; spmd_types' data axis),
  ``loss`` over ``dp_replicate x dp_shard x cp``, ``fsdp`` over ``dp_shard x cp``;
- with expert parallelism, the view ``sparse`` re-factorizes the same world as
  ``pp x dp_replicate x efsdp x ep`` (``efsdp = dp_shard * cp * tp / ep``), with roles ``efsdp`` and
  ``ep`` on it;
- ``checkpoint-metadata`` over the world on gloo (DCP's plan exchange).

A layout the user gives (object or file) may set per-role backend, options and timeouts; it must
agree with the degrees, and roles it leaves out are added from the derived layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commgroups.errors import InvalidSizeError, LayoutError, UnknownDimError
from commgroups.layout_io import load_layout
from commgroups.specs import CHECKPOINT_ROLE, Layout, RoleSpec

__all__ = [
    "DENSE_DIMS",
    "SPARSE_VIEW",
    "TitanDegrees",
    "derived_roles",
    "resolve_layout",
    "titan_layout",
]

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's world factorization, outermost first (``ParallelDims.build_mesh``)."""

SPARSE_VIEW = "sparse"
"""The name of the MoE view ``pp x dp_replicate x efsdp x ep`` in the layout."""

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

        degrees = TitanDegrees.from_parallelism(config.parallelism, world_size=4)
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    spmd_backend: str = "spmd_types"

    @classmethod
    def from_parallelism(cls, parallelism: Any, world_size: int) -> TitanDegrees:
        """Degrees from a torchtitan ``ParallelismConfig`` (duck-typed) for ``world_size`` ranks.

        Raises:
            InvalidSizeError: a degree is < 1 (``dp_shard`` may be -1), or the product of the dense
                degrees is not the world size, or ``ep`` does not divide ``dp_shard * cp * tp``.
        """
        sizes = {dim: int(getattr(parallelism, name)) for name, dim in _CONFIG_FIELDS.items()}
        for name, dim in _CONFIG_FIELDS.items():
            if sizes[dim] < 1 and not (dim == "dp_shard" and sizes[dim] == -1):
                raise InvalidSizeError(
                    f"parallelism.{name}={sizes[dim]}: degrees must be >= 1 (dp_shard may be -1); "
                    f"fix: set parallelism.{name}",
                    field=f"parallelism.{name}",
                )
        if sizes["dp_shard"] == -1:
            others = math.prod(sizes[d] for d in DENSE_DIMS if d != "dp_shard")
            sizes["dp_shard"] = max(world_size // others, 1)
        degrees = cls(spmd_backend=str(getattr(parallelism, "spmd_backend", "spmd_types")),
                      **sizes)
        degrees.check_world(world_size)
        return degrees

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

    def check_world(self, world_size: int) -> None:
        """Raise InvalidSizeError unless the degrees describe ``world_size`` ranks."""
        if self.world_size != world_size:
            shown = " x ".join(f"{d}={s}" for d, s in self.dense.items())
            raise InvalidSizeError(
                f"parallelism: {shown} = {self.world_size} ranks but the job has {world_size}; "
                "fix: make the product of the degrees equal the world size (or set "
                "data_parallel_shard_degree = -1)",
                field="parallelism",
            )
        if (self.dp_shard * self.cp * self.tp) % self.ep:
            raise InvalidSizeError(
                f"parallelism.expert_parallel_degree={self.ep} does not divide dp_shard x cp x tp "
                f"= {self.dp_shard * self.cp * self.tp}; fix: pick an ep that divides it",
                field="parallelism.expert_parallel_degree",
            )


def _views_supported() -> bool:
    return "views" in Layout.model_fields


def derived_roles(degrees: TitanDegrees) -> list[RoleSpec]:
    """The roles torchtitan's mesh names need, in creation order (see the module docs)."""
    roles = [RoleSpec(name=dim, dims=[dim]) for dim, size in degrees.dense.items() if size > 1]
    roles += [RoleSpec(name=name, dims=list(dims)) for name, dims in _COMPOSITE_ROLES.items()]
    if degrees.spmd_backend == "spmd_types":
        # spmd_types' forward/backward mesh calls dp_replicate x dp_shard "dp".
        roles.append(RoleSpec(name="dp", dims=["dp_replicate", "dp_shard"]))
    if degrees.ep > 1:
        roles += [RoleSpec(name="efsdp", dims=["efsdp"]), RoleSpec(name="ep", dims=["ep"])]
    roles.append(RoleSpec(name=CHECKPOINT_ROLE, dims="world", backend="gloo"))
    return roles


def _layout(dims: dict[str, int], roles: list[RoleSpec], degrees: TitanDegrees) -> Layout:
    if degrees.ep == 1:
        return Layout(dims=dims, roles=roles)
    if not _views_supported():
        raise LayoutError(
            f"parallelism.expert_parallel_degree={degrees.ep}: this commgroups has no layout views "
            "(efsdp x ep re-factorizes dp_shard x cp x tp); fix: upgrade commgroups, or run with "
            "expert_parallel_degree = 1",
            field="parallelism.expert_parallel_degree",
        )
    sparse = {"pp": degrees.pp, "dp_replicate": degrees.dp_replicate, "efsdp": degrees.efsdp,
              "ep": degrees.ep}
    return Layout(dims=dims, roles=roles, views={SPARSE_VIEW: sparse})  # type: ignore[call-arg]


def titan_layout(degrees: TitanDegrees) -> Layout:
    """The layout commgroups derives for torchtitan's ``degrees`` (see the module docs).

    Example::

        layout = titan_layout(TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1))
        layout.role("fsdp").dims   # ['dp_shard', 'cp']
    """
    return _layout(degrees.dense, derived_roles(degrees), degrees)


def _role_dims(role: RoleSpec) -> Any:
    return role.dims if role.ranks is None else role.ranks


def resolve_layout(layout: Layout | str | Path | None, degrees: TitanDegrees) -> Layout:
    """The layout a torchtitan job runs on: derived from ``degrees``, or ``layout`` checked against them.

    A given layout (a :class:`~commgroups.Layout` or a TOML/YAML/JSON file) must have the dense dims
    in torchtitan's order with the same sizes (size-1 dims may be left out; they are added). Its
    roles override the derived roles of the same name (which must span the same dims) and keep their
    backend, options, timeout and async_and_wait; derived roles it does not declare are added.

    Raises:
        LayoutError: a dim size or a role's dims disagree with the parallelism degrees; the message
            names the layout's value and torchtitan's.
    """
    derived = titan_layout(degrees)
    if layout is None:
        return derived
    given = load_layout(layout) if isinstance(layout, (str, Path)) else layout
    if not isinstance(given, Layout):
        raise TypeError(
            f"with_registry(layout=...) takes a commgroups.Layout or a layout file path, got "
            f"{type(given).__name__}"
        )
    for dim in given.dims:
        if dim not in derived.dims:
            raise UnknownDimError(
                f"layout dims: {dim!r} is not a torchtitan dim; fix: use only "
                f"{', '.join(DENSE_DIMS)} (expert parallelism is set by "
                "parallelism.expert_parallel_degree)",
                field=f"dims.{dim}",
            )
    for dim, size in degrees.dense.items():
        have = given.dims.get(dim, 1)
        if have != size:
            option = next(name for name, d in _CONFIG_FIELDS.items() if d == dim)
            raise InvalidSizeError(
                f"layout dims.{dim}={have} but torchtitan's parallelism.{option} gives "
                f"{dim}={size}; fix: make them agree (set dims.{dim} = {size} in the layout, or "
                f"--parallelism.{option} {have})",
                field=f"dims.{dim}",
            )
    order = [dim for dim in DENSE_DIMS if dim in given.dims]
    if list(given.dims) != order:
        raise UnknownDimError(
            f"layout dims are in the order {list(given.dims)}; torchtitan's order is {order}; "
            "fix: list dims outermost first as torchtitan does (pp, dp_replicate, dp_shard, cp, tp)",
            field="dims",
        )
    wanted = {role.name: role for role in derived.roles}
    for index, role in enumerate(given.roles):
        want = wanted.get(role.name)
        if want is not None and _role_dims(role) != _role_dims(want):
            raise UnknownDimError(
                f"layout roles[{index}] {role.name!r} spans {_role_dims(role)} but torchtitan's "
                f"{role.name!r} mesh spans {_role_dims(want)}; fix: set dims = {_role_dims(want)} "
                "or rename the role",
                field=f"roles[{index}].dims",
            )
    given_names = {role.name for role in given.roles}
    roles = list(given.roles) + [r for r in derived.roles if r.name not in given_names]
    return _layout(degrees.dense, roles, degrees)
