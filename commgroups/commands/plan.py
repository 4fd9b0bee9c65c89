"""``commgroups plan LAYOUT``: print the roles, their groups, one rank's groups and the fingerprint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from commgroups.errors import ArgumentError
from commgroups.layout.auto_layout import AutoLayout, resolve_layout
from commgroups.layout.layout_io import load_layout
from commgroups.planning.memory import DEVICE_BACKENDS, MeasuredMemory, estimate_memory, load_measured
from commgroups.planning.plan import Plan
from commgroups.util.text_table import format_ranks, format_table

MAX_GROUPS_LISTED = 4096
"""The most groups per role ``--max-groups`` may ask to list."""

DEFAULT_MEASURED = "benchmarks/results/gpu/memory.json"
"""Where a committed GPU check leaves its measured communicator memory (repository root)."""


def register(subparsers: Any) -> None:
    """Add the ``plan`` sub-command."""
    parser = subparsers.add_parser(
        "plan", help="show a layout's roles and rank groups (no torch.distributed needed)"
    )
    parser.add_argument("layout", help="layout file (.toml, .yaml, .yml or .json)")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose groups to show")
    parser.add_argument("--world-size", type=int, default=None,
                        help='the world to plan for: required by a layout with an "auto" dim '
                        "(restart mode), which it sizes; a fixed layout must have this size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--max-groups", type=int, default=8,
                        help=f"list at most this many groups per role, 0..{MAX_GROUPS_LISTED} "
                        "(default 8)")
    parser.add_argument("--device", choices=DEVICE_BACKENDS, default="nccl",
                        help="what backend='device' roles are for the memory estimate (default nccl)")
    parser.add_argument("--measured", nargs="?", const=DEFAULT_MEASURED, metavar="MEMORY_JSON",
                        help="use a GPU check's measured per-communicator memory where it differs "
                        f"from the estimates (no path: {DEFAULT_MEASURED})")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan of ``args.layout``."""
    if not 0 <= args.max_groups <= MAX_GROUPS_LISTED:
        raise ArgumentError(
            f"--max-groups: {args.max_groups} is outside 0..{MAX_GROUPS_LISTED}; fix: list fewer "
            "groups (--json prints every field of the plan)",
            field="--max-groups",
        )
    loaded = load_layout(args.layout)
    if isinstance(loaded, AutoLayout) and args.world_size is None:
        raise ArgumentError(
            f"--world-size: the layout's '{loaded.auto_dim}' is \"auto\" (restart mode) and takes "
            "its size from the world; fix: pass --world-size N, a multiple of "
            f"{loaded.fixed_size} and at least {loaded.minimum_world_size}",
            field="--world-size",
        )
    plan = Plan(resolve_layout(loaded, args.world_size) if args.world_size is not None
                or isinstance(loaded, AutoLayout) else loaded)
    if not 0 <= args.rank < plan.world_size:
        raise ArgumentError(
            f"--rank: {args.rank} is outside the layout's ranks; fix: use 0..{plan.world_size - 1}",
            field="--rank",
        )
    measured: MeasuredMemory | None = None
    if args.measured is not None:
        try:
            measured = load_measured(args.measured)
        except (ValueError, OSError, RecursionError) as error:
            text = str(error)[:300]
            # load_measured's own errors name their fix; others (a bare OSError) get one here.
            fix = "" if "fix:" in text else "; fix: pass a memory.json written by make gpu-check"
            raise ArgumentError(f"--measured: {text}{fix}", field="--measured") from None
    summary = plan.to_dict(rank=args.rank, max_groups=args.max_groups)
    memory = estimate_memory(plan.layout, args.rank, device_backend=args.device, measured=measured)
    if args.json:
        summary["memory"] = memory.to_dict()
        print(json.dumps(summary, indent=2))
        return 0
    print(render(plan, summary, args.max_groups))
    print()
    print(memory.text())
    return 0


def render(plan: Plan, summary: dict[str, Any], max_groups: int) -> str:
    """The plan as readable text."""
    dims = " x ".join(f"{k}={v}" for k, v in summary["dims"].items())
    lines = [
        f"layout: {dims} (world size {summary['world_size']})",
        f"fingerprint: {summary['fingerprint']}",
        "",
    ]
    header = ("role", "dims", "backend", "group size", "groups", "regular")
    rows = []
    for role in summary["roles"]:
        dims_text = "explicit" if role["dims"] is None else (
            "world" if plan.layout.role(role["name"]).dims == "world" else " x ".join(role["dims"])
        )
        rows.append((role["name"], dims_text, role["backend"], str(role["group_size"]),
                     str(role["num_groups"]), "yes" if role["regular"] else "no"))
    lines += format_table(header, rows)
    rank = summary["rank"]
    coords = ", ".join(f"{k}={v}" for k, v in summary["coords"].items())
    lines += ["", f"rank {rank} ({coords}): {summary['communicators_per_rank']} communicators"]
    for role in summary["roles"]:
        mine = role["rank_group"]
        if not role["rank_group_listed"]:
            lines.append(f"  {role['name']}: {role['group_size']} ranks (not listed)")
            continue
        lines.append(f"  {role['name']}: {'-' if mine is None else format_ranks(mine)}")
    lines += ["", f"groups (up to {max_groups} per role):"]
    for role in summary["roles"]:
        groups = role.get("groups")
        if groups is None:
            lines.append(f"  {role['name']}: {role['num_groups']} groups (not listed)")
            continue
        lines.append(f"  {role['name']}: " + " ".join(format_ranks(g) for g in groups))
    return "\n".join(lines)
