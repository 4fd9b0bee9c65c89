"""The demo's readable report and its JSON file."""

from __future__ import annotations

import json
from typing import Any

from commgroups.util.text_table import format_table

__all__ = ["json_summary", "render", "write_json"]

JSON_KEYS = ("world_size", "aliases_of_default_group", "hazards", "checkpoint_roundtrip", "losses",
             "roles")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}..{ranks[-1]}]"
    return str(ranks)


def _hazard_line(hazard: dict[str, Any]) -> str:
    kind = hazard.get("kind", "hazard")
    text = hazard.get("message") or ", ".join(f"{k}={v}" for k, v in hazard.items() if k != "kind")
    return f"  - {kind}: {text}"


def render(result: dict[str, Any]) -> str:
    """The result of a run as text: roles and groups, losses, hazards, checkpoint."""
    mode = result["mode"]
    title = ("commgroups demo: GroupRegistry roles" if mode == "registry"
             else "commgroups demo: baseline (plain init_device_mesh groups)")
    dims = ", ".join(f"{k}={v}" for k, v in result["layout"].items())
    lines = [title, f"world {result['world_size']} ({dims}), {result['steps']} steps, "
             f"{result['elapsed_s']:.1f}s", ""]
    header = ("role", "ranks (rank 0)", "backend", "default group?", "from")
    rows = [
        (name, _ranks(info["ranks"]), info["backend"], "YES" if info["is_default_group"] else "no",
         info["source"])
        for name, info in result["roles"].items()
    ]
    lines += format_table(header, rows)
    aliases = result["aliases_of_default_group"]
    lines.append(f"roles that alias the default group: {aliases}"
                 + (f" ({', '.join(result['aliased_roles'])})" if aliases else ""))
    lines += ["", "losses: " + "  ".join(f"{v:.4f}" for v in result["losses"])]
    lines.append(f"checkpoint round trip: {result['checkpoint_roundtrip']}")
    lines.append("")
    audit = result["audit"]
    if audit != "on":
        lines.append(f"audit: {audit}")
    elif result["hazards"]:
        lines.append(f"audit: {len(result['hazards'])} hazard(s)")
        lines += [_hazard_line(h) for h in result["hazards"]]
    else:
        lines.append("audit: no hazards")
    return "\n".join(lines)


def json_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: the documented keys first, then the rest of the result."""
    summary = {key: result[key] for key in JSON_KEYS}
    summary.update({k: v for k, v in result.items() if k not in summary})
    return summary


def write_json(result: dict[str, Any], path: str) -> None:
    """Write :func:`json_summary` of ``result`` to ``path``."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(json_summary(result), handle, indent=2)
        handle.write("\n")
