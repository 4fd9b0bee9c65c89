"""A job's flight-recorder dumps merged into one table per role, with the hazards named.

Pure (no torch.distributed): reads the ``flight-g<generation>-rank<rank>.json`` files the ranks
wrote (on a timeout, a signal or ``registry.dump_flight_recorder``) and prints, per role, each
rank's last call (sequence numbers, op, call site, stream, async_op, state). Hazards:

- ``behind``: ranks whose count on the role is lower than the others' (they did not reach the
  call the others wait in); ``missing``: members of a role that wrote no file (dead, or never
  asked);
- ``mismatch``: ranks that issued different ops at the same count (both call sites named);
- ``mixed_streams``: one communicator driven from several streams beside a blocking call (the
  seed's pattern), found by :func:`commgroups.audit.hazards.mixed_stream_hazards` on the recorded
  streams.

The ``groups`` table maps each c10d group name (what torch's own flight recorder and watchdog
print) to its role and member ranks. Where torch's own dumps lie beside them (NCCL's watchdog
writes ``nccl_trace_rank_<rank>`` on a timeout; :mod:`commgroups.flight_recorder.torch_dumps`),
each rank's torch counts per group are shown by role, and ranks torch counts behind are named
(``torch_behind``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from commgroups.audit.hazards import mixed_stream_hazards
from commgroups.errors import FlightDumpError
from commgroups.flight_recorder.diagnosis import short_site
from commgroups.flight_recorder.torch_dumps import (
    TORCH_DUMP_PREFIX,
    enqueued_counts,
    load_torch_dumps,
    torch_group_rows,
)
from commgroups.util.text_table import format_ranks, format_table

__all__ = ["FlightDumpError", "FlightHazard", "FlightReport", "load_dumps", "merge", "merge_dir"]

GLOB = "flight-g*-rank*.json"


@dataclasses.dataclass(frozen=True)
class FlightHazard:
    """One hazard the merge found: ``kind`` (behind, missing, mismatch, mixed_streams,
    torch_behind), ``role``,
    the ``ranks`` involved and a ``message`` for a person."""

    kind: str
    role: str
    ranks: tuple[int, ...]
    message: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"kind": self.kind, "role": self.role, "ranks": list(self.ranks),
                "message": self.message}


@dataclasses.dataclass
class FlightReport:
    """The merged dumps: per role, one row per rank; the hazards; the group-name map; torch's
    own dumps' rows (rank, c10d group, role, torch's counts), where there were any."""

    generation: int
    rows: dict[str, list[dict[str, Any]]]
    hazards: list[FlightHazard]
    groups: dict[str, dict[str, Any]]
    torch_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No hazard found."""
        return not self.hazards

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``commgroups flight merge --json``)."""
        return {"generation": self.generation, "roles": self.rows, "groups": self.groups,
                "torch": self.torch_rows, "hazards": [hazard.to_dict() for hazard in self.hazards]}

    def render(self) -> str:
        """The tables and hazards as text."""
        lines = [f"flight recorder, generation {self.generation}"]
        header = ("rank", "count", "seq", "last op", "state", "call site", "stream", "async_op",
                  "torch's last")
        for role, rows in self.rows.items():
            lines += ["", f"role {role}:"]
            lines += format_table(header, [
                (str(row["rank"]), _text(row["count"]), _text(row["seq"]), row["op"],
                 row["state"], short_site(row["caller"]) if row["caller"] else "-",
                 _stream(row["stream"]), _text(row["async_op"]), row["torch_last"] or "-")
                for row in rows])
        lines += ["", "count: the group's own collective count (every call on it, plain and "
                  "functional too); seq: calls recorded through registry.collectives; torch's "
                  "last: the newest call torch's own flight recorder holds for the group"]
        lines += ["", "groups (c10d names, as torch's flight recorder and watchdog print them):"]
        lines += format_table(("group", "role", "backend", "ranks"), [
            (name, info["role"], info["backend"] or "-", format_ranks(info["ranks"]))
            for name, info in self.groups.items()])
        if self.torch_rows:
            lines += ["", "torch's own dumps (last enqueued / started / completed per group):"]
            lines += format_table(
                ("rank", "group", "role", "ranks", "enqueued", "started", "completed", "last"), [
                    (str(row["rank"]), row["group"][:14], row["role"] or "-",
                     format_ranks(row["ranks"]) if row["ranks"] else "-", _text(row["enqueued"]),
                     _text(row["started"]), _text(row["completed"]), row["last"] or "-")
                    for row in self.torch_rows])
        lines += ["", "hazards:" if self.hazards else "hazards: none"]
        lines += [f"- {hazard.kind} ({hazard.role}): {hazard.message}" for hazard in self.hazards]
        return "\n".join(lines)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _stream(stream: str | None) -> str:
    if not stream:
        return "-"
    return stream[:14] if stream.startswith("group:") else stream  # group names are 40 hex digits


def load_dumps(directory: str | Path) -> list[dict[str, Any]]:
    """Every dump of the newest generation in ``directory``, sorted by rank."""
    folder = Path(directory)
    dumps = []
    for path in sorted(folder.glob(GLOB)) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise FlightDumpError(f"{path}: not readable as a flight-recorder dump ({error}); "
                                  "fix: remove it or point at the directory the ranks wrote") from None
        if isinstance(data, dict) and "roles" in data and "rank" in data:
            dumps.append(data)
    if not dumps:
        raise FlightDumpError(f"{directory}: no {GLOB} files; fix: point at the directory the "
                              "ranks wrote (COMMGROUPS_FLIGHT_DIR, or the one the error named)")
    newest = max(int(d.get("generation", 0)) for d in dumps)
    return sorted((d for d in dumps if int(d.get("generation", 0)) == newest),
                  key=lambda d: int(d["rank"]))


def merge_dir(directory: str | Path, torch_dumps: str | Path | None = None,
              torch_prefix: str = TORCH_DUMP_PREFIX) -> FlightReport:
    """:func:`merge` of :func:`load_dumps`, with torch's own dumps (``<torch_prefix><rank>``
    files in ``torch_dumps``, default ``directory``) named by role where there are any."""
    report = merge(load_dumps(directory))
    rows = torch_group_rows(load_torch_dumps(torch_dumps or directory, torch_prefix),
                            report.groups)
    report.torch_rows = rows
    for group, (label, counts) in enqueued_counts(rows).items():
        behind, ahead, top = _lagging(counts)
        if behind:
            report.hazards.append(FlightHazard(
                "torch_behind", label, tuple(behind),
                f"torch's counts: rank(s) {format_ranks(behind)} enqueued up to "
                f"{min(counts[r] for r in behind)}, rank(s) {format_ranks(ahead)} {top} "
                f"(c10d group {group[:14]})"))
    return report


def _lagging(counts: Mapping[int, int]) -> tuple[list[int], list[int], int]:
    """(ranks below the highest count, ranks at it, the highest count) of rank -> count."""
    top = max(counts.values())
    return (sorted(rank for rank, count in counts.items() if count < top),
            sorted(rank for rank, count in counts.items() if count == top), top)


def _row(rank: int, role: str, info: dict[str, Any], trace: Sequence[dict[str, Any]]
         ) -> dict[str, Any]:
    entries = info.get("entries") or []
    last = entries[-1] if entries else {}
    theirs = [entry for entry in trace if entry.get("role") == role]
    torch_last = (f"{theirs[-1].get('op')} #{theirs[-1].get('group_seq')} "
                  f"({theirs[-1].get('state')})" if theirs else "")
    if not last and theirs:
        # Only plain / functional / DTensor calls on this role: torch's own recorder saw them one by
        # one (op, sequence number, call site from its frames); stream and async_op it keeps not.
        last = {"op": theirs[-1].get("op", "-"), "state": theirs[-1].get("state", "-"),
                "caller": theirs[-1].get("caller", "")}
    return {"rank": rank, "count": info.get("group_seq"), "seq": info.get("seq"),
            "op": last.get("op", "-"), "state": last.get("state", "-"),
            "caller": last.get("caller", ""), "stream": last.get("stream"),
            "async_op": last.get("async_op"), "torch_last": torch_last}


def merge(dumps: Sequence[dict[str, Any]]) -> FlightReport:
    """One report from the dumps of one generation's ranks (any subset of them).

    Example::

        report = merge([json.load(open(p)) for p in paths])
        print(report.render())     # per role: rank, count, seq, last op, call site, stream, ...
    """
    rows: dict[str, list[dict[str, Any]]] = {}
    groups: dict[str, dict[str, Any]] = {}
    members: dict[str, set[int]] = {}
    by_role: dict[str, dict[int, dict[str, Any]]] = {}
    for data in dumps:
        rank = int(data["rank"])
        for role, info in data["roles"].items():
            rows.setdefault(role, []).append(_row(rank, role, info, data.get("torch_trace") or []))
            by_role.setdefault(role, {})[rank] = info
            members.setdefault(role, set()).update(int(r) for r in info.get("ranks", []))
            name = str(info.get("group", ""))
            known = groups.setdefault(name, {"role": role, "backend": info.get("backend", ""),
                                             "ranks": [int(r) for r in info.get("ranks", [])]})
            if len(info.get("ranks", [])) > len(known["ranks"]):
                known["ranks"] = [int(r) for r in info["ranks"]]
    hazards: list[FlightHazard] = []
    for role in rows:
        hazards += _role_hazards(role, by_role[role], members[role])
    hazards += _stream_hazards(dumps)
    generation = int(dumps[0].get("generation", 0)) if dumps else 0
    return FlightReport(generation, rows, hazards, groups)


def _count(info: dict[str, Any]) -> int | None:
    value = info.get("group_seq")
    if value is None:
        value = info.get("seq")
    return None if value is None else int(value)


def _role_hazards(role: str, infos: dict[int, dict[str, Any]], members: set[int]
                  ) -> list[FlightHazard]:
    found = []
    missing = sorted(members - set(infos))
    if missing:
        found.append(FlightHazard("missing", role, tuple(missing),
                                  f"rank(s) {format_ranks(missing)} of the role wrote no dump "
                                  "(dead, or stuck where no signal or request reached them)"))
    counts = {rank: _count(info) for rank, info in infos.items()}
    known = {rank: count for rank, count in counts.items() if count is not None}
    if known:
        behind, ahead, top = _lagging(known)
        if behind:
            where = "; ".join(
                f"rank {rank} at {known[rank]}"
                + (f" (last {last['op']} at {short_site(last['caller'])})"
                   if (last := (infos[rank].get("entries") or [None])[-1]) else "")
                for rank in behind[:4])
            found.append(FlightHazard(
                "behind", role, tuple(behind),
                f"{where}{' ...' if len(behind) > 4 else ''}; rank(s) {format_ranks(ahead)} "
                f"reached {top}: the ranks behind did not issue the call the others wait in"))
    found += _mismatch(role, infos)
    return found


def _mismatch(role: str, infos: dict[int, dict[str, Any]]) -> list[FlightHazard]:
    """The first count at which two ranks recorded different ops."""
    at: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, info in infos.items():
        for entry in info.get("entries") or []:
            key = entry.get("group_seq") if entry.get("group_seq") is not None else entry.get("seq")
            if key is not None:
                at.setdefault(int(key), {})[rank] = entry
    for key in sorted(at):
        ops = {entry["op"] for entry in at[key].values()}
        if len(ops) > 1:
            seen = sorted(at[key].items())
            first_rank, first = seen[0]
            other_rank, other = next((r, e) for r, e in seen if e["op"] != first["op"])
            return [FlightHazard(
                "mismatch", role, tuple(rank for rank, _ in seen),
                f"at count {key}: rank {first_rank} issued {first['op']} at "
                f"{short_site(first['caller'])}, rank {other_rank} issued {other['op']} at "
                f"{short_site(other['caller'])}; ranks must issue the same collectives in the same "
                "order on a role")]
    return []


def _stream_hazards(dumps: Sequence[dict[str, Any]]) -> list[FlightHazard]:
    """The audit's mixed-streams rule on the recorded streams (one rule, written once)."""
    rank_data = []
    for data in dumps:
        records, groups = [], {}
        for role, info in data["roles"].items():
            name = str(info.get("group", ""))
            groups[name] = {"roles": [role], "backend": info.get("backend", "")}
            for entry in info.get("entries") or []:
                stream = entry.get("stream") or "cpu"
                records.append({"group": name, "exec_stream": stream,
                                "async_op": entry.get("async_op"), "op": entry.get("op"),
                                "caller": short_site(entry.get("caller") or ""),
                                "device": stream.split("/")[0] if stream.startswith("cuda")
                                else "cpu"})
        rank_data.append({"rank": int(data["rank"]), "records": records, "groups": groups})
    return [FlightHazard("mixed_streams", ",".join(h.roles), tuple(h.ranks),
                         f"[{h.severity}] {h.message}")
            for h in mixed_stream_hazards(rank_data)]
