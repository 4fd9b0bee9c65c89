"""Restart mode's layout: one elastic dim given as ``"auto"`` takes its size from the job's world.

Under torchrun elastic (``--nnodes MIN:MAX --max-restarts N``) a restart may bring fewer (or more)
nodes. An :class:`AutoLayout` names every dim size but one; that one, written ``"auto"``, must be
declared in the ``elastic`` section and becomes ``world_size / (product of the other dims)`` when the
layout is resolved. Resolution is pure (:meth:`AutoLayout.resolve`, :func:`resolve_layout`); the
registry resolves with ``torch.distributed``'s world size (:func:`job_layout`). Every problem is a
:class:`~commgroups.errors.LayoutError` naming the field and the fix, raised before any communicator
exists and identical on every rank (every rank resolves the same layout with the same world size).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

from pydantic import Field, StrictBool, field_validator, model_validator
from typing_extensions import Self

from commgroups import errors
from commgroups.errors import LayoutError, RegistryStateError, WorldSizeMismatchError
from commgroups.layout import limits
from commgroups.layout.specs import ElasticSpec, Layout, RoleSpec, SpecModel, StrictSize, ordered_key
from commgroups.layout.validation_errors import problem

__all__ = ["AUTO", "AutoLayout", "has_auto_dim", "job_layout", "resolve_layout", "shared_store_risk"]

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The size of the dim that follows the world size."""

_SIZE_FIX = 'write an integer >= 1, or "auto" for the one elastic dim that follows the world size'


def _check_sizes(value: Any, where: str) -> None:
    """Refuse a size that is neither an integer >= 1 nor ``"auto"``, with the fix."""
    if not isinstance(value, dict):
        return  # pydantic's own type error names the field
    for name, size in value.items():
        if size == AUTO or (type(size) is int and size >= 1):
            continue
        raise problem(
            errors.InvalidSizeError,
            "dim '{name}'{where} has size {size}; fix: {fix}",
            str(name), name=limits.short_repr(name)[1:-1], where=where,
            size=limits.short_repr(size), fix=_SIZE_FIX,
        )


def has_auto_dim(data: Any) -> bool:
    """Whether layout data (a mapping, as parsed from a file) gives a dim, or a view's dim, the size
    ``"auto"``: such data is an :class:`AutoLayout`, not a :class:`~commgroups.Layout`.

    Example::

        >>> has_auto_dim({"dims": {"dp_replicate": "auto", "dp_shard": 2}}), has_auto_dim({"dims": {"cp": 4}})
        (True, False)
    """
    if not isinstance(data, dict):
        return False
    mappings = [data.get("dims")]
    views = data.get("views")
    if isinstance(views, dict):
        mappings += list(views.values())
    return any(isinstance(m, dict) and any(v == AUTO for v in m.values()) for m in mappings)


class AutoLayout(SpecModel):
    """A :class:`~commgroups.Layout` whose one elastic dim is ``"auto"``: sized by the world.

    Restart mode: under torchrun elastic the job is restarted on however many nodes remain, reloads
    its last checkpoint resharded, and asks the layout for its new shape. Every field is that of
    :class:`~commgroups.Layout`, except that exactly one dim of ``dims`` is ``"auto"`` (and, in a
    view, the same dim is ``"auto"`` too). The ``"auto"`` dim must be named in ``elastic.dims``,
    whose minimum bounds it; since the job reloads resharded, a sharded dim (``dp_shard``) may be
    the ``"auto"`` one, as may ``dp_replicate``. ``pp``, ``cp``, ``tp`` and ``ep`` never are.

    Args:
        dims (dict[str, int | "auto"]): dim name -> size, outermost first; one size is ``"auto"``.
        roles (list[RoleSpec], optional): as in Layout; omitted: the built-in roles of the resolved
            sizes (a dim resolved to size 1 gets no role of its own).
        views (dict[str, dict[str, int | "auto"]], optional): as in Layout; each view lists the
            ``"auto"`` dim as ``"auto"``.
        elastic (ElasticSpec): names the ``"auto"`` dim (and its minimum size).

    Raises:
        InvalidAutoDimError: no ``"auto"`` dim, several, one that ``elastic`` does not name, or a
            view that lacks it or makes another dim ``"auto"``.
        InvalidSizeError: a size that is neither an integer >= 1 nor ``"auto"``.
        LayoutError: anything :class:`~commgroups.Layout` refuses (checked on the layout at the
            ``"auto"`` dim's minimum size; the field named is the same).

    Example::

        >>> auto = AutoLayout(dims={"dp_replicate": "auto", "dp_shard": 2},
        ...                   elastic={"dims": {"dp_replicate": 1}})
        >>> auto.auto_dim, auto.fixed_size
        ('dp_replicate', 2)
        >>> auto.resolve(4).dims, auto.resolve(2).dims
        ({'dp_replicate': 2, 'dp_shard': 2}, {'dp_replicate': 1, 'dp_shard': 2})
    """

    dims: dict[str, StrictSize | Literal["auto"]] = Field(
        description='Dim name -> size, outermost first; exactly one is "auto".'
    )
    roles: list[RoleSpec] | None = Field(
        default=None, description="Communicator roles; omitted: the built-in roles once resolved."
    )
    views: dict[str, dict[str, StrictSize | Literal["auto"]]] = Field(
        default_factory=dict,
        description='Other factorizations of the same world; each lists the "auto" dim as "auto".',
    )
    elastic: ElasticSpec | None = Field(
        default=None, description='Dims that may shrink; must name the "auto" dim.'
    )
    flight_recorder: StrictBool = Field(
        default=True, description="As in Layout: the flight recorder, default on."
    )

    @field_validator("dims", mode="before")
    @classmethod
    def _dim_sizes(cls, value: Any) -> Any:
        _check_sizes(value, "")
        return value

    @field_validator("views", mode="before")
    @classmethod
    def _view_sizes(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for view, dims in value.items():
                try:
                    _check_sizes(dims, f" of view '{limits.short_repr(view)[1:-1]}'")
                except Exception as error:  # PydanticCustomError: put the view in its field
                    context = dict(getattr(error, "context", None) or {})
                    field = f"{view}.{context.get('field', '')}"
                    raise problem(errors.InvalidSizeError, str(error), field) from None
        return value

    @model_validator(mode="after")
    def _one_elastic_auto_dim(self) -> Self:
        autos = [name for name, size in self.dims.items() if size == AUTO]
        if not autos:
            raise problem(
                errors.InvalidAutoDimError,
                'no dim is "auto"; fix: give the one elastic dim that follows the world size the '
                'size "auto", or build a cg.Layout for a fixed world',
                "dims",
            )
        if len(autos) > 1:
            raise problem(
                errors.InvalidAutoDimError,
                'dims {names} are all "auto", but the world size decides one dim only; fix: give '
                'every dim but one a size (e.g. keep "auto" on {first})',
                f"dims.{autos[1]}", names=autos, first=autos[0],
            )
        name = autos[0]
        if self.elastic is None or name not in self.elastic.dims:
            raise problem(
                errors.InvalidAutoDimError,
                'dim \'{name}\' is "auto" but not elastic, so it may not change size; fix: add it '
                "to the elastic section with its minimum size (e.g. [elastic] dims = { {name} = 1 "
                "}), or give it a size",
                f"dims.{name}", name=name,
            )
        for view, dims in self.views.items():
            others = [dim for dim, size in dims.items() if size == AUTO and dim != name]
            if others:
                raise problem(
                    errors.InvalidAutoDimError,
                    'view \'{view}\' makes \'{dim}\' "auto", but only \'{name}\' follows the world '
                    "size; fix: give '{dim}' a size",
                    f"views.{view}.{others[0]}", view=view, dim=others[0], name=name,
                )
            if dims.get(name) != AUTO:
                raise problem(
                    errors.InvalidAutoDimError,
                    'view \'{view}\' does not list the "auto" dim \'{name}\' as "auto", so it '
                    "could not follow the world size; fix: add {name} = \"auto\" to the view",
                    f"views.{view}", view=view, name=name,
                )
        minimum = self.elastic.dims[name]
        if minimum < 1:
            raise problem(
                errors.InvalidElasticError,
                "elastic minimum {minimum} for '{name}' is below 1; fix: give a minimum >= 1",
                f"elastic.dims.{name}", minimum=minimum, name=name,
            )
        try:
            self._at(minimum)  # every Layout rule, on the smallest world the layout allows
        except LayoutError as error:
            kind, field, message = error.problems[0]
            raise problem(kind, message, field) from None
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AutoLayout):
            return NotImplemented
        return ordered_key(self) == ordered_key(other)

    __hash__ = None  # type: ignore[assignment]  # dims is a dict: layouts are not hashable

    @property
    def auto_dim(self) -> str:
        """The name of the dim whose size is ``"auto"``."""
        return next(name for name, size in self.dims.items() if size == AUTO)

    @property
    def world_size(self) -> NoReturn:
        """Not known until resolved: raises :class:`~commgroups.errors.ArgumentError` (field
        ``layout``) saying to resolve the layout first.

        What :func:`~commgroups.load_layout` returns for a file with an ``"auto"`` dim is easily
        handed to ``cg.plan``, ``cg.replan`` or ``estimate_memory``, which need a world size: each
        reads this first, so each says what to do rather than that an attribute is missing.
        """
        raise errors.ArgumentError(
            f"layout: an AutoLayout ('{self.auto_dim}' is \"auto\") has no world size until it is "
            "resolved; fix: pass layout.resolve(world_size), or load it with "
            "cg.load_layout(path, world_size=N)",
            field="layout",
        )

    @property
    def fixed_size(self) -> int:
        """The product of every other dim's size: the world size must be a multiple of it."""
        return math.prod(size for size in self.dims.values() if isinstance(size, int))

    @property
    def minimum_world_size(self) -> int:
        """The smallest world the layout resolves on: the fixed dims at the auto dim's minimum."""
        assert self.elastic is not None  # validated
        return self.fixed_size * self.elastic.dims[self.auto_dim]

    def _at(self, size: int) -> Layout:
        """The Layout with the ``"auto"`` dim (in dims and every view) at ``size``."""
        data = self.model_dump()
        data["dims"] = {name: size if s == AUTO else s for name, s in self.dims.items()}
        data["views"] = {view: {name: size if s == AUTO else s for name, s in dims.items()}
                         for view, dims in self.views.items()}
        return Layout.model_validate(data)

    def resolve(self, world_size: int) -> Layout:
        """The layout for a world of ``world_size`` ranks: the ``"auto"`` dim at
        ``world_size // fixed_size``, every other field kept (the elastic section too).

        Pure: no torch.distributed. Every rank of a job resolves to the same layout.

        Raises:
            LayoutError: ``world_size`` is not an integer >= 1 (field ``world_size``).
            WorldSizeMismatchError: ``world_size`` is not a multiple of :attr:`fixed_size` (field
                ``dims``), or gives the ``"auto"`` dim a size below its elastic minimum (field
                ``elastic.dims.<dim>``).
            LayoutError: the resolved world is past MAX_WORLD_SIZE (as for any Layout).

        Example::

            >>> auto = AutoLayout(dims={"dp_shard": "auto", "tp": 2}, elastic={"dims": {"dp_shard": 2}})
            >>> auto.resolve(8).dims
            {'dp_shard': 4, 'tp': 2}
        """
        if type(world_size) is not int or world_size < 1:
            raise LayoutError(
                f"world_size: {limits.short_repr(world_size)} is not a number of ranks; fix: pass "
                "an integer >= 1 (torch.distributed.get_world_size())",
                field="world_size",
            )
        name, fixed = self.auto_dim, self.fixed_size
        fixed_dims = " x ".join(f"{d}={s}" for d, s in self.dims.items() if s != AUTO) or "none"
        if world_size % fixed:
            below, above = world_size // fixed * fixed, (world_size // fixed + 1) * fixed
            hint = f"{below} or {above}" if below else f"{above}"
            raise WorldSizeMismatchError(
                f"dims: the fixed dims ({fixed_dims}) cover {fixed} ranks, which does not divide "
                f"the world size {world_size}, so '{name}' = \"auto\" has no whole size; fix: run "
                f"on a multiple of {fixed} ranks (e.g. {hint}), or change the fixed dims",
                field="dims",
            )
        size = world_size // fixed
        assert self.elastic is not None  # validated
        minimum = self.elastic.dims[name]
        if size < minimum:
            raise WorldSizeMismatchError(
                f"elastic.dims.{name}: the world size {world_size} gives '{name}' = {size} (the "
                f"fixed dims {fixed_dims} take {fixed} ranks each), below its elastic minimum "
                f"{minimum}; fix: run on at least {minimum * fixed} ranks, or lower the minimum",
                field=f"elastic.dims.{name}",
            )
        return self._at(size)


def resolve_layout(layout: Layout | AutoLayout, world_size: int) -> Layout:
    """``layout`` for a world of ``world_size`` ranks (pure).

    An :class:`AutoLayout` is resolved (:meth:`AutoLayout.resolve`); a :class:`~commgroups.Layout`
    is returned as it is when its world size is ``world_size``.

    Raises:
        WorldSizeMismatchError: a Layout of another world size, or see :meth:`AutoLayout.resolve`.
        LayoutError: ``world_size`` is not an integer >= 1.

    Example::

        >>> resolve_layout(Layout(dims={"cp": 4}), 4).dims
        {'cp': 4}
    """
    if isinstance(layout, AutoLayout):
        return layout.resolve(world_size)
    if type(world_size) is not int or world_size < 1:
        raise LayoutError(
            f"world_size: {limits.short_repr(world_size)} is not a number of ranks; fix: pass an "
            "integer >= 1", field="world_size",
        )
    if layout.world_size != world_size:
        raise WorldSizeMismatchError(
            f"dims: the layout's world size is {layout.world_size} "
            f"({' x '.join(f'{k}={v}' for k, v in layout.dims.items())}) but the world has "
            f"{world_size} ranks; fix: make the product of dims equal {world_size}, or give one "
            'elastic dim the size "auto"',
            field="dims",
        )
    return layout


def job_layout(layout: AutoLayout) -> Layout:
    """``layout`` resolved with the running job's world size (``torch.distributed.get_world_size()``).

    What :class:`~commgroups.GroupRegistry` does with an AutoLayout. Every rank of the job sees the
    same world size, so every rank gets the same layout or the same error.

    Raises:
        RegistryStateError: torch.distributed is not initialized (there is no world to size by).
        WorldSizeMismatchError: see :meth:`AutoLayout.resolve`.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RegistryStateError(
            f"the layout's '{layout.auto_dim}' is \"auto\" and takes its size from the job's world, "
            "but torch.distributed is not initialized; fix: call init_process_group() (or run "
            "under torchrun) before GroupRegistry(layout), or pass layout.resolve(world_size)"
        )
    risk = shared_store_risk(os.environ)
    if risk is not None and dist.get_rank() == 0:
        logger.warning(risk)
    return layout.resolve(dist.get_world_size())


def shared_store_risk(environ: Mapping[str, str]) -> str | None:
    """Why a restart of this torchrun job may fail to initialize, or None (pure; reads ``environ``).

    torchrun's agent shares its own TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps it across restarts while it stays node rank 0: the keys the previous attempt's
    ``init_process_group`` left there are still set, so restarted workers read stale peer addresses
    and fail to connect (pytorch#135712; seen on torch 2.13 with gloo: every restart failed). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment, worker rank 0 hosts a
    fresh store per attempt.

    Example::

        >>> shared_store_risk({"TORCHELASTIC_USE_AGENT_STORE": "True",
        ...                    "TORCHELASTIC_MAX_RESTARTS": "3"}) is not None
        True
        >>> shared_store_risk({"TORCHELASTIC_USE_AGENT_STORE": "False",
        ...                    "TORCHELASTIC_MAX_RESTARTS": "3"}) is None
        True
    """
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() \
            or int(restarts) == 0:
        return None
    return ("restart mode: torchrun shares its agent's store with the workers and keeps it "
            "across restarts, so a restarted worker can read the previous attempt's peer "
            "addresses and fail in init_process_group (pytorch#135712); fix: launch torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
