"""The merged audit of a run: per-group call counts and hazards, as text or JSON.

No torch import (see :mod:`commgroups.audit.records`); :func:`commgroups.audit.merge.merge` builds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from commgroups.audit.hazards import Hazard
from commgroups.audit.records import group_sort_key, rank_span

__all__ = ["AuditReport"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Merged per-rank recordings and the hazards found in them.

    Args:
        ranks: the ranks whose recordings were merged, ascending.
        world_size: the largest world size the recordings name (None when none does).
        hazards: every hazard found (see :func:`commgroups.audit.hazards.find_hazards`).
        summary: ``{"groups": {name: {"ranks", "backend", "default", "roles", "calls",
            "blocking", "async"[, "functional"][, "blocking_async_roles"]}}}``, the call counts
            summed over the merged ranks; ``functional`` (only where some) counts the functional
            collectives (``_c10d_functional.*``, async, counted in ``async`` too);
            ``blocking_async_roles`` (role -> count, only where some) counts the blocking calls
            on a group whose compute role asks for async-and-wait.

    Example::

        report = cg.audit.merge_dir("/tmp/audit")
        report.ok                                   # False
        print(report.render())
        # audit: 4 rank file(s), world size 4; calls per group, summed over ranks:
        #   group 0 (default group) roles=cp,fsdp backend=gloo calls=96 blocking=8 async=88
        #   group 3 roles=dp_replicate backend=gloo calls=80 blocking=72 async=8 \
        #       blocking_on_async_and_wait_role=dp_replicate:72
        # 2 hazard(s):
        # - [error] aliasing on group 0 (ranks 0..3): role(s) cp, fsdp run on the default group ...
    """

    ranks: tuple[int, ...]
    world_size: int | None
    hazards: tuple[Hazard, ...]
    summary: dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when no hazard was found."""
        return not self.hazards

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``commgroups audit --json`` prints).

        Returns:
            ``{"ranks", "world_size", "ok", "summary", "hazards"}``, hazards as
            :meth:`Hazard.to_dict`.
        """
        return {"ranks": list(self.ranks), "world_size": self.world_size,
                "ok": self.ok, "summary": self.summary,
                "hazards": [h.to_dict() for h in self.hazards]}

    def render(self) -> str:
        """The report as readable text (what ``commgroups audit`` prints).

        Returns:
            One line per group with its call counts, then one line per hazard (or
            ``no hazards found``).
        """
        lines = [f"audit: {len(self.ranks)} rank file(s), world size {self.world_size}; "
                 "calls per group, summed over ranks:"]
        for name, group in sorted(self.summary["groups"].items(),
                                  key=lambda kv: group_sort_key(kv[0])):
            roles = ",".join(group["roles"]) or "-"
            tag = " (default group)" if group["default"] else ""
            unmet = group.get("blocking_async_roles") or {}
            # Blocking calls on a role that asks for async-and-wait are named: the rule missed them.
            said = "".join(f" blocking_on_async_and_wait_role={role}:{count}"
                           for role, count in sorted(unmet.items()))
            functional = f" functional={group['functional']}" if group.get("functional") else ""
            lines.append(f"  group {name}{tag} roles={roles} backend={group['backend']} "
                         f"calls={group['calls']} blocking={group['blocking']} "
                         f"async={group['async']}{functional}{said}")
        if self.ok:
            lines.append("no hazards found")
        else:
            lines.append(f"{len(self.hazards)} hazard(s):")
            for hazard in self.hazards:
                lines.append(f"- [{hazard.severity}] {hazard.kind} on group {hazard.group} "
                             f"(ranks {rank_span(hazard.ranks)}): {hazard.message}")
        return "\n".join(lines)
