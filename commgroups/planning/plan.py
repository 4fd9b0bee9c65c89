"""Pure rank planning: which global ranks share a group, for every role of a layout.

Nothing here touches ``torch.distributed``: a plan is arithmetic over the layout, so it is cheap to
test, to print (``commgroups plan``) and to compare across ranks (:attr:`Plan.fingerprint`).

Ranks follow ``init_device_mesh``'s convention: ``torch.arange(world).view(sizes)``, last dim fastest.
A role over dims ``D`` has one group per combination of the *other* dims' coordinates; groups come in
row-major order of those coordinates and each group's ranks in row-major order of ``D`` (so ranks are
ascending, as ``new_group`` sorts them). One rank's group is computed directly from its coordinates,
without materialising the other groups, so planning a single rank of a 1,048,576-rank layout is fast.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from commgroups.layout.specs import WORLD, Layout, RoleSpec
from commgroups.planning.shapes import dim_shapes, row_major_strides

__all__ = ["DIMS", "Plan", "RolePlan", "plan"]

FINGERPRINT_VERSION = 1
MAX_LISTED_RANKS = 65_536
"""``to_dict`` lists a role's groups only when they hold at most this many ranks in all."""
DIMS = "dims"
"""The name of the layout's own factorization (its ``dims``) among :attr:`Plan.factorizations`."""


@dataclass(frozen=True)
class RolePlan:
    """The shape of one role's groups (or of a dedicated mesh-dim group).

    Attributes:
        name: the role's name (a dim's name for a mesh-dim group).
        dim_names: the dims the role spans, in the order of their factorization; None for a role
            with explicit rank groups.
        factorization: the name of the factorization (``dims``, or a view's name) ``dim_names``
            come from; None for explicit rank groups.
        spans_world: one group holds every rank.
        group_size: ranks per group (the largest group, for explicit rank groups).
        num_groups: how many groups the role has.
        regular: every rank of the world is in exactly one group and all groups have the same
            size: the condition for member-only (local) creation.
        spec: the role's spec.
    """

    name: str
    dim_names: tuple[str, ...] | None
    factorization: str | None
    spans_world: bool
    group_size: int
    num_groups: int
    regular: bool
    spec: RoleSpec


_NO_MEMBERS = np.zeros(0, dtype=np.int64)
_NO_MEMBERS.flags.writeable = False  # shared by every Plan without members: never written


class Plan:
    """Every role's rank groups for a layout, in one canonical order; pure and deterministic.

    Make one with :func:`plan`. Every dim of the layout's ``dims`` and of its ``views`` is a
    (size, stride) pair over the global ranks (row-major, last dim fastest), so a role over dims ``D``
    has one group per combination of the other dims of ``D``'s factorization, groups ordered by their
    first rank. Example: dims ``{"dp_shard": 2, "cp": 2}`` give role ``cp`` the groups ``(0, 1)``
    and ``(2, 3)``: rank 0 and 1 get ``(0, 1)``, rank 2 and 3 get ``(2, 3)``.

    After a rank loss the layout's positions are held by surviving global ranks (``members``, from
    :func:`commgroups.rank_loss.replan`): every method then takes and returns global ranks, and the arithmetic
    runs on positions. Example: dims ``{"dp_shard": 2}``, members ``(1, 3)``: role ``dp_shard`` is
    the one group ``(1, 3)``.
    """

    def __init__(self, layout: Layout, members: Sequence[int] | np.ndarray | None = None) -> None:
        self.layout = layout
        self.world_size = layout.world_size
        self.members: tuple[int, ...] | None = None
        """The global rank at each layout position (None: position ``i`` is global rank ``i``)."""
        self._members = _NO_MEMBERS
        if members is not None:
            self._members = np.asarray(members, dtype=np.int64).reshape(-1)
            self.members = tuple(self._members.tolist())
            if self._members.size != self.world_size:
                raise ValueError(
                    f"members: {self._members.size} ranks for a layout of {self.world_size}; give "
                    "one global rank per position"
                )
            # Strictly ascending keeps every group's ranks in the order new_group sorts them into
            # (and makes a position a binary search away).
            if self._members.size and (self._members[0] < 0
                                       or not bool(np.all(np.diff(self._members) > 0))):
                raise ValueError("members: give distinct global ranks >= 0 in ascending order")
        self.dim_names: tuple[str, ...] = tuple(layout.dims)
        self.dim_sizes: tuple[int, ...] = tuple(layout.dims.values())
        self.dim_strides: tuple[int, ...] = row_major_strides(self.dim_sizes)
        self.factorizations: dict[str, tuple[str, ...]] = {DIMS: self.dim_names}
        self._shape: dict[str, tuple[int, int]] = dim_shapes(layout.dims)
        for view, dims in layout.views.items():
            self.factorizations[view] = tuple(dims)
            for name, shape in dim_shapes(dims).items():
                self._shape.setdefault(name, shape)  # the layout checked that repeats agree
        self._roles: dict[str, RolePlan] = {
            spec.name: self._role_plan(spec) for spec in layout.roles
        }
        self._dim_groups: dict[str, RolePlan] = {}  # dim_group's, made on first request

    # ----------------------------------------------------------------------------- role shapes
    def _role_plan(self, spec: RoleSpec) -> RolePlan:
        if spec.ranks is not None:
            sizes = {len(group) for group in spec.ranks}
            covered = sum(len(group) for group in spec.ranks)
            return RolePlan(
                name=spec.name,
                dim_names=None,
                factorization=None,
                spans_world=covered == self.world_size and len(spec.ranks) == 1,
                group_size=max(sizes),
                num_groups=len(spec.ranks),
                regular=covered == self.world_size and len(sizes) == 1,
                spec=spec,
            )
        dims = self.dim_names if spec.dims == WORLD else tuple(spec.dims or ())
        size = math.prod(self._shape[d][0] for d in dims)
        return RolePlan(
            name=spec.name,
            dim_names=dims,
            factorization=self.factorization_of(dims),
            spans_world=size == self.world_size,
            group_size=size,
            num_groups=self.world_size // size,
            regular=True,
            spec=spec,
        )

    def factorization_of(self, dims: Sequence[str]) -> str:
        """The first factorization (``dims``, then views in order) that holds every dim of ``dims``."""
        for name, members in self.factorizations.items():
            if all(dim in members for dim in dims):
                return name
        raise KeyError(f"no factorization of the layout holds all of {list(dims)}")

    @property
    def role_names(self) -> tuple[str, ...]:
        """Role names in declaration order."""
        return tuple(self._roles)

    @property
    def all_dim_names(self) -> tuple[str, ...]:
        """Every dim name of ``dims`` and of the views, each once, ``dims`` first."""
        return tuple(self._shape)

    def role(self, name: str) -> RolePlan:
        """The :class:`RolePlan` of ``name``; KeyError listing the known roles otherwise."""
        try:
            return self._roles[name]
        except KeyError:
            raise KeyError(
                f"unknown role {name!r}; known roles: {', '.join(self._roles)}"
            ) from None

    def dim_group(self, dim: str) -> RolePlan:
        """The plan of a dedicated group over the one dim ``dim`` (device backend, defaults)."""
        if dim not in self._shape:
            raise KeyError(f"unknown dim {dim!r}; known dims: {', '.join(self._shape)}")
        made = self._dim_groups.get(dim)
        if made is None:  # a RoleSpec is validated each time one is made: once per dim
            made = self._dim_groups[dim] = self._role_plan(RoleSpec(name=dim, dims=[dim]))
        return made

    def _info(self, role: str | RolePlan) -> RolePlan:
        return role if isinstance(role, RolePlan) else self.role(role)

    @property
    def is_regular(self) -> bool:
        """True when every role is regular (each rank in exactly one equal-sized group)."""
        return all(role.regular for role in self._roles.values())

    # ----------------------------------------------------------------------------- rank groups
    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` on every dim of ``dims`` and of the views."""
        position = self.position(rank)
        return {name: (position // stride) % size for name, (size, stride) in self._shape.items()}

    def dim_size(self, dim: str) -> int:
        """The size of ``dim`` (a dim of ``dims`` or of a view)."""
        return self._shape[dim][0]

    def position(self, rank: int) -> int:
        """The layout position (0 .. world_size - 1) global ``rank`` holds; ValueError if none."""
        if self.members is None:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank {rank} is outside the layout's world of {self.world_size}")
            return rank
        index = int(np.searchsorted(self._members, rank))
        if index < self._members.size and int(self._members[index]) == rank:
            return index
        raise ValueError(f"rank {rank} holds no position of this layout (its members are "
                         f"{_short_ranks(self.members)})")

    def holds(self, ranks: np.ndarray) -> np.ndarray:
        """Whether each global rank of the integer array ``ranks`` holds a position (bool array)."""
        if self.members is None:
            held: np.ndarray = (ranks >= 0) & (ranks < self.world_size)
            return held
        found = np.searchsorted(self._members, ranks)
        inside = found < self._members.size
        held = inside & (self._members[np.where(inside, found, 0)] == ranks)
        return held

    def positions(self, ranks: Sequence[int] | np.ndarray) -> np.ndarray:
        """The positions of global ``ranks`` (each must hold one), as an array."""
        given = np.asarray(ranks, dtype=np.int64)
        if self.members is None:
            if given.size and (given.min() < 0 or given.max() >= self.world_size):
                raise ValueError(f"ranks outside the layout's world of {self.world_size}")
            return given
        found = np.searchsorted(self._members, given)
        if given.size and (found.max() >= self._members.size
                           or not bool(np.all(self._members[found] == given))):
            raise ValueError("ranks that hold no position of this layout")
        return found

    def global_ranks(self, positions: np.ndarray) -> np.ndarray:
        """The global ranks at ``positions`` (an integer array of any shape)."""
        if self.members is None:
            return positions
        mapped: np.ndarray = self._members[positions]
        return mapped

    def offsets(self, dims: Sequence[str]) -> tuple[int, ...]:
        """Position offsets of a group's members from its first position, row-major in ``dims``.

        Plain ints, not an array: a group's offsets are few where a rank asks for its own group,
        and numpy's first calls in a process cost ``create()`` more than this arithmetic
        (0.1-0.2 ms on every rank, on the path where every rank waits for the slowest)."""
        offsets = [0]
        for dim in dims:
            size, stride = self._shape[dim]
            offsets = [offset + step * stride for offset in offsets for step in range(size)]
        return tuple(offsets)

    def _ranks_at(self, positions: Iterable[int]) -> tuple[int, ...]:
        """The global ranks at ``positions`` (plain ints)."""
        members = self.members
        return tuple(positions) if members is None else tuple(members[p] for p in positions)

    def _first_position(self, position: int, dims: Sequence[str]) -> int:
        return position - sum(((position // stride) % size) * stride
                              for size, stride in (self._shape[d] for d in dims))

    def block(self, rank: int, axes: Sequence[Sequence[str]]) -> np.ndarray:
        """The global ranks of the block through ``rank`` spanned by ``axes``, one array dim per
        axis (each axis a run of dims, row-major), every other dim fixed at ``rank``'s coordinate."""
        first = self._first_position(self.position(rank), [d for axis in axes for d in axis])
        block = np.full((), first, dtype=np.int64)
        for axis in axes:
            block = block[..., None] + np.asarray(self.offsets(axis), dtype=np.int64)
        return self.global_ranks(block)

    def index_along(self, rank: int, dims: Sequence[str]) -> int:
        """``rank``'s index in its group over ``dims`` (row-major in ``dims``)."""
        position = self.position(rank)
        index = 0
        for dim in dims:
            size, stride = self._shape[dim]
            index = index * size + (position // stride) % size
        return index

    def _other_dims(self, info: RolePlan) -> tuple[str, ...]:
        assert info.dim_names is not None and info.factorization is not None
        return tuple(d for d in self.factorizations[info.factorization]
                     if d not in info.dim_names)

    @cached_property
    def _explicit_index(self) -> dict[str, dict[int, int]]:
        return {
            name: {rank: g for g, group in enumerate(role.spec.ranks or ()) for rank in group}
            for name, role in self._roles.items()
            if role.dim_names is None
        }

    def group_index(self, role: str | RolePlan, rank: int) -> int | None:
        """Index (in :meth:`rank_groups` order) of the group of ``role`` holding ``rank``; None if none."""
        info = self._info(role)
        position = self.position(rank)
        if info.dim_names is None:
            return self._explicit_index[info.name].get(position)
        return self.index_along(rank, self._other_dims(info))

    def ranks_of(self, role: str | RolePlan, rank: int) -> tuple[int, ...] | None:
        """Global ranks of the group of ``role`` that holds ``rank`` (None: the rank has none).

        What ``registry.ranks(role)`` returns for this rank, planned without a job. Computed from
        ``rank``'s coordinates alone: O(group size), whatever the world size.

        Example: dims ``{"dp_shard": 2, "cp": 2}``, role ``cp``: rank 0 and 1 get ``(0, 1)``,
        rank 2 and 3 get ``(2, 3)``; role ``dp_shard``: rank 0 and 2 get ``(0, 2)``.
        """
        info = self._info(role)
        position = self.position(rank)
        if info.dim_names is None:
            index = self._explicit_index[info.name].get(position)
            if index is None:
                return None
            return self._ranks_at((info.spec.ranks or [])[index])
        if info.spans_world:
            return self.members if self.members is not None else tuple(range(self.world_size))
        base = self._first_position(position, info.dim_names)
        return self._ranks_at(base + offset for offset in self.offsets(info.dim_names))

    group_of = ranks_of
    """Alias of :meth:`ranks_of` (the name before 0.2)."""

    def rank_groups(self, role: str | RolePlan) -> list[tuple[int, ...]]:
        """The global ranks of every group of ``role``, in canonical (creation) order.

        Rank tuples, not process groups (``registry.group(role)`` is this rank's ProcessGroup).
        Materialises the whole role.
        """
        info = self._info(role)
        if info.dim_names is None:
            return [self._ranks_at(group) for group in info.spec.ranks or ()]
        offsets = self.offsets(info.dim_names)
        return [self._ranks_at(base + offset for offset in offsets)
                for base in self.offsets(self._other_dims(info))]

    groups = rank_groups
    """Alias of :meth:`rank_groups` (the name before 0.2)."""

    def communicators_per_rank(self, rank: int) -> int:
        """How many role communicators ``rank`` joins (one per role it is a member of)."""
        return sum(1 for name in self._roles if self.group_index(name, rank) is not None)

    # ----------------------------------------------------------------------------- fingerprint
    def canonical(self) -> dict[str, Any]:
        """The layout in a canonical, JSON-ready form: dims as ordered pairs, roles in order."""
        return {
            "version": FINGERPRINT_VERSION,
            "dims": [[name, size] for name, size in self.layout.dims.items()],
            "roles": [role.model_dump(mode="json") for role in self.layout.roles],
            # Only when present, so layouts without views keep their fingerprint.
            **({"views": [[view, [[d, n] for d, n in dims.items()]]
                          for view, dims in self.layout.views.items()]}
               if self.layout.views else {}),
            # Likewise only when present: ranks that disagree on what may shrink must not agree.
            **({"elastic": self.layout.elastic.model_dump(mode="json")}
               if self.layout.elastic is not None else {}),
            # Only when off: every rank must publish its status for a timeout to name who is behind.
            **({"flight_recorder": False} if not self.layout.flight_recorder else {}),
        }

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical layout: equal exactly when dims (in order) and roles are equal."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self, rank: int | None = None, max_groups: int | None = 16) -> dict[str, Any]:
        """A JSON-ready summary (what ``commgroups plan --json`` prints).

        A role's ``groups`` are listed when it has at most ``max_groups`` groups holding at most
        :data:`MAX_LISTED_RANKS` ranks in all, and ``rank_group`` when it holds at most that many
        (``rank_group_listed`` says which), so the summary of the largest layout stays small.
        """
        roles: list[dict[str, Any]] = []
        for name, info in self._roles.items():
            entry: dict[str, Any] = {
                "name": name,
                "dims": list(info.dim_names) if info.dim_names is not None else None,
                "backend": info.spec.backend,
                "group_size": info.group_size,
                "num_groups": info.num_groups,
                "spans_world": info.spans_world,
                "regular": info.regular,
            }
            listed = info.num_groups * info.group_size <= MAX_LISTED_RANKS
            if (max_groups is None or info.num_groups <= max_groups) and listed:
                entry["groups"] = [list(g) for g in self.rank_groups(name)]
            if rank is not None:
                # A group of more than MAX_LISTED_RANKS ranks is not listed (rank_group_listed).
                small = info.group_size <= MAX_LISTED_RANKS
                mine = self.ranks_of(name, rank) if small else None
                entry["rank_group"] = list(mine) if mine is not None else None
                entry["rank_group_listed"] = small
            roles.append(entry)
        result: dict[str, Any] = {
            "world_size": self.world_size,
            "dims": dict(self.layout.dims),
            **({"views": {v: dict(d) for v, d in self.layout.views.items()}}
               if self.layout.views else {}),
            "fingerprint": self.fingerprint,
            "regular": self.is_regular,
            "roles": roles,
        }
        if rank is not None:
            result["rank"] = rank
            result["coords"] = self.coords(rank)
            result["communicators_per_rank"] = self.communicators_per_rank(rank)
        return result


def _short_ranks(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"[{shown}{', ...' if len(ranks) > limit else ''}] ({len(ranks)} ranks)"


def plan(layout: Layout, members: Sequence[int] | np.ndarray | None = None) -> Plan:
    """Plan ``layout``: every role's rank groups and the layout's fingerprint, no communication.

    ``members``: the global rank at each layout position, after a rank loss (see :class:`Plan`).
    """
    return Plan(layout, members)
