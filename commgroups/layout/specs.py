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

import pydantic_core
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
from typing_extensions import Self

from commgroups import errors
from commgroups.layout import limits
from commgroups.layout.validation_errors import layout_error_from, problem
from commgroups.planning.shapes import dim_shapes
from commgroups.util.error_text import listed

__all__ = [
    "CHECKPOINT_ROLE",
    "WORLD",
    "NEVER_ELASTIC",
    "BackendName",
    "ElasticSpec",
    "Purpose",
    "HcclOptions",
    "Layout",
    "NcclOptions",
    "RoleOptions",
    "RoleSpec",
    "checkpoint_role",
    "default_roles",
    "ordered_key",
    "dim_roles",
]

# The one list of backend names; the Literal makes mypy and pydantic both reject others.
BackendName = Literal["device", "nccl", "rccl", "hccl", "gloo", "fake"]
# What a role's group may carry. "compute": model traffic (FSDP, CP, TP, ...), and torch may find
# the group through a mesh (flattenings DTensor looks up by layout). "checkpoint": DCP's plan and
# metadata exchange only; never offered to DeviceMesh or DTensor, and the audit flags any other use.
Purpose = Literal["compute", "checkpoint"]
WORLD = "world"
CHECKPOINT_ROLE = "checkpoint-metadata"
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_\-]*$"
# re.fullmatch, not re.match with NAME_PATTERN: Python's "$" also matches before a final newline.
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")


def _valid_name(name: str) -> bool:
    """A dim, view or role name: a letter, then letters, digits, '_' or '-'; at most 64 chars."""
    return len(name) <= limits.MAX_NAME_LENGTH and _NAME.fullmatch(name) is not None


def _shown(name: str) -> str:
    """``name`` for a message or field path: escaped when it holds control characters, cut when long
    (so an error stays one readable line)."""
    return name if name.isprintable() and len(name) <= 80 else limits.short_repr(name)[1:-1]

# Dims that FSDP shards over in the built-in roles, following torchtitan (dp_shard x cp; "dp" is the
# common single data-parallel dim). dp_replicate stays a role of its own: HSDP replicates over it.
FSDP_DIMS = ("dp", "dp_shard", "cp")

StrictSize = Annotated[int, Strict()]
# Where a value has one meaning it has one type: a bool is not a timeout, "yes" is not a bool.
StrictBool = Annotated[bool, Strict()]
StrictInt = Annotated[int, Strict()]

NEVER_ELASTIC = ("pp", "cp", "tp", "ep")
"""Dims that never shrink: each rank holds a distinct part of the model or sequence along them."""


class SpecModel(BaseModel):
    """Base of every spec: immutable, unknown fields rejected, errors turned into LayoutErrors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, /, **data: Any) -> None:
        limits.check_input_shape(data, "<layout>")
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise layout_error_from(error, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` (a mapping) into this spec, raising a LayoutError on bad input."""
        limits.check_input_shape(obj, "<layout>")
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as error:
            raise layout_error_from(error, cls) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, *args: Any,
                            **kwargs: Any) -> Self:
        """Validate JSON text into this spec: parsed, then validated as :meth:`model_validate`
        validates a mapping (the same bounds and errors; a key given twice keeps its last value,
        where :func:`~commgroups.parse_layout` refuses it)."""
        try:
            data = pydantic_core.from_json(json_data)  # bounded nesting, no Python recursion
        except ValueError as error:
            raise errors.LayoutFileError(
                f"<layout>: not valid JSON: {limits.short_repr(str(error))[1:-1]}; fix: correct "
                "the syntax",
                field="<layout>",
            ) from None
        return cls.model_validate(data, *args, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` (a mapping whose leaves are text) into this spec, raising a
        LayoutError on bad input, as :meth:`model_validate` does."""
        limits.check_input_shape(obj, "<layout>")
        try:
            return super().model_validate_strings(obj, *args, **kwargs)
        except ValidationError as error:
            raise layout_error_from(error, cls) from None


class NcclOptions(SpecModel):
    """Options for an NCCL or RCCL communicator (``ProcessGroupNCCL.Options`` and its ``config``).

    Every field is optional; an unset field leaves NCCL's own default. Used by roles whose backend is
    ``nccl``, ``rccl`` or ``device`` (when it resolves to NCCL or RCCL).

    Args:
        high_priority_stream (bool): run the group's internal stream at high priority.
        cga_cluster_size (int, optional): NCCL CGA cluster size, 0..8.
        min_ctas (int, optional): minimum CTAs per kernel, 1..64, at most ``max_ctas``.
        max_ctas (int, optional): maximum CTAs per kernel, 1..64.
        net_name (str, optional): NCCL network plugin name, e.g. ``"IB"``.
        split_share (bool, optional): share the parent communicator's resources (split creation).
        blocking (bool, optional): NCCL blocking mode for communicator calls.

    Raises:
        InvalidOptionError: a value out of range or of the wrong type, or ``min_ctas > max_ctas``.
        UnknownFieldError: a field not listed above.

    Example::

        >>> NcclOptions(high_priority_stream=True, min_ctas=4, max_ctas=16).max_ctas
        16
    """

    high_priority_stream: StrictBool = Field(
        default=False, description="Run the group's internal stream at high priority."
    )
    cga_cluster_size: StrictInt | None = Field(default=None, ge=0, le=8, description="NCCL CGA size.")
    min_ctas: StrictInt | None = Field(default=None, ge=1, le=64, description="Minimum CTAs per kernel.")
    max_ctas: StrictInt | None = Field(default=None, ge=1, le=64, description="Maximum CTAs per kernel.")
    net_name: str | None = Field(default=None, description="NCCL network plugin name, e.g. 'IB'.")
    split_share: StrictBool | None = Field(
        default=None,
        description="Share the parent communicator's resources (split creation only).",
    )
    blocking: StrictBool | None = Field(
        default=None, description="NCCL blocking mode for communicator calls."
    )

    @model_validator(mode="after")
    def _ctas_ordered(self) -> Self:
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise problem(
                errors.InvalidOptionError,
                "min_ctas ({min}) is above max_ctas ({max}); fix: make min_ctas <= max_ctas",
                "min_ctas", min=self.min_ctas, max=self.max_ctas,
            )
        return self


# hccl_config keys that HcclOptions sets from a typed field: hccl_config key -> field.
_HCCL_TYPED_KEYS = {"hccl_buffer_size": "buffer_size_mb", "hccl_op_expansion_mode": "op_expansion_mode"}


class HcclOptions(SpecModel):
    """Options for an Ascend HCCL communicator (``ProcessGroupHCCL.Options.hccl_config``).

    Used by roles whose backend is ``hccl`` or ``device`` (when it resolves to HCCL).

    Args:
        buffer_size_mb (int, optional): ``hccl_buffer_size`` in MB, >= 1 (HCCL's default is 200).
        op_expansion_mode (str, optional): ``hccl_op_expansion_mode``, e.g. ``"AIV"``.
        config (dict[str, int | str | bool]): other ``hccl_config`` keys, passed through as they
            are; not the two keys above, which have typed fields.

    Raises:
        InvalidOptionError: ``buffer_size_mb < 1``, or ``config`` sets ``hccl_buffer_size`` or
            ``hccl_op_expansion_mode``.
        UnknownFieldError: a field not listed above.

    Example::

        >>> HcclOptions(buffer_size_mb=400).hccl_config()
        {'hccl_buffer_size': 400}
    """

    buffer_size_mb: StrictInt | None = Field(
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
        for key, typed in _HCCL_TYPED_KEYS.items():
            if key in value:
                raise problem(
                    errors.InvalidOptionError,
                    "'{key}' has a typed field; fix: set {typed} instead of config.{key}",
                    key, key=key, typed=typed,
                )
        return value

    def hccl_config(self) -> dict[str, int | str | bool]:
        """The whole ``hccl_config`` dict: ``config`` plus the typed fields that are set.

        Returns:
            A new dict, to assign whole to ``ProcessGroupHCCL.Options.hccl_config``.

        Example::

            >>> HcclOptions(buffer_size_mb=400, config={"hccl_deterministic": True}).hccl_config()
            {'hccl_deterministic': True, 'hccl_buffer_size': 400}
        """
        config = dict(self.config)
        for key, typed in _HCCL_TYPED_KEYS.items():
            value = getattr(self, typed)
            if value is not None:
                config[key] = value
        return config


# Which backends read each RoleOptions section (the device backend resolves to one of them).
_SECTION_BACKENDS: dict[str, tuple[BackendName, ...]] = {
    "nccl": ("nccl", "rccl", "device"),
    "hccl": ("hccl", "device"),
}


class RoleOptions(SpecModel):
    """Per-backend option sections; the backend a role resolves to picks its own section.

    Keeping a section per backend lets one layout file serve CUDA, ROCm and Ascend machines with the
    portable ``device`` backend.

    Args:
        nccl (NcclOptions, optional): used by nccl and rccl groups (and device on CUDA/ROCm).
        hccl (HcclOptions, optional): used by hccl groups (and device on Ascend).

    Raises:
        UnknownFieldError: a section other than ``nccl`` or ``hccl``.

    Example::

        >>> options = RoleOptions(nccl={"high_priority_stream": True})
        >>> options.nccl.high_priority_stream, options.hccl
        (True, None)
    """

    nccl: NcclOptions | None = Field(default=None, description="Used by nccl and rccl groups.")
    hccl: HcclOptions | None = Field(default=None, description="Used by hccl groups.")


class RoleSpec(SpecModel):
    """One communicator role: which ranks share a group, on which backend, with which options.

    A role sets exactly one of ``dims`` and ``ranks``. With ``dims`` the role gets one group per
    combination of the other dims (the ranks that differ only in these dims share a group, as in a
    DeviceMesh); with ``ranks`` it gets exactly the listed groups, for roles that are not a product
    of dims (an embedding group over the first and last pipeline stage), and a rank listed in no
    group gets no group for that role. Whether the dims exist in the layout is checked by
    :class:`Layout`.

    Args:
        name (str): role name, e.g. ``"cp"`` or ``"fsdp"``: a letter, then letters, digits, ``_``
            or ``-``.
        dims (list[str] | "world", optional): layout dims the role spans, each once, in layout
            order; or ``"world"`` for one group of every rank.
        ranks (list[list[int]], optional): explicit rank groups, disjoint; stored sorted.
        backend (str): ``"device"`` (NCCL on CUDA, RCCL on ROCm, HCCL on Ascend, else gloo) or one of
            ``nccl``, ``rccl``, ``hccl``, ``gloo``, ``fake``.
        timeout_s (float, optional): collective timeout in seconds; ``None``: the backend default.
        options (RoleOptions): backend options; only sections the backend reads are allowed.
        async_and_wait (bool): issue this role's collectives ``async_op=True`` and wait at once.
        purpose (str): ``"compute"`` (model traffic; the group may back mesh axes and the
            flattenings DTensor finds by layout) or ``"checkpoint"`` (DCP's plan and metadata
            exchange only: never a mesh axis or flattening, and the audit flags a collective on it
            outside DCP). Default: ``"checkpoint"`` for the role named ``checkpoint-metadata``,
            else ``"compute"``.

    Raises:
        InvalidNameError: ``name`` is not allowed.
        EmptyDimsError: ``dims=[]``.
        DimOrderError: a dim listed twice, ``dims`` given as a set (unordered), and (checked by
            Layout) dims out of layout order.
        DimsOrRanksError: both ``dims`` and ``ranks``, or neither.
        InvalidRanksError: an empty ``ranks`` or group, a negative rank, a rank in two groups.
        UnknownBackendError: ``backend`` is not one of the names above.
        InvalidOptionError: an options section the backend does not read, or a bad option value.
        UnknownFieldError: a field not listed above.

    Example::

        >>> RoleSpec(name="cp", dims=["cp"], timeout_s=60).backend
        'device'
        >>> RoleSpec(name="embed", ranks=[[3, 0]], backend="gloo").ranks
        [[0, 3]]
    """

    name: str = Field(pattern=NAME_PATTERN, description="Role name, e.g. 'cp' or 'fsdp'.")
    dims: list[str] | Literal["world"] | None = Field(
        default=None, description="Layout dims the role spans (layout order), or 'world'."
    )
    ranks: list[list[StrictInt]] | None = Field(
        default=None, description="Explicit rank groups, instead of dims."
    )
    backend: BackendName = Field(
        default="device",
        description="device (NCCL on CUDA, RCCL on ROCm, HCCL on Ascend, else gloo), or explicit.",
    )
    timeout_s: Annotated[float, Strict()] | None = Field(
        default=None, ge=limits.MIN_TIMEOUT_S, le=limits.MAX_TIMEOUT_S, allow_inf_nan=False,
        description="Collective timeout in seconds (MIN_TIMEOUT_S..MAX_TIMEOUT_S); None: the "
        "backend default.",
    )
    options: RoleOptions = Field(default_factory=RoleOptions, description="Backend options.")
    async_and_wait: StrictBool = Field(
        default=True, description="Issue this role's collectives async_op=True and wait at once."
    )
    purpose: Purpose = Field(
        default="compute",
        description="compute (model traffic, may back meshes) or checkpoint (DCP metadata only); "
        "default: checkpoint for checkpoint-metadata, else compute.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_purpose(cls, data: Any) -> Any:
        # The checkpoint role keeps its purpose however it is declared (built in, a layout file
        # that lists it without `purpose`, Python): it must never be offered to DTensor.
        if isinstance(data, Mapping) and "purpose" not in data and data.get("name") == CHECKPOINT_ROLE:
            return {**data, "purpose": "checkpoint"}
        return data

    @field_validator("name")
    @classmethod
    def _name_short(cls, value: str) -> str:
        if not _valid_name(value):  # the pattern passed: only the length can be wrong
            raise problem(
                errors.InvalidNameError,
                "name of {length} characters is too long; fix: use at most {most} characters",
                length=len(value), most=limits.MAX_NAME_LENGTH,
            )
        return value

    @field_validator("dims", mode="before")
    @classmethod
    def _dims_ordered(cls, value: Any) -> Any:
        # pydantic would take a set (or YAML's !!set) as a list, in an order that follows each
        # process's string hash seed: ranks would disagree on the role's dims (and on whether they
        # are in layout order). The order is part of what the role means, so ask for a list.
        if isinstance(value, (set, frozenset)):
            raise problem(
                errors.DimOrderError,
                "a set has no order (it differs from process to process); fix: give a list of "
                "the dims, in layout order (outermost first)",
            )
        return value

    @field_validator("dims")
    @classmethod
    def _dims_listed_once(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, list):
            if not value:
                raise problem(
                    errors.EmptyDimsError,
                    "a role needs at least one dim; fix: list layout dims, or use dims = \"world\"",
                )
            seen: set[str] = set()
            for index, dim in enumerate(value):
                if dim in seen:
                    raise problem(
                        errors.DimOrderError,
                        "dim '{dim}' is listed twice; fix: list each dim once",
                        f"[{index}]", dim=dim,
                    )
                seen.add(dim)
        return value

    @field_validator("ranks")
    @classmethod
    def _rank_groups_disjoint(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        if value is None:
            return None
        if not value:
            raise problem(
                errors.InvalidRanksError,
                "ranks needs at least one group; fix: list rank groups or use dims",
            )
        owner: dict[int, int] = {}
        for g, group in enumerate(value):
            if not group:
                raise problem(
                    errors.InvalidRanksError,
                    "rank group {g} is empty; fix: give every group at least one rank",
                    f"[{g}]", g=g,
                )
            for rank in group:
                if rank < 0:
                    raise problem(
                        errors.InvalidRanksError,
                        "rank {rank} is negative; fix: use global ranks >= 0",
                        f"[{g}]", rank=rank,
                    )
                if rank in owner:
                    raise problem(
                        errors.InvalidRanksError,
                        "rank {rank} is in group {a} and group {b}; fix: a rank may join one group "
                        "per role, so make another role for the second group",
                        f"[{g}]", rank=rank, a=owner[rank], b=g,
                    )
                owner[rank] = g
        return [sorted(group) for group in value]

    @model_validator(mode="after")
    def _shape_and_options_fit(self) -> Self:
        if (self.dims is None) == (self.ranks is None):
            raise problem(
                errors.DimsOrRanksError,
                "role '{name}' needs exactly one of dims or ranks; fix: set dims (layout dims or "
                "\"world\") or ranks (explicit rank groups), not both",
                "dims", name=self.name,
            )
        allowed = [s for s, backends in _SECTION_BACKENDS.items() if self.backend in backends]
        for section, backends in _SECTION_BACKENDS.items():
            if getattr(self.options, section) is not None and section not in allowed:
                fix = (
                    f"use options.{allowed[0]}" if allowed else "remove options"
                ) + f" or change backend (options.{section} applies to {', '.join(backends)})"
                raise problem(
                    errors.InvalidOptionError,
                    "options.{section} does not apply to backend '{backend}'; fix: {fix}",
                    f"options.{section}", section=section, backend=self.backend, fix=fix,
                )
        return self


def default_roles(dims: Mapping[str, int]) -> list[RoleSpec]:
    """Built-in roles for ``dims``, following torchtitan's conventions.

    One role per dim of size > 1 (named after the dim), ``fsdp`` over the data-parallel shard dims and
    cp (dp, dp_shard, cp: FSDP shards over dp_shard x cp; dp_replicate stays its own role for HSDP),
    and ``checkpoint-metadata`` over the world on gloo. A :class:`Layout` without ``roles`` gets these
    (it refuses a dim that would give two of them one name: ``checkpoint-metadata``, or ``fsdp``
    beside the FSDP dims).

    Args:
        dims (Mapping[str, int]): dim name -> size, outermost first.

    Returns:
        list[RoleSpec]: the roles, in creation order.

    Raises:
        InvalidNameError: a dim name of size > 1 is not a valid role name.

    Example::

        >>> roles = default_roles({"dp_replicate": 2, "dp_shard": 2, "tp": 1})
        >>> [(role.name, role.dims) for role in roles][2:]
        [('fsdp', ['dp_shard']), ('checkpoint-metadata', 'world')]
        >>> [role.name for role in roles]  # no role for tp: size 1
        ['dp_replicate', 'dp_shard', 'fsdp', 'checkpoint-metadata']
    """
    roles = dim_roles(dims)
    fsdp_dims = [dim for dim in dims if dim in FSDP_DIMS]
    if fsdp_dims and math.prod(dims[d] for d in fsdp_dims) > 1:
        roles.append(RoleSpec(name="fsdp", dims=fsdp_dims))
    roles.append(checkpoint_role())
    return roles


def _builtin_name_clash(dims: Mapping[str, Any]) -> str | None:
    """The dim whose name :func:`default_roles` would give to two roles, or None.

    Only the built-in roles that are not a dim's own can clash: ``checkpoint-metadata`` always,
    ``fsdp`` beside ``dp``, ``dp_shard`` or ``cp``. Sizes are not looked at, so a layout whose
    sizes change (an AutoLayout resolved, a replan) never starts or stops clashing.

    Example::

        >>> _builtin_name_clash({"dp_shard": 2, "fsdp": 2}), _builtin_name_clash({"fsdp": 2, "tp": 2})
        ('fsdp', None)
    """
    if CHECKPOINT_ROLE in dims:
        return CHECKPOINT_ROLE
    if "fsdp" in dims and any(dim in FSDP_DIMS for dim in dims):
        return "fsdp"
    return None


def dim_roles(dims: Mapping[str, int]) -> list[RoleSpec]:
    """One built-in role per dim of size > 1, named after the dim (first of :func:`default_roles`;
    torchtitan's derived roles start with them too).

    Example::

        >>> [role.name for role in dim_roles({"dp_shard": 2, "cp": 1, "tp": 2})]
        ['dp_shard', 'tp']
    """
    return [RoleSpec(name=dim, dims=[dim]) for dim, size in dims.items() if size > 1]


def checkpoint_role() -> RoleSpec:
    """The built-in ``checkpoint-metadata`` role: one gloo group over the world, purpose checkpoint
    (last of :func:`default_roles` and of torchtitan's derived roles).

    Example::

        >>> role = checkpoint_role()
        >>> role.name, role.dims, role.backend, role.purpose
        ('checkpoint-metadata', 'world', 'gloo', 'checkpoint')
    """
    return RoleSpec(name=CHECKPOINT_ROLE, dims="world", backend="gloo")


class ElasticSpec(SpecModel):
    """Which dims may shrink when ranks are lost, how far, and what becomes of leftover ranks.

    Losing a rank removes its whole slice along one elastic dim (:func:`commgroups.rank_loss.replan`): with
    ``dp_replicate`` elastic, a lost rank takes its replica with it and the other replicas carry on
    from memory. In a torchrun restart a sharded dim (``dp_shard``) may shrink too, since the job
    reloads its checkpoint resharded. ``pp``, ``cp``, ``tp`` and ``ep`` never shrink.

    Args:
        dims (dict[str, int]): elastic dim -> its minimum size (>= 1), in any order.
        spares (bool): survivors that the smaller layout has no place for stay in the job as spares
            (True) or are dropped and should exit (False, the default).

    Raises:
        InvalidElasticError: see :class:`~commgroups.errors.InvalidElasticError` (checked by
            :class:`Layout`, which knows the dims).

    Example::

        >>> ElasticSpec(dims={"dp_replicate": 1}).spares
        False
    """

    dims: dict[str, StrictSize] = Field(description="Elastic dim -> minimum size (>= 1).")
    spares: StrictBool = Field(default=False, description="Keep leftover survivors as spares.")


def ordered_key(layout: Any) -> tuple[Any, ...]:
    """What makes two layouts (fixed or auto) equal, dim order included: the order decides which
    ranks share a group, and dict equality would ignore it."""
    return (list(layout.dims.items()), layout.roles,
            [(view, list(dims.items())) for view, dims in layout.views.items()], layout.elastic)


class Layout(SpecModel):
    """The job's mesh dims and communicator roles; the single input of planning and creation.

    ``dims`` is ordered, outermost first, like ``init_device_mesh``'s shape: rank ``r`` has
    coordinates ``numpy.unravel_index(r, sizes)``, and a role over some dims groups the ranks that
    share every other coordinate. Every rank must build the same layout (the registry compares
    fingerprints before creating anything). Layouts compare equal only with the same dim order.

    Args:
        dims (dict[str, int]): dim name -> size (an integer >= 1), outermost first; the world size
            is the product of the sizes.
        roles (list[RoleSpec], optional): the communicator roles, in creation order; omitted: the
            built-in roles of :func:`default_roles`.
        views (dict[str, dict[str, int]], optional): other row-major factorizations of the same
            ranks (view name -> dims, outermost first), e.g. torchtitan's MoE view
            ``{pp, dp_replicate, efsdp, ep}``; a role takes its dims from ``dims`` or one view.
        elastic (ElasticSpec, optional): which dims may shrink after a rank loss (see
            :func:`commgroups.rank_loss.replan`); omitted: none.
        flight_recorder (bool, optional): the flight recorder (:mod:`commgroups.flight_recorder`);
            default on (``COMMGROUPS_FLIGHT_RECORDER=0`` turns it off for a process).

    Raises:
        EmptyDimsError: ``dims`` or a view is empty (or a role's ``dims`` is).
        InvalidNameError: a dim or view name is not allowed, or is reserved (``"world"``,
            ``"dims"``); without ``roles``, a dim named ``checkpoint-metadata``, or ``fsdp``
            beside ``dp``, ``dp_shard`` or ``cp`` (the built-in roles would have that name twice).
        InvalidSizeError: a dim size is not an integer >= 1.
        InvalidViewError: a view covers another number of ranks, or shares a dim name with
            another meaning.
        UnknownDimError: a role uses a dim that neither ``dims`` nor a view has.
        DimOrderError: a role lists a dim twice, out of layout order, or mixes factorizations.
        DuplicateRoleError: two roles share a name.
        InvalidRanksError: a role's explicit ranks are outside the world (or invalid, see RoleSpec).
        InvalidElasticError: the ``elastic`` section cannot work (see the error's docs).
        LayoutError: any other problem of a role (see :class:`RoleSpec`); every problem is listed
            in the message and the class is the first one's.

    Example::

        >>> layout = Layout(dims={"dp_shard": 2, "cp": 2})
        >>> layout.role_names
        ('dp_shard', 'cp', 'fsdp', 'checkpoint-metadata')
        >>> from commgroups.planning.plan import plan
        >>> p = plan(layout)
        >>> for rank in range(layout.world_size):
        ...     print(rank, {role: p.ranks_of(role, rank) for role in ("dp_shard", "cp", "fsdp")})
        0 {'dp_shard': (0, 2), 'cp': (0, 1), 'fsdp': (0, 1, 2, 3)}
        1 {'dp_shard': (1, 3), 'cp': (0, 1), 'fsdp': (0, 1, 2, 3)}
        2 {'dp_shard': (0, 2), 'cp': (2, 3), 'fsdp': (0, 1, 2, 3)}
        3 {'dp_shard': (1, 3), 'cp': (2, 3), 'fsdp': (0, 1, 2, 3)}

        Rank 2 has coordinates (dp_shard=1, cp=0): its cp group is the ranks with dp_shard=1, its
        dp_shard group the ranks with cp=0; checkpoint-metadata is one gloo group of all four.
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
    elastic: ElasticSpec | None = Field(
        default=None, description="Dims that may shrink after a rank loss; omitted: none."
    )
    flight_recorder: StrictBool = Field(
        default=True, description="Record every role's collectives in a ring buffer and name "
        "the ranks behind when a role times out (commgroups.flight_recorder); false: off."
    )

    @model_validator(mode="before")
    @classmethod
    def _dims_leave_builtin_names(cls, data: Any) -> Any:
        # Without roles, every dim of size > 1 gets a role named after it beside the built-in fsdp
        # and checkpoint-metadata: a dim named like those would make two roles of one name, which
        # the user never wrote. Checked on names alone, before any role is made, so the error is
        # about the dim and an AutoLayout that validates resolves on every world size.
        if isinstance(data, Mapping) and data.get("roles") is None \
                and isinstance(data.get("dims"), Mapping):
            name = _builtin_name_clash(data["dims"])
            if name is not None:
                over = "the world" if name == CHECKPOINT_ROLE else " x ".join(
                    dim for dim in data["dims"] if dim in FSDP_DIMS)
                raise problem(
                    errors.InvalidNameError,
                    "dim '{name}' has the name of the built-in role '{name}' (over {over}), which "
                    "a layout without roles also gets; fix: rename the dim, or declare roles",
                    f"dims.{name}", name=name, over=over,
                )
        return data

    @field_validator("dims", "views", mode="before")
    @classmethod
    def _no_auto_size(cls, value: Any, info: ValidationInfo) -> Any:
        # Restart mode's "auto" size belongs to AutoLayout (cg.load_layout picks it for a file).
        if isinstance(value, Mapping):
            sizes = value.items() if info.field_name == "dims" else (
                (f"{view}.{name}", size) for view, dims in value.items()
                if isinstance(dims, Mapping) for name, size in dims.items())
            for name, size in sizes:
                if size == "auto":
                    raise problem(
                        errors.InvalidAutoDimError,
                        "dim '{name}' has size \"auto\", which a Layout cannot resolve; fix: "
                        "build cg.AutoLayout(...) (cg.load_layout picks it for a file) and pass it "
                        "to GroupRegistry under torchrun, or resolve it with .resolve(world_size)",
                        str(name), name=_shown(str(name)),
                    )
        return value

    @field_validator("dims")
    @classmethod
    def _dims_valid(cls, value: dict[str, int]) -> dict[str, int]:
        if not value:
            raise problem(
                errors.EmptyDimsError,
                "a layout needs at least one dim; fix: e.g. dims = { dp_shard = 2, cp = 4 }",
            )
        if len(value) > limits.MAX_DIMS:
            raise problem(
                errors.InvalidSizeError,
                "{count} dims is more than MAX_DIMS = {most}; fix: merge dims or drop size-1 "
                "dims no role uses",
                count=len(value), most=limits.MAX_DIMS,
            )
        world = 1
        for name, size in value.items():
            if name == WORLD or not _valid_name(name):
                raise problem(
                    errors.InvalidNameError,
                    "dim name '{name}' is not allowed; fix: start with a letter, use letters, "
                    "digits, '_' or '-' (at most 64 characters), and do not use the reserved name 'world'",
                    _shown(name), name=_shown(name),
                )
            if size < 1:
                raise problem(
                    errors.InvalidSizeError,
                    "dim '{name}' has size {size}; fix: every size must be >= 1 "
                    "(use 1 for an unused dim)",
                    name, name=name, size=size,
                )
            world *= size
            if world > limits.MAX_WORLD_SIZE:  # checked as it grows: huge sizes never multiply
                raise problem(
                    errors.InvalidSizeError,
                    "dims up to '{name}' already cover {world} ranks, more than MAX_WORLD_SIZE = "
                    "{most}; fix: check the sizes (the world size is their product)",
                    name, name=name, world=world if world < 10**15 else "more than 1e15",
                    most=limits.MAX_WORLD_SIZE,
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
        shapes = dim_shapes(self.dims)
        owner = dict.fromkeys(self.dims, "dims")
        if len(self.views) > limits.MAX_VIEWS:
            raise problem(
                errors.InvalidViewError,
                "{count} views is more than MAX_VIEWS = {most}; fix: keep the views roles use",
                "views", count=len(self.views), most=limits.MAX_VIEWS,
            )
        for view, dims in self.views.items():
            field = f"views.{_shown(view)}"
            if len(dims) > limits.MAX_DIMS:
                raise problem(
                    errors.InvalidViewError,
                    "view '{view}' has {count} dims, more than MAX_DIMS = {most}; fix: merge dims "
                    "or drop size-1 dims no role uses",
                    field, view=view, count=len(dims), most=limits.MAX_DIMS,
                )
            if view == "dims" or not _valid_name(view):
                raise problem(
                    errors.InvalidNameError,
                    "view name '{view}' is not allowed; fix: start with a letter, use letters, "
                    "digits, '_' or '-' (at most 64 characters), and do not use the reserved name "
                    "'dims'",
                    field, view=_shown(view),
                )
            if not dims:
                raise problem(
                    errors.EmptyDimsError,
                    "view '{view}' has no dims; fix: list its dims with their sizes",
                    field, view=view,
                )
            for name, size in dims.items():
                if name == WORLD or not _valid_name(name):
                    raise problem(
                        errors.InvalidNameError,
                        "dim name '{name}' in view '{view}' is not allowed; fix: start with a "
                        "letter, use letters, digits, '_' or '-' (at most 64 characters), and not 'world'",
                        f"{field}.{_shown(name)}", name=_shown(name), view=view,
                    )
                if size < 1:
                    raise problem(
                        errors.InvalidSizeError,
                        "dim '{name}' of view '{view}' has size {size}; fix: sizes must be >= 1",
                        f"{field}.{name}", name=name, view=view, size=size,
                    )
            product = math.prod(dims.values())
            if product != self.world_size:
                raise problem(
                    errors.InvalidViewError,
                    "view '{view}' covers {product} ranks but dims cover {world}; fix: make the "
                    "product of the view's sizes equal {world}",
                    field, view=view, product=product, world=self.world_size,
                )
            for name, shape in dim_shapes(dims).items():
                if name in shapes and shapes[name] != shape:
                    raise problem(
                        errors.InvalidViewError,
                        "dim '{name}' in view '{view}' groups other ranks than '{name}' in "
                        "{other} (size, stride {mine} vs {theirs}); fix: rename it in the view, or "
                        "make the sizes around it match so it means the same ranks",
                        f"{field}.{name}", name=name, view=view, other=owner[name], mine=shape,
                        theirs=shapes[name],
                    )
                shapes.setdefault(name, shape)
                owner.setdefault(name, field)
        return self

    @model_validator(mode="after")
    def _elastic_dims_can_shrink(self) -> Self:
        if self.elastic is None:
            return self
        for name, minimum in self.elastic.dims.items():
            field = f"elastic.dims.{name}"
            if name not in self.dims:
                raise problem(
                    errors.InvalidElasticError,
                    "elastic dim '{name}' is not one of the layout's dims ({known}); fix: name a "
                    "dim of dims",
                    field, name=name, known=", ".join(self.dims),
                )
            if name in NEVER_ELASTIC:
                raise problem(
                    errors.InvalidElasticError,
                    "'{name}' may never shrink: every rank along it holds a distinct part of the "
                    "model or sequence; fix: remove it (replica and data-shard dims such as "
                    "dp_replicate or dp_shard may shrink)",
                    field, name=name,
                )
            if minimum < 1 or minimum > self.dims[name]:
                raise problem(
                    errors.InvalidElasticError,
                    "elastic minimum {minimum} for '{name}' is outside 1..{size} (its size); fix: "
                    "give a minimum between 1 and {size}",
                    field, name=name, minimum=minimum, size=self.dims[name],
                )
            for view, dims in self.views.items():
                if name not in dims:
                    raise problem(
                        errors.InvalidElasticError,
                        "view '{view}' lacks elastic dim '{name}', so it could not shrink with "
                        "it; fix: keep '{name}' in the view (as torchtitan's MoE view keeps "
                        "dp_replicate) or make the dim not elastic",
                        f"views.{view}", view=view, name=name,
                    )
        explicit = [role.name for role in self.roles if role.ranks is not None]
        if explicit and self.elastic.dims:
            raise problem(
                errors.InvalidElasticError,
                "roles {explicit} have explicit ranks, which cannot be re-derived on a smaller "
                "world; fix: give them dims, or drop the elastic section",
                "elastic", explicit=explicit,
            )
        return self

    def factorizations(self) -> dict[str, list[str]]:
        """Dim names of ``dims`` (key ``"dims"``) and of every view, each outermost first."""
        return {"dims": list(self.dims), **{v: list(d) for v, d in self.views.items()}}

    def _check_role_dims(self, index: int, role: str, dims: list[str]) -> None:
        factorizations = self.factorizations()
        known = list(dict.fromkeys(d for f in factorizations.values() for d in f))
        for d, dim in enumerate(dims):
            if dim not in known:
                raise problem(
                    errors.UnknownDimError,
                    "role '{role}' uses dim '{dim}' that the layout lacks; fix: use one of "
                    "{known} or add '{dim}' to dims",
                    f"roles[{index}].dims[{d}]", role=role, dim=dim, known=listed(known, width=80),
                )
        home = next((f for f in factorizations.values() if set(dims) <= set(f)), None)
        if home is None:
            raise problem(
                errors.DimOrderError,
                "role '{role}' mixes dims {dims} that no single factorization (dims or one view) "
                "holds; fix: take the role's dims from dims or from one view",
                f"roles[{index}].dims", role=role, dims=dims,
            )
        ordered = [dim for dim in home if dim in dims]
        if ordered != dims:
            raise problem(
                errors.DimOrderError,
                "role '{role}' lists dims {got} out of layout order; fix: use {want} "
                "(outermost first, as in dims)",
                f"roles[{index}].dims", role=role, got=dims, want=ordered,
            )

    @model_validator(mode="after")
    def _roles_fit_dims(self) -> Self:
        if len(self.roles) > limits.MAX_ROLES:
            raise problem(
                errors.LayoutError,
                "{count} roles is more than MAX_ROLES = {most}; fix: each role costs a communicator "
                "per rank, so keep the roles the job uses",
                "roles", count=len(self.roles), most=limits.MAX_ROLES,
            )
        seen: dict[str, int] = {}
        for index, role in enumerate(self.roles):
            if role.name in seen:
                raise problem(
                    errors.DuplicateRoleError,
                    "role '{name}' is declared twice (roles[{first}] and roles[{index}]); "
                    "fix: give each role a unique name",
                    f"roles[{index}].name", name=role.name, first=seen[role.name], index=index,
                )
            seen[role.name] = index
            if isinstance(role.dims, list):
                self._check_role_dims(index, role.name, role.dims)
            if role.ranks is not None:
                world = self.world_size
                for g, group in enumerate(role.ranks):
                    for rank in group:
                        if rank >= world:
                            raise problem(
                                errors.InvalidRanksError,
                                "role '{role}' lists rank {rank}, outside world size {world}; "
                                "fix: use ranks 0..{last}",
                                f"roles[{index}].ranks[{g}]", role=role.name, rank=rank,
                                world=world, last=world - 1,
                            )
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return ordered_key(self) == ordered_key(other)

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
        """The spec of role ``name``.

        Raises:
            KeyError: no role is called ``name``; the message lists the known roles.
        """
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"unknown role {name!r}; known roles: {', '.join(self.role_names)}")

    def with_dims(self, **sizes: int) -> Layout:
        """A copy with some dim sizes changed (dim order and roles kept), validated again.

        Raises:
            UnknownDimError: a name that is not one of the layout's dims (a misspelt name would
                otherwise add a dim, and multiply the world size).
            LayoutError: the new sizes make an invalid layout.

        Example::

            >>> Layout(dims={"dp_shard": 2, "cp": 2}).with_dims(dp_shard=4).world_size
            8
        """
        unknown = [name for name in sizes if name not in self.dims]
        if unknown:
            field = f"dims.{_shown(unknown[0])}"
            raise errors.UnknownDimError(
                f"{field}: not a dim of the layout ({listed(list(self.dims), width=60)}); fix: "
                "with_dims changes sizes only, so name one of those dims",
                field=field,
            )
        data = self.model_dump()
        data["dims"] = {**self.dims, **sizes}
        return Layout.model_validate(data)
