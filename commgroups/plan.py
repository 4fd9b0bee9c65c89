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
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from commgroups.specs import WORLD, Layout, RoleSpec

__all__ = ["Plan", "RolePlan", "plan"]

FINGERPRINT_VERSION = 1


@dataclass(frozen=True)
class RolePlan:
    """The shape of one role's groups.

    ``regular`` is True when every rank of the world is in exactly one group of the role and all
    groups have the same size: the condition for member-only (local) creation.
    """

    name: str
    dims: tuple[str, ...] | None
    spans_world: bool
    group_size: int
    num_groups: int
    regular: bool
    spec: RoleSpec


class Plan:
    """Every role's rank groups for a layout, in one canonical order; pure and deterministic."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.world_size = layout.world_size
        self.dim_names: tuple[str, ...] = tuple(layout.dims)
        self.dim_sizes: tuple[int, ...] = tuple(layout.dims.values())
        strides = [1] * len(self.dim_sizes)
        for i in range(len(self.dim_sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * self.dim_sizes[i + 1]
        self.dim_strides: tuple[int, ...] = tuple(strides)
        self._roles: dict[str, RolePlan] = {
            spec.name: self._role_plan(spec) for spec in layout.roles
        }

    # ----------------------------------------------------------------------------- role shapes
    def _role_plan(self, spec: RoleSpec) -> RolePlan:
        if spec.ranks is not None:
            sizes = {len(group) for group in spec.ranks}
            covered = sum(len(group) for group in spec.ranks)
            return RolePlan(
                name=spec.name,
                dims=None,
                spans_world=covered == self.world_size and len(spec.ranks) == 1,
                group_size=max(sizes),
                num_groups=len(spec.ranks),
                regular=covered == self.world_size and len(sizes) == 1,
                spec=spec,
            )
        dims = self.dim_names if spec.dims == WORLD else tuple(spec.dims or ())
        size = math.prod(self.layout.dims[d] for d in dims)
        return RolePlan(
            name=spec.name,
            dims=dims,
            spans_world=size == self.world_size,
            group_size=size,
            num_groups=self.world_size // size,
            regular=True,
            spec=spec,
        )

    @property
    def roles(self) -> tuple[str, ...]:
        """Role names in creation order."""
        return tuple(self._roles)

    def role(self, name: str) -> RolePlan:
        """The :class:`RolePlan` of ``name``; KeyError listing the known roles otherwise."""
        try:
            return self._roles[name]
        except KeyError:
            raise KeyError(
                f"unknown role {name!r}; known roles: {', '.join(self._roles)}"
            ) from None

    @property
    def is_regular(self) -> bool:
        """True when every role is regular (each rank in exactly one equal-sized group)."""
        return all(role.regular for role in self._roles.values())

    # ----------------------------------------------------------------------------- rank groups
    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` on every dim."""
        self._check_rank(rank)
        return {
            name: (rank // stride) % size
            for name, size, stride in zip(self.dim_names, self.dim_sizes, self.dim_strides)
        }

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's world of {self.world_size}")

    def offsets(self, dims: Sequence[str]) -> np.ndarray:
        """Rank offsets of a group's members from its first rank, in row-major order of ``dims``."""
        offsets = np.zeros(1, dtype=np.int64)
        for dim in dims:
            i = self.dim_names.index(dim)
            steps = np.arange(self.dim_sizes[i], dtype=np.int64) * self.dim_strides[i]
            offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
        return offsets

    @cached_property
    def _explicit_index(self) -> dict[str, dict[int, int]]:
        return {
            name: {rank: g for g, group in enumerate(role.spec.ranks or ()) for rank in group}
            for name, role in self._roles.items()
            if role.dims is None
        }

    def group_index(self, role: str, rank: int) -> int | None:
        """Index (in :meth:`groups` order) of the group of ``role`` holding ``rank``; None if none."""
        info = self.role(role)
        self._check_rank(rank)
        if info.dims is None:
            return self._explicit_index[role].get(rank)
        index = 0
        for name, size, stride in zip(self.dim_names, self.dim_sizes, self.dim_strides):
            if name not in info.dims:
                index = index * size + (rank // stride) % size
        return index

    def group_of(self, role: str, rank: int) -> tuple[int, ...] | None:
        """Global ranks of the group of ``role`` that holds ``rank`` (None: the rank has none).

        Computed from ``rank``'s coordinates alone: O(group size), whatever the world size.
        """
        info = self.role(role)
        self._check_rank(rank)
        if info.dims is None:
            index = self._explicit_index[role].get(rank)
            return None if index is None else tuple((info.spec.ranks or [])[index])
        if info.spans_world:
            return tuple(range(self.world_size))
        base = sum(
            ((rank // stride) % size) * stride
            for name, size, stride in zip(self.dim_names, self.dim_sizes, self.dim_strides)
            if name not in info.dims
        )
        return tuple((self.offsets(info.dims) + base).tolist())

    def groups(self, role: str) -> list[tuple[int, ...]]:
        """Every group of ``role`` in canonical (creation) order; materialises the whole role."""
        info = self.role(role)
        if info.dims is None:
            return [tuple(group) for group in info.spec.ranks or ()]
        others = tuple(d for d in self.dim_names if d not in info.dims)
        bases = self.offsets(others)
        members = bases[:, None] + self.offsets(info.dims)[None, :]
        return [tuple(row) for row in members.tolist()]

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
        }

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical layout: equal exactly when dims (in order) and roles are equal."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self, rank: int | None = None, max_groups: int | None = 16) -> dict[str, Any]:
        """A JSON-ready summary (what ``commgroups plan --json`` prints)."""
        roles: list[dict[str, Any]] = []
        for name, info in self._roles.items():
            entry: dict[str, Any] = {
                "name": name,
                "dims": list(info.dims) if info.dims is not None else None,
                "backend": info.spec.backend,
                "group_size": info.group_size,
                "num_groups": info.num_groups,
                "spans_world": info.spans_world,
                "regular": info.regular,
            }
            if max_groups is None or info.num_groups <= max_groups:
                entry["groups"] = [list(g) for g in self.groups(name)]
            if rank is not None:
                mine = self.group_of(name, rank)
                entry["rank_group"] = list(mine) if mine is not None else None
            roles.append(entry)
        result: dict[str, Any] = {
            "world_size": self.world_size,
            "dims": dict(self.layout.dims),
            "fingerprint": self.fingerprint,
            "regular": self.is_regular,
            "roles": roles,
        }
        if rank is not None:
            result["rank"] = rank
            result["coords"] = self.coords(rank)
            result["communicators_per_rank"] = self.communicators_per_rank(rank)
        return result


def plan(layout: Layout) -> Plan:
    """Plan ``layout``: every role's rank groups and the layout's fingerprint, no communication."""
    return Plan(layout)
