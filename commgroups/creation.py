"""How a role's groups are created: the same calls, in the same order, on every rank.

``all_ranks`` is torch's default contract: every rank calls ``new_group`` for every group of the role
(O(world / group size) calls per rank). Faster, still-safe paths are chosen per role by
:func:`choose_method`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist

from commgroups.backends import BackendAdapter
from commgroups.plan import Plan
from commgroups.specs import RoleOptions

__all__ = ["CREATION_MODES", "CreatedRole", "CreationMode", "choose_method", "create_role_group"]

logger = logging.getLogger(__name__)

CreationMode = Literal["auto", "all_ranks", "local", "split"]
CREATION_MODES: tuple[str, ...] = ("auto", "all_ranks", "local", "split")


@dataclass
class CreatedRole:
    """What creating one role left on this rank."""

    group: dist.ProcessGroup | None
    """This rank's group of the role; None when the rank is in no group (explicit-ranks roles)."""
    method: str
    """The creation path used: all_ranks, local or split."""
    owned: list[dist.ProcessGroup] = field(default_factory=list)
    """Groups this rank must destroy on close."""


def choose_method(mode: str, plan: Plan, role: str, adapter: BackendAdapter) -> str:
    """The creation path for ``role`` under ``mode``; the same answer on every rank."""
    del plan, role, adapter
    if mode in ("auto", "all_ranks"):
        return "all_ranks"
    raise ValueError(f"creation mode {mode!r} is not supported; use one of {CREATION_MODES}")


def create_role_group(
    plan: Plan,
    role: str,
    adapter: BackendAdapter,
    options: RoleOptions,
    timeout_s: float | None,
    rank: int,
    method: str,
    group_desc: str | None = None,
) -> CreatedRole:
    """Create ``role``'s groups by ``method`` and return this rank's. Collective over all ranks."""
    desc = group_desc or role
    mine: dist.ProcessGroup | None = None
    my_index = plan.group_index(role, rank)
    for index, ranks in enumerate(plan.groups(role)):
        # A fresh options object per group: new_group mutates it (timeout, name, split fields).
        args = adapter.group_args(options, timeout_s)
        group = dist.new_group(
            list(ranks),
            timeout=args.timeout,
            backend=args.backend,
            pg_options=args.pg_options,
            group_desc=desc,
        )
        if index == my_index:
            mine = group
    return CreatedRole(group=mine, method="all_ranks", owned=[mine] if mine is not None else [])
