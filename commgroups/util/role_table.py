"""The registry's readable table: one row per role (dims, backend, size, groups, creation, timeout)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan
from commgroups.util.text_table import format_ranks, format_table

__all__ = ["LiveRole", "role_table"]

_HEADER = ("role", "dims", "backend", "size", "groups", "creation", "timeout", "async_and_wait",
           "this rank's group")


@dataclass(frozen=True)
class LiveRole:
    """What a created role is on this rank: its resolved backend, creation path and timeout."""

    backend: str
    method: str
    timeout_s: float


def role_table(layout: Layout, plan: Plan, rank: int, state: str,
               live: Mapping[str, LiveRole] | None) -> str:
    """A title line and a row per role; ``live`` None: not created (the requested backends)."""
    rows = []
    for name in layout.role_names:
        spec, info = layout.role(name), plan.role(name)
        dims = "world" if spec.dims == "world" else ("x".join(info.dim_names) if info.dim_names
                                                      else "explicit")
        if live is not None:
            made = live[name]
            backend, method, timeout = made.backend, made.method, f"{made.timeout_s:g}s"
            mine = plan.ranks_of(name, rank)
            group_text = "-" if mine is None else format_ranks(mine)
        else:
            backend, method, group_text = spec.backend, "-", "-"
            timeout = "default" if spec.timeout_s is None else f"{spec.timeout_s:g}s"
        rows.append((name, dims, backend, str(info.group_size), str(info.num_groups), method,
                     timeout, "on" if spec.async_and_wait else "off", group_text))
    title = (f"GroupRegistry: world {layout.world_size} "
             f"({', '.join(f'{k}={v}' for k, v in layout.dims.items())}), "
             f"fingerprint {plan.fingerprint[:12]}, state {state}")
    return "\n".join([title, *format_table(_HEADER, rows)])
