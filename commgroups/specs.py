"""Validated specs: the :class:`Layout` of a job and the :class:`RoleSpec` of each communicator role.

A layout names the job's mesh dims (ordered, outermost first; the world size is their product) and the
roles that need a communicator. Each role gets a dedicated process group over some of the dims (or over
the whole world, or over explicit rank groups), with its own backend, options and timeout.

Every invalid input raises a :class:`~commgroups.errors.LayoutError` subclass whose message names the
field and the fix; pydantic's ``ValidationError`` never leaks out of these classes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from commgroups.validation_errors import layout_error_from

__all__ = [
    "BACKENDS",
    "CHECKPOINT_ROLE",
    "WORLD",
    "BackendName",
    "HcclOptions",
    "Layout",
    "NcclOptions",
    "RoleOptions",
    "RoleSpec",
    "default_roles",
]

BackendName = Literal["device", "nccl", "rccl", "hccl", "gloo", "fake"]
BACKENDS: tuple[str, ...] = ("device", "nccl", "rccl", "hccl", "gloo", "fake")
WORLD = "world"
CHECKPOINT_ROLE = "checkpoint-metadata"
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_\-]*$"

# Dims that FSDP shards over in the built-in roles, following torchtitan (dp_shard x cp; "dp" is the
# common single data-parallel dim). dp_replicate stays a role of its own: HSDP replicates over it.
FSDP_DIMS = ("dp", "dp_shard", "cp")

StrictSize = Annotated[int, Strict()]


class SpecModel(BaseModel):
    """Base of every spec: immutable, unknown fields rejected, errors turned into LayoutErrors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise layout_error_from(error, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` (a mapping) into this spec, raising a LayoutError on bad input."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as error:
            raise layout_error_from(error, cls) from None


class NcclOptions(SpecModel):
    """Options for an NCCL or RCCL communicator (``ProcessGroupNCCL.Options`` and its ``config``)."""

    high_priority_stream: bool = Field(
        default=False, description="Run the group's internal stream at high priority."
    )
    cga_cluster_size: int | None = Field(default=None, ge=0, le=8, description="NCCL CGA size.")
    min_ctas: int | None = Field(default=None, ge=1, le=64, description="Minimum CTAs per kernel.")
    max_ctas: int | None = Field(default=None, ge=1, le=64, description="Maximum CTAs per kernel.")
    net_name: str | None = Field(default=None, description="NCCL network plugin name, e.g. 'IB'.")
    split_share: bool | None = Field(
        default=None,
        description="Share the parent communicator's resources (split creation only).",
    )
    blocking: bool | None = Field(
        default=None, description="NCCL blocking mode for communicator calls."
    )

    @model_validator(mode="after")
    def _ctas_ordered(self) -> Self:
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise PydanticCustomError(
                "invalid_option",
                "min_ctas ({min}) is above max_ctas ({max}); fix: make min_ctas <= max_ctas",
                {"min": self.min_ctas, "max": self.max_ctas, "field": "min_ctas"},
            )
        return self


HCCL_RESERVED_KEYS = ("hccl_buffer_size", "hccl_op_expansion_mode")


class HcclOptions(SpecModel):
    """Options for an Ascend HCCL communicator (``ProcessGroupHCCL.Options.hccl_config``)."""

    buffer_size_mb: int | None = Field(
        default=None, ge=1, description="hccl_buffer_size in MB (HCCL's default is 200 MB)."
    )
    op_expansion_mode: str | None = Field(
        default=None, description="hccl_op_expansion_mode, e.g. 'AIV'."
    )
    config: dict[str, int | str | bool] = Field(
        default_factory=dict, description="Other hccl_config keys, passed through as they are."
    )

    @field_validator("config")
    @classmethod
    def _no_reserved_keys(cls, value: dict[str, int | str | bool]) -> dict[str, int | str | bool]:
        for key, field in (("hccl_buffer_size", "buffer_size_mb"),
                           ("hccl_op_expansion_mode", "op_expansion_mode")):
            if key in value:
                raise PydanticCustomError(
                    "invalid_option",
                    "'{key}' has a typed field; fix: set {typed} instead of config.{key}",
                    {"key": key, "typed": field, "field": key},
                )
        return value


class RoleOptions(SpecModel):
    """Per-backend option sections; the backend a role resolves to picks its own section.

    Keeping a section per backend lets one layout file serve CUDA, ROCm and Ascend machines with the
    portable ``device`` backend.
    """

    nccl: NcclOptions | None = Field(default=None, description="Used by nccl and rccl groups.")
    hccl: HcclOptions | None = Field(default=None, description="Used by hccl groups.")

    def is_empty(self) -> bool:
        """True when no section is set."""
        return self.nccl is None and self.hccl is None


class RoleSpec(SpecModel):
    """One communicator role: which ranks share a group, on which backend, with which options.

    ``dims`` lists layout dims in layout order (the role gets one group per combination of the other
    dims), or is ``"world"``. ``ranks`` instead lists explicit rank groups for roles that are not a
    product of dims (an embedding group over the first and last pipeline stage); ranks listed in no
    group get no group for that role.
    """

    name: str = Field(pattern=NAME_PATTERN, description="Role name, e.g. 'cp' or 'fsdp'.")
    dims: list[str] | Literal["world"] | None = Field(
        default=None, description="Layout dims the role spans (layout order), or 'world'."
    )
    ranks: list[list[int]] | None = Field(
        default=None, description="Explicit rank groups, instead of dims."
    )
    backend: BackendName = Field(
        default="device",
        description="device (NCCL on CUDA, RCCL on ROCm, HCCL on Ascend, else gloo), or explicit.",
    )
    timeout_s: float | None = Field(
        default=None, gt=0, description="Collective timeout in seconds; None: the backend default."
    )
    options: RoleOptions = Field(default_factory=RoleOptions, description="Backend options.")
    safeguard: bool = Field(
        default=True, description="Issue this role's collectives async_op=True and wait at once."
    )

    @field_validator("dims")
    @classmethod
    def _dims_listed_once(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, list):
            if not value:
                raise PydanticCustomError(
                    "empty_dims",
                    "a role needs at least one dim; fix: list layout dims, or use dims = \"world\"",
                )
            seen: set[str] = set()
            for index, dim in enumerate(value):
                if dim in seen:
                    raise PydanticCustomError(
                        "unknown_dim",
                        "dim '{dim}' is listed twice; fix: list each dim once",
                        {"dim": dim, "field": f"[{index}]"},
                    )
                seen.add(dim)
        return value

    @field_validator("ranks")
    @classmethod
    def _rank_groups_disjoint(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        if value is None:
            return None
        if not value:
            raise PydanticCustomError(
                "empty_dims", "ranks needs at least one group; fix: list rank groups or use dims"
            )
        owner: dict[int, int] = {}
        for g, group in enumerate(value):
            if not group:
                raise PydanticCustomError(
                    "empty_dims",
                    "rank group {g} is empty; fix: give every group at least one rank",
                    {"g": g, "field": f"[{g}]"},
                )
            for rank in group:
                if rank < 0:
                    raise PydanticCustomError(
                        "invalid_size",
                        "rank {rank} is negative; fix: use global ranks >= 0",
                        {"rank": rank, "field": f"[{g}]"},
                    )
                if rank in owner:
                    raise PydanticCustomError(
                        "invalid_size",
                        "rank {rank} is in group {a} and group {b}; fix: a rank may join one group "
                        "per role, so make another role for the second group",
                        {"rank": rank, "a": owner[rank], "b": g, "field": f"[{g}]"},
                    )
                owner[rank] = g
        return [sorted(group) for group in value]

    @model_validator(mode="after")
    def _shape_and_options_fit(self) -> Self:
        if (self.dims is None) == (self.ranks is None):
            raise PydanticCustomError(
                "empty_dims",
                "role '{name}' needs exactly one of dims or ranks; fix: set dims (layout dims or "
                "\"world\") or ranks (explicit rank groups), not both",
                {"name": self.name, "field": "dims"},
            )
        allowed = {
            "device": ("nccl", "hccl"),
            "nccl": ("nccl",),
            "rccl": ("nccl",),
            "hccl": ("hccl",),
            "gloo": (),
            "fake": (),
        }[self.backend]
        for section in ("nccl", "hccl"):
            if getattr(self.options, section) is not None and section not in allowed:
                fix = (
                    f"use options.{allowed[0]}" if allowed else "remove options"
                ) + f" or change backend (options.{section} applies to "
                fix += "nccl, rccl and device)" if section == "nccl" else "hccl and device)"
                raise PydanticCustomError(
                    "unknown_option",
                    "options.{section} does not apply to backend '{backend}'; fix: {fix}",
                    {"section": section, "backend": self.backend, "fix": fix,
                     "field": f"options.{section}"},
                )
        return self

    def spans_world(self) -> bool:
        """True when the role's single group is the whole world."""
        return self.dims == WORLD


def _dim_shapes(dims: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(size, stride) of each dim of a row-major factorization, outermost first."""
    shapes: dict[str, tuple[int, int]] = {}
    stride = math.prod(dims.values())
    for name, size in dims.items():
        stride //= size
        shapes[name] = (size, stride)
    return shapes


def default_roles(dims: Mapping[str, int]) -> list[RoleSpec]:
    """Built-in roles for ``dims``, following torchtitan's conventions.

    One role per dim of size > 1 (named after the dim), ``fsdp`` over the data-parallel shard dims and
    cp (dp, dp_shard, cp: FSDP shards over dp_shard x cp; dp_replicate stays its own role for HSDP),
    and ``checkpoint-metadata`` over the world on gloo.
    """
    roles = [RoleSpec(name=dim, dims=[dim]) for dim, size in dims.items() if size > 1]
    fsdp_dims = [dim for dim in dims if dim in FSDP_DIMS]
    if fsdp_dims and math.prod(dims[d] for d in fsdp_dims) > 1:
        roles.append(RoleSpec(name="fsdp", dims=fsdp_dims))
    roles.append(RoleSpec(name=CHECKPOINT_ROLE, dims="world", backend="gloo"))
    return roles


class Layout(SpecModel):
    """The job's mesh dims and communicator roles; the single input of planning and creation.

    ``dims`` is ordered, outermost first, like ``init_device_mesh``'s shape: rank ``r`` has
    coordinates ``numpy.unravel_index(r, sizes)``. When ``roles`` is omitted, :func:`default_roles`
    supplies them.
    """

    dims: dict[str, StrictSize] = Field(description="Dim name -> size, outermost first.")
    roles: list[RoleSpec] = Field(
        default=None,  # type: ignore[assignment]  # replaced by the default roles below
        validate_default=True,
        description="Communicator roles; omitted: the built-in roles of default_roles().",
    )
    views: dict[str, dict[str, StrictSize]] = Field(
        default_factory=dict,
        description="Other factorizations of the same world (view name -> dims, outermost "
        "first), e.g. torchtitan's MoE view {pp, dp_replicate, efsdp, ep} over the same ranks.",
    )

    @field_validator("dims")
    @classmethod
    def _dims_valid(cls, value: dict[str, int]) -> dict[str, int]:
        if not value:
            raise PydanticCustomError(
                "empty_dims",
                "a layout needs at least one dim; fix: e.g. dims = {{ dp_shard = 2, cp = 4 }}",
            )
        for name, size in value.items():
            if name == WORLD or not re.match(NAME_PATTERN, name):
                raise PydanticCustomError(
                    "invalid_name",
                    "dim name '{name}' is not allowed; fix: start with a letter, use letters, "
                    "digits, '_' or '-', and do not use the reserved name 'world'",
                    {"name": name, "field": name},
                )
            if size < 1:
                raise PydanticCustomError(
                    "invalid_size",
                    "dim '{name}' has size {size}; fix: every size must be >= 1 "
                    "(use 1 for an unused dim)",
                    {"name": name, "size": size, "field": name},
                )
        return value

    @field_validator("roles", mode="before")
    @classmethod
    def _default_roles(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            dims = info.data.get("dims")
            return default_roles(dims) if dims else []
        return value

    @model_validator(mode="after")
    def _views_factor_the_world(self) -> Self:
        # A view is another row-major factorization of the same ranks; a dim name it shares with
        # dims (or another view) must name the same rank grouping, else "cp" would mean two things.
        shapes = _dim_shapes(self.dims)
        owner = dict.fromkeys(self.dims, "dims")
        for view, dims in self.views.items():
            field = f"views.{view}"
            if view == "dims" or not re.match(NAME_PATTERN, view):
                raise PydanticCustomError(
                    "invalid_name",
                    "view name '{view}' is not allowed; fix: start with a letter, use letters, "
                    "digits, '_' or '-', and do not use the reserved name 'dims'",
                    {"view": view, "field": field},
                )
            if not dims:
                raise PydanticCustomError(
                    "empty_dims", "view '{view}' has no dims; fix: list its dims with their sizes",
                    {"view": view, "field": field},
                )
            for name, size in dims.items():
                if name == WORLD or not re.match(NAME_PATTERN, name):
                    raise PydanticCustomError(
                        "invalid_name",
                        "dim name '{name}' in view '{view}' is not allowed; fix: start with a "
                        "letter, use letters, digits, '_' or '-', and not 'world'",
                        {"name": name, "view": view, "field": f"{field}.{name}"},
                    )
                if size < 1:
                    raise PydanticCustomError(
                        "invalid_size",
                        "dim '{name}' of view '{view}' has size {size}; fix: sizes must be >= 1",
                        {"name": name, "view": view, "size": size, "field": f"{field}.{name}"},
                    )
            product = math.prod(dims.values())
            if product != self.world_size:
                raise PydanticCustomError(
                    "invalid_size",
                    "view '{view}' covers {product} ranks but dims cover {world}; fix: make the "
                    "product of the view's sizes equal {world}",
                    {"view": view, "product": product, "world": self.world_size, "field": field},
                )
            for name, shape in _dim_shapes(dims).items():
                if name in shapes and shapes[name] != shape:
                    raise PydanticCustomError(
                        "invalid_size",
                        "dim '{name}' in view '{view}' groups other ranks than '{name}' in "
                        "{other} (size, stride {mine} vs {theirs}); fix: rename it in the view, or "
                        "make the sizes around it match so it means the same ranks",
                        {"name": name, "view": view, "other": owner[name], "mine": shape,
                         "theirs": shapes[name], "field": f"{field}.{name}"},
                    )
                shapes.setdefault(name, shape)
                owner.setdefault(name, field)
        return self

    def factorizations(self) -> dict[str, list[str]]:
        """Dim names of ``dims`` (key ``"dims"``) and of every view, each outermost first."""
        return {"dims": list(self.dims), **{v: list(d) for v, d in self.views.items()}}

    def _check_role_dims(self, index: int, role: str, dims: list[str]) -> None:
        factorizations = self.factorizations()
        known = list(dict.fromkeys(d for f in factorizations.values() for d in f))
        for d, dim in enumerate(dims):
            if dim not in known:
                raise PydanticCustomError(
                    "unknown_dim",
                    "role '{role}' uses dim '{dim}' that the layout lacks; fix: use one of "
                    "{known} or add '{dim}' to dims",
                    {"role": role, "dim": dim, "known": ", ".join(known),
                     "field": f"roles[{index}].dims[{d}]"},
                )
        home = next((f for f in factorizations.values() if set(dims) <= set(f)), None)
        if home is None:
            raise PydanticCustomError(
                "unknown_dim",
                "role '{role}' mixes dims {dims} that no single factorization (dims or one view) "
                "holds; fix: take the role's dims from dims or from one view",
                {"role": role, "dims": dims, "field": f"roles[{index}].dims"},
            )
        ordered = [dim for dim in home if dim in dims]
        if ordered != dims:
            raise PydanticCustomError(
                "unknown_dim",
                "role '{role}' lists dims {got} out of layout order; fix: use {want} "
                "(outermost first, as in dims)",
                {"role": role, "got": dims, "want": ordered, "field": f"roles[{index}].dims"},
            )

    @model_validator(mode="after")
    def _roles_fit_dims(self) -> Self:
        seen: dict[str, int] = {}
        for index, role in enumerate(self.roles):
            if role.name in seen:
                raise PydanticCustomError(
                    "duplicate_role",
                    "role '{name}' is declared twice (roles[{first}] and roles[{index}]); "
                    "fix: give each role a unique name",
                    {"name": role.name, "first": seen[role.name], "index": index,
                     "field": f"roles[{index}].name"},
                )
            seen[role.name] = index
            if isinstance(role.dims, list):
                self._check_role_dims(index, role.name, role.dims)
            if role.ranks is not None:
                world = self.world_size
                for g, group in enumerate(role.ranks):
                    for rank in group:
                        if rank >= world:
                            raise PydanticCustomError(
                                "invalid_size",
                                "role '{role}' lists rank {rank}, outside world size {world}; "
                                "fix: use ranks 0..{last}",
                                {"role": role.name, "rank": rank, "world": world,
                                 "last": world - 1, "field": f"roles[{index}].ranks[{g}]"},
                            )
        return self

    def __eq__(self, other: object) -> bool:
        # Dim order is part of the layout (it decides which ranks share a group); dict equality
        # would ignore it.
        if not isinstance(other, Layout):
            return NotImplemented
        return (list(self.dims.items()) == list(other.dims.items()) and self.roles == other.roles
                and [(v, list(d.items())) for v, d in self.views.items()]
                == [(v, list(d.items())) for v, d in other.views.items()])

    __hash__ = None  # type: ignore[assignment]  # dims is a dict: layouts are not hashable

    @property
    def world_size(self) -> int:
        """The number of ranks the layout describes: the product of the dim sizes."""
        return math.prod(self.dims.values())

    @property
    def role_names(self) -> tuple[str, ...]:
        """Role names in declaration (and creation) order."""
        return tuple(role.name for role in self.roles)

    def role(self, name: str) -> RoleSpec:
        """The spec of role ``name``; KeyError listing the known roles otherwise."""
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"unknown role {name!r}; known roles: {', '.join(self.role_names)}")

    def with_dims(self, **sizes: int) -> Layout:
        """A copy with some dim sizes changed (roles kept), validated again."""
        data = self.model_dump()
        data["dims"] = {**self.dims, **sizes}
        return Layout.model_validate(data)
