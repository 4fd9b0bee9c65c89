"""Hazards in recorded collectives, and merging per-rank audit files.

Pure functions over the per-rank dicts :meth:`Recorder.to_dict` produces (and the files it writes):
no torch.distributed needed, so ``commgroups audit DIR`` runs anywhere. Hazard kinds:

- ``aliasing``: the default group does work a role owns: a role whose group *is* the default group
  (plain ``DeviceMesh`` hands it back when a dim spans the world), or collectives on the default
  group while a registry role owns a dedicated group over the same ranks.
- ``mixed_streams``: one communicator driven from more than one stream where a call was blocking.
  Under ProcessGroupNCCL/RCCL (torch >= 2.8) a blocking call runs on the caller's stream and an async
  one on the group's own stream, unordered: the seed's deadlock. On gloo the host serializes calls,
  so there it is reported as latent (severity ``warning``): the same code deadlocks on NCCL/RCCL.
- ``sequence_mismatch``: ranks of one group issued different (op, shapes, dtypes) sequences, or
  different numbers of calls: a hang or silent corruption. Needs every member's file.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from commgroups.audit._recorder import FILE_FORMAT, P2P_OPS
from commgroups.errors import CommGroupsError

__all__ = [
    "AuditFileError",
    "AuditReport",
    "Hazard",
    "find_hazards",
    "load_dir",
    "merge",
    "merge_dir",
]

# Ops whose tensors have the same shapes on every rank of a correct program; for the others (lists
# with root-only or uneven entries, split sizes) only op and dtypes are compared across ranks.
_UNIFORM_SHAPE_OPS = frozenset({
    "c10d.allreduce_", "c10d.allreduce_coalesced_", "c10d.broadcast_", "c10d.reduce_",
    "c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allgather_into_tensor_coalesced_",
    "c10d.reduce_scatter_tensor_coalesced_", "c10d.barrier",
    "_c10d_functional.all_reduce", "_c10d_functional.all_reduce_",
    "_c10d_functional.all_reduce_coalesced", "_c10d_functional.all_reduce_coalesced_",
    "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor_out",
    "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.broadcast",
    "_c10d_functional.broadcast_",
})


# How many distinct callers of blocking calls a mixed_streams hazard lists.
_MAX_CALLERS = 8


class AuditFileError(CommGroupsError, ValueError):
    """An audit directory or file cannot be read as commgroups audit output."""


@dataclasses.dataclass(frozen=True)
class Hazard:
    """One named hazard: ``kind`` (aliasing, mixed_streams, sequence_mismatch), ``severity``
    (error: breaks on this backend; warning: latent here, breaks on NCCL/RCCL), the group and roles
    involved, the ranks where it was seen, a message naming the fix, and details for tools."""

    kind: str
    severity: str
    group: str
    roles: tuple[str, ...]
    ranks: tuple[int, ...]
    message: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = dataclasses.asdict(self)
        data["roles"], data["ranks"] = list(self.roles), list(self.ranks)
        return data


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Merged per-rank recordings and the hazards found in them."""

    ranks: tuple[int, ...]
    world_size: int | None
    hazards: tuple[Hazard, ...]
    summary: dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when no hazard was found."""
        return not self.hazards

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what ``commgroups audit --json`` prints)."""
        return {"ranks": list(self.ranks), "world_size": self.world_size,
                "ok": self.ok, "summary": self.summary,
                "hazards": [h.to_dict() for h in self.hazards]}

    def render(self) -> str:
        """Readable text: per-group call counts, then each hazard."""
        lines = [f"audit: {len(self.ranks)} rank file(s), world size {self.world_size}; "
                 "calls per group, summed over ranks:"]
        for name, group in sorted(self.summary["groups"].items(), key=lambda kv: _group_key(kv[0])):
            roles = ",".join(group["roles"]) or "-"
            tag = " (default group)" if group["default"] else ""
            lines.append(f"  group {name}{tag} roles={roles} backend={group['backend']} "
                         f"calls={group['calls']} blocking={group['blocking']} "
                         f"async={group['async']}")
        if self.ok:
            lines.append("no hazards found")
        else:
            lines.append(f"{len(self.hazards)} hazard(s):")
            for hazard in self.hazards:
                ranks = _ranks_text(hazard.ranks)
                lines.append(f"- [{hazard.severity}] {hazard.kind} on group {hazard.group} "
                             f"(ranks {ranks}): {hazard.message}")
        return "\n".join(lines)


def _group_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return ",".join(map(str, ranks))


def _check_file(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise AuditFileError(
            f"{source}: not a commgroups audit file (want format {FILE_FORMAT!r}); fix: point at "
            "the directory COMMGROUPS_AUDIT_DIR named, holding only rank*.json files"
        )
    return data


def load_dir(directory: str | Path) -> list[dict[str, Any]]:
    """Read every ``rank*.json`` in ``directory``, sorted by rank."""
    path = Path(directory)
    if not path.is_dir():
        raise AuditFileError(f"{path}: no such directory; fix: pass the COMMGROUPS_AUDIT_DIR of a run")
    files = sorted(path.glob("rank*.json"))
    if not files:
        raise AuditFileError(
            f"{path}: no rank*.json files; fix: run with COMMGROUPS_AUDIT_DIR={path} around a "
            "cg.audit.from_env() block, or write files with Recorder.write()"
        )
    loaded = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise AuditFileError(f"{file}: cannot read it ({error}); fix: rerun that rank") from error
        loaded.append(_check_file(data, str(file)))
    seen: Counter[int] = Counter(int(d["rank"]) for d in loaded)
    twice = sorted(r for r, n in seen.items() if n > 1)
    if twice:
        raise AuditFileError(f"{path}: ranks {twice} have more than one file; fix: use one "
                             "directory per run")
    return sorted(loaded, key=lambda d: int(d["rank"]))


def merge_dir(directory: str | Path) -> AuditReport:
    """Merge the per-rank files of one run and find their hazards."""
    return merge(load_dir(directory))


def merge(rank_data: Sequence[dict[str, Any]]) -> AuditReport:
    """Merge per-rank dicts (``Recorder.to_dict()``) into an :class:`AuditReport`."""
    for index, data in enumerate(rank_data):
        _check_file(data, f"rank data #{index}")
    groups: dict[str, dict[str, Any]] = {}
    for data in rank_data:
        for name, info in data["groups"].items():
            entry = groups.setdefault(name, {"ranks": info["ranks"], "backend": info["backend"],
                                             "default": info["default"], "roles": [],
                                             "calls": 0, "blocking": 0, "async": 0})
            entry["roles"] = sorted(set(entry["roles"]) | set(info["roles"]))
        for rec in data["records"]:
            entry = groups[rec["group"]]
            entry["calls"] += 1
            entry["blocking"] += rec["async_op"] is False
            entry["async"] += rec["async_op"] is True
    worlds = {d["world_size"] for d in rank_data if d.get("world_size") is not None}
    return AuditReport(
        ranks=tuple(int(d["rank"]) for d in rank_data),
        world_size=max(worlds) if worlds else None,
        hazards=tuple(find_hazards(rank_data)),
        summary={"groups": groups},
    )


def find_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """Every hazard in the given per-rank recordings (one rank's alone, or a whole run's)."""
    hazards = _aliasing(rank_data) + _mixed_streams(rank_data)
    if len(rank_data) > 1:
        hazards += _sequence_mismatches(rank_data)
    return hazards


def _merge_by_key(found: Iterable[tuple[tuple[Any, ...], int, Hazard]]) -> list[Hazard]:
    """Fold per-rank hazards with the same key into one that lists every rank."""
    merged: dict[tuple[Any, ...], tuple[Hazard, list[int]]] = {}
    for key, rank, hazard in found:
        if key not in merged:
            merged[key] = (hazard, [])
        merged[key][1].append(rank)
    return [dataclasses.replace(h, ranks=tuple(sorted(set(r)))) for h, r in merged.values()]


def _aliasing(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    found = []
    for data in rank_data:
        rank, default = int(data["rank"]), data["default_group"]
        if default is None:
            continue
        on_default = [r for r in data["records"] if r["group"] == default]
        aliased = sorted(role for role, group in data["roles"].items() if group == default)
        first = on_default[0]["caller"] if on_default else None
        if aliased:
            message = (
                f"role(s) {', '.join(aliased)} run on the default group {default} "
                f"({len(on_default)} call(s) recorded on it), sharing one communicator with "
                "everything else that uses the default group; fix: build the roles with "
                "commgroups.GroupRegistry (a dedicated group per role, also when it spans the "
                "world) instead of plain DeviceMesh"
            )
            found.append((("role", default, tuple(aliased)), rank, Hazard(
                "aliasing", "error", default, tuple(aliased), (), message,
                {"calls": len(on_default), "first_caller": first})))
            continue
        default_ranks = data["groups"].get(default, {}).get("ranks")
        same = sorted(role for role, ranks in data["role_ranks"].items()
                      if ranks is not None and default_ranks is not None
                      and sorted(ranks) == sorted(default_ranks))
        if on_default and same:
            ops = Counter(r["op"] for r in on_default)
            message = (
                f"{len(on_default)} collective(s) ran on the default group {default} although "
                f"role(s) {', '.join(same)} own a dedicated group over the same ranks (first from "
                f"{first}); fix: pass registry.group(role) (process_group= for DCP, the registry's "
                "device_mesh for FSDP2/DTensor) or use registry.collectives(role)"
            )
            found.append((("default", default, tuple(same)), rank, Hazard(
                "aliasing", "error", default, tuple(same), (), message,
                {"calls": len(on_default), "ops": dict(ops), "first_caller": first})))
    return _merge_by_key(found)


def _mixed_streams(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    found = []
    for data in rank_data:
        rank = int(data["rank"])
        by_group: dict[str, list[dict[str, Any]]] = {}
        for rec in data["records"]:
            if rec["exec_stream"] is not None:
                by_group.setdefault(rec["group"], []).append(rec)
        for group, records in by_group.items():
            streams = Counter(r["exec_stream"] for r in records)
            blocking = [r for r in records if r["async_op"] is False]
            if len(streams) < 2 or not blocking:
                continue
            asynchronous = [r for r in records if r["async_op"] is True]
            info = data["groups"].get(group, {})
            on_cuda = any(r["device"].startswith("cuda") for r in records)
            live = on_cuda and info.get("backend") == "nccl"
            roles = tuple(info.get("roles", []))
            where = (f"{len(streams)} streams" if live else
                     f"{len(streams)} streams under NCCL/RCCL's rule (latent on "
                     f"{info.get('backend') or 'this backend'}, which serializes on the host)")
            message = (
                f"one communicator driven from {where}: {len(blocking)} blocking call(s) on the "
                f"caller's stream (first from {blocking[0]['caller']}) and {len(asynchronous)} "
                f"async call(s) on the group's stream"
                + (f" (first from {asynchronous[0]['caller']})" if asynchronous else "")
                + "; nothing orders them, so ranks can deadlock; fix: issue every call "
                "async_op=True and wait (registry.collectives(role), cg.AsyncWaitDist for "
                "spmd_types.set_dist, or a cg.async_and_wait() scope) and give the role a "
                "dedicated group"
            )
            blocking_ops = Counter(r["op"] for r in blocking)
            callers = sorted({r["caller"] for r in blocking})
            found.append((("streams", group), rank, Hazard(
                "mixed_streams", "error" if live else "warning", group, roles, (), message,
                {"streams": dict(streams), "blocking": len(blocking),
                 "async": len(asynchronous), "blocking_ops": dict(blocking_ops),
                 "blocking_callers": callers[:_MAX_CALLERS]})))
    return _merge_by_key(found)


def _signature(rec: dict[str, Any]) -> tuple[Any, ...]:
    shapes = tuple(map(tuple, rec["shapes"])) if rec["op"] in _UNIFORM_SHAPE_OPS else None
    return (rec["op"], tuple(sorted(set(rec["dtypes"]))), shapes)


def _describe(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "nothing"
    return f"{rec['op']} shapes={rec['shapes']} dtypes={rec['dtypes']} at {rec['caller']}"


def _sequence_mismatches(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    have = {int(d["rank"]): d for d in rank_data}
    members: dict[str, set[int]] = {}
    roles: dict[str, set[str]] = {}
    for data in rank_data:
        for name, info in data["groups"].items():
            ranks = info["ranks"] if info["ranks"] is not None else [int(data["rank"])]
            members.setdefault(name, set()).update(r for r in ranks if r in have)
            roles.setdefault(name, set()).update(info["roles"])
    hazards = []
    for group, ranks in sorted(members.items(), key=lambda kv: _group_key(kv[0])):
        sequences = {
            rank: [r for r in have[rank]["records"] if r["group"] == group and r["op"] not in P2P_OPS]
            for rank in sorted(ranks)
        }
        if len(sequences) < 2:
            continue
        longest = max(len(s) for s in sequences.values())
        for index in range(longest):
            at = {rank: (seq[index] if index < len(seq) else None) for rank, seq in sequences.items()}
            signatures = {rank: (_signature(r) if r is not None else None) for rank, r in at.items()}
            if len(set(signatures.values())) == 1:
                continue
            variants: dict[Any, list[int]] = {}
            for rank, signature in signatures.items():
                variants.setdefault(signature, []).append(rank)
            parts = [f"ranks {_ranks_text(rs)}: {_describe(at[rs[0]])}" for rs in variants.values()]
            counts = {rank: len(seq) for rank, seq in sequences.items()}
            message = (
                f"call #{index + 1} on this group differs across ranks: " + "; ".join(parts)
                + f" (calls per rank: {counts}); mismatched collectives hang or corrupt data; "
                "fix: make every rank of the group issue the same collectives in the same order"
            )
            hazards.append(Hazard("sequence_mismatch", "error", group, tuple(sorted(roles[group])),
                                  tuple(sorted(ranks)), message,
                                  {"index": index, "calls_per_rank": counts}))
            break  # everything after the first divergence is noise
    return hazards
