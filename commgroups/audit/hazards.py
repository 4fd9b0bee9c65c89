"""The hazard rules: pure functions from per-rank recordings to named hazards.

Input: the per-rank dicts :meth:`Recorder.to_dict` produces (the schema of
:mod:`commgroups.audit.records`); no torch import, so the rules run wherever the files are. Kinds:

- ``aliasing``: the default group does work a role owns: a role whose group *is* the default group
  (plain ``DeviceMesh`` hands it back when a dim spans the world), or collectives on the default
  group while a registry role owns a dedicated group over the same ranks.
- ``mixed_streams``: one communicator driven from more than one stream where a call was blocking.
  Under ProcessGroupNCCL/RCCL (torch >= 2.8) a blocking call runs on the caller's stream and an async
  one on the group's own stream, unordered: the seed's deadlock. On gloo the host serializes calls,
  so there it is reported as latent (severity ``warning``): the same code deadlocks on NCCL/RCCL.
- ``sequence_mismatch``: ranks of one group issued different (op, shapes, dtypes) sequences, or
  different numbers of calls: a hang or silent corruption. Needs every member's file.

Role isolation (each role's traffic on its own group; recordings made with a registry):

- ``off_purpose``: collectives on a role's group outside that role's purpose: on a ``checkpoint``
  role's group (checkpoint-metadata) from anywhere but DCP, e.g. a model reduction DTensor found
  there.
- ``device_on_gloo``: device (CUDA, NPU, ...) tensors sent through a gloo group: a host round trip
  for every call, and a sign that model traffic took a metadata group.
- ``default_group``: collectives on the default group, which the registry never hands out: code
  that bypasses the registry (aliasing reports it instead where a role covers the same ranks).
- ``foreign_group``: collectives on a group the registry did not make (warning: may be the user's
  own group; torch made it when a mesh was flattened the registry had not prepared).
- ``uncounted``: a group's own collective count (gloo and NCCL keep one) moved by more than the
  audit recorded: calls it could not see (another thread, a path that skips the dispatcher).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from commgroups.audit.records import P2P_OPS, group_sort_key, rank_span

__all__ = [
    "UNIFORM_SHAPE_OPS",
    "Hazard",
    "aliasing_hazards",
    "default_group_hazards",
    "device_on_gloo_hazards",
    "find_hazards",
    "foreign_group_hazards",
    "off_purpose_hazards",
    "uncounted_hazards",
    "mixed_stream_hazards",
    "sequence_mismatch_hazards",
]

UNIFORM_SHAPE_OPS = frozenset({
    "c10d.allreduce_", "c10d.allreduce_coalesced_", "c10d.broadcast_", "c10d.reduce_",
    "c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allgather_into_tensor_coalesced_",
    "c10d.reduce_scatter_tensor_coalesced_", "c10d.barrier",
    "_c10d_functional.all_reduce", "_c10d_functional.all_reduce_",
    "_c10d_functional.all_reduce_coalesced", "_c10d_functional.all_reduce_coalesced_",
    "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor_out",
    "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.broadcast",
    "_c10d_functional.broadcast_",
})
"""Ops whose tensors have the same shapes on every rank of a correct program. For the others (lists
with root-only or uneven entries, split sizes) the sequence check compares op and dtypes only."""

# How many distinct callers of blocking calls a mixed_streams hazard lists.
_MAX_CALLERS = 8


@dataclasses.dataclass(frozen=True)
class Hazard:
    """One named hazard found in recorded collectives.

    Args:
        kind: ``aliasing``, ``mixed_streams``, ``sequence_mismatch``, ``off_purpose``,
            ``device_on_gloo``, ``default_group``, ``foreign_group`` or ``uncounted`` (see the
            module docs).
        severity: ``error`` (breaks on this backend) or ``warning`` (latent here, breaks on
            NCCL/RCCL).
        group: the c10d group name the hazard is on.
        roles: the roles involved.
        ranks: the ranks where it was seen.
        message: what is wrong and the fix, for a person.
        details: counts and callers, for tools (JSON-ready).

    Example::

        for hazard in find_hazards([rank0_data, rank1_data]):
            print(hazard.kind, hazard.ranks, hazard.message)
        # aliasing (0, 1) role(s) cp run on the default group 0 (12 call(s) recorded on it), ...
    """

    kind: str
    severity: str
    group: str
    roles: tuple[str, ...]
    ranks: tuple[int, ...]
    message: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """This hazard as JSON-ready data.

        Returns:
            A dict with one key per field; tuples become lists.
        """
        data = dataclasses.asdict(self)
        data["roles"], data["ranks"] = list(self.roles), list(self.ranks)
        return data


def find_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """Every hazard in the given per-rank recordings, one rank's alone or a whole run's.

    Args:
        rank_data: per-rank dicts as :meth:`Recorder.to_dict` makes them (or as read from the
            per-rank files).

    Returns:
        The per-rank hazards of every rank (aliasing, mixed streams, off-purpose use, device
        tensors on gloo, default-group and foreign-group traffic, uncounted calls: one hazard per
        kind and group, listing every rank it was seen on), then, given two or more ranks, the
        first sequence mismatch of each group.

    Example::

        # ranks 0..3 of cp == world built with plain DeviceMesh, read from their files
        [h.kind for h in find_hazards(datas)]   # ['aliasing', 'mixed_streams']
    """
    hazards = (aliasing_hazards(rank_data) + mixed_stream_hazards(rank_data)
               + off_purpose_hazards(rank_data) + device_on_gloo_hazards(rank_data)
               + default_group_hazards(rank_data) + foreign_group_hazards(rank_data)
               + uncounted_hazards(rank_data))
    if len(rank_data) > 1:
        hazards += sequence_mismatch_hazards(rank_data)
    return hazards


def _merge_by_key(found: Iterable[tuple[tuple[Any, ...], int, Hazard]]) -> list[Hazard]:
    """Fold per-rank hazards with the same key into one that lists every rank."""
    merged: dict[tuple[Any, ...], tuple[Hazard, list[int]]] = {}
    for key, rank, hazard in found:
        if key not in merged:
            merged[key] = (hazard, [])
        merged[key][1].append(rank)
    return [dataclasses.replace(h, ranks=tuple(sorted(set(r)))) for h, r in merged.values()]


def aliasing_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``aliasing`` rule: the default group doing a role's work.

    Args:
        rank_data: per-rank dicts (one or more ranks).

    Returns:
        One error per (default group, roles) for a role whose group is the default group, else one
        per (default group, roles) when collectives ran on the default group while the roles own a
        dedicated group over the same ranks; each lists the ranks it was seen on.

    Example::

        # ranks 0..3, cp == world on plain DeviceMesh: roles {"cp": "0"}, default group "0"
        [(h.roles, h.ranks) for h in aliasing_hazards(datas)]   # [(('cp',), (0, 1, 2, 3))]
    """
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


def mixed_stream_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``mixed_streams`` rule: one communicator driven from two or more streams.

    Args:
        rank_data: per-rank dicts (one or more ranks).

    Returns:
        One hazard per group whose records execute on two or more streams with at least one
        blocking call: an error on NCCL with CUDA tensors, a warning (latent) elsewhere.

    Example::

        # gloo; each rank ran one blocking all-gather (exec_stream "cpu") and FSDP2's async calls
        # ("group:1") on group 1
        [(h.severity, h.details["streams"]) for h in mixed_stream_hazards(datas)]
        # [('warning', {'cpu': 1, 'group:1': 6})]
    """
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
                "spmd_types.set_dist, or a cg.async_and_wait_scope()) and give the role a "
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
    shapes = tuple(map(tuple, rec["shapes"])) if rec["op"] in UNIFORM_SHAPE_OPS else None
    return (rec["op"], tuple(sorted(set(rec["dtypes"]))), shapes)


def _describe(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "nothing"
    return f"{rec['op']} shapes={rec['shapes']} dtypes={rec['dtypes']} at {rec['caller']}"


def sequence_mismatch_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``sequence_mismatch`` rule: members of one group issued different collectives.

    Args:
        rank_data: per-rank dicts of every rank whose calls should be compared (point-to-point ops
            are left out).

    Returns:
        For each group with two or more of the given ranks as members, the first call index where
        their (op, dtypes, shapes) differ or one rank has no call; ``shapes`` only counts for
        :data:`UNIFORM_SHAPE_OPS`.

    Example::

        # rank 3 started recording one all_reduce late on cp's group 1
        [h.details["calls_per_rank"] for h in sequence_mismatch_hazards(datas)]
        # [{0: 2, 1: 2, 2: 2, 3: 1}]
    """
    have = {int(d["rank"]): d for d in rank_data}
    members: dict[str, set[int]] = {}
    roles: dict[str, set[str]] = {}
    for data in rank_data:
        for name, info in data["groups"].items():
            ranks = info["ranks"] if info["ranks"] is not None else [int(data["rank"])]
            members.setdefault(name, set()).update(r for r in ranks if r in have)
            roles.setdefault(name, set()).update(info["roles"])
    hazards = []
    for group, ranks in sorted(members.items(), key=lambda kv: group_sort_key(kv[0])):
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
            parts = [f"ranks {rank_span(rs)}: {_describe(at[rs[0]])}" for rs in variants.values()]
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


def _by_group(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        grouped.setdefault(rec["group"], []).append(rec)
    return grouped


def _traffic(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and first caller of some records, for a hazard's details."""
    return {"calls": len(records), "ops": dict(Counter(r["op"] for r in records)),
            "first_caller": records[0]["caller"]}


def _roles_of(data: dict[str, Any], group: str) -> tuple[str, ...]:
    return tuple(data["groups"].get(group, {}).get("roles", []))


def off_purpose_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``off_purpose`` rule: a ``checkpoint`` role's group used outside DCP.

    Args:
        rank_data: per-rank dicts (one or more ranks); only roles with a recorded purpose count.

    Returns:
        One error per group whose roles are all ``checkpoint`` roles and that carried collectives
        DCP did not issue (``in_checkpoint`` false), listing the ranks it was seen on.

    Example::

        # torchtitan's grad-norm all_reduce merged onto checkpoint-metadata's group "5"
        [(h.roles, h.details["calls"]) for h in off_purpose_hazards(datas)]
        # [(('checkpoint-metadata',), 4)]
    """
    found = []
    for data in rank_data:
        purposes = data.get("purposes", {})
        for group, records in _by_group(data["records"]).items():
            roles = _roles_of(data, group)
            if not roles or any(purposes.get(role) != "checkpoint" for role in roles):
                continue
            outside = [r for r in records if not r.get("in_checkpoint", False)]
            if not outside:
                continue
            message = (
                f"{len(outside)} collective(s) ran on the group of role(s) {', '.join(roles)} "
                f"(purpose checkpoint: DCP's plan and metadata exchange only) outside DCP, first "
                f"{outside[0]['op']} from {outside[0]['caller']}; model traffic there runs on the "
                "wrong communicator (gloo: device tensors through the host); fix: give that "
                "traffic a compute role (for DTensor: a role over the mesh dims it reduces over, or "
                "none, so it reduces per dim) and pass registry.group(role) only to DCP"
            )
            found.append((("purpose", group), int(data["rank"]), Hazard(
                "off_purpose", "error", group, roles, (), message, _traffic(outside))))
    return _merge_by_key(found)


def device_on_gloo_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``device_on_gloo`` rule: accelerator tensors sent through a gloo group.

    Args:
        rank_data: per-rank dicts (one or more ranks).

    Returns:
        One error per gloo group that carried tensors on a device other than the CPU.

    Example::

        # a CUDA gradient reduced on the gloo checkpoint group "5"
        [h.details["devices"] for h in device_on_gloo_hazards(datas)]   # [{'cuda:0': 1}]
    """
    found = []
    for data in rank_data:
        for group, records in _by_group(data["records"]).items():
            if data["groups"].get(group, {}).get("backend") != "gloo":
                continue
            on_device = [r for r in records if r["device"].split(":")[0] not in ("cpu", "meta")]
            if not on_device:
                continue
            roles = _roles_of(data, group)
            message = (
                f"{len(on_device)} collective(s) sent {on_device[0]['device']} tensors through gloo "
                f"group {group}" + (f" (role(s) {', '.join(roles)})" if roles else "")
                + f", first {on_device[0]['op']} from {on_device[0]['caller']}: every call copies "
                "through the host; fix: run that traffic on a device-backend role (backend = "
                "\"device\"), keep gloo groups for CPU objects (DCP metadata)"
            )
            details = _traffic(on_device)
            details["devices"] = dict(Counter(r["device"] for r in on_device))
            found.append((("device", group), int(data["rank"]), Hazard(
                "device_on_gloo", "error", group, roles, (), message, details)))
    return _merge_by_key(found)


def default_group_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``default_group`` rule: collectives on the default group in a registry's recording.

    Args:
        rank_data: per-rank dicts; ranks recorded without a registry (``registry_groups`` null)
            are skipped, and so are those :func:`aliasing_hazards` already reports (a role over
            the default group's ranks).

    Returns:
        One error per default group that carried collectives, with counts and the first caller.

    Example::

        # a plain dist.all_reduce(t) inside cg.audit.record(registry)
        [h.details["calls"] for h in default_group_hazards(datas)]   # [1]
    """
    found = []
    for data in rank_data:
        default = data["default_group"]
        if data.get("registry_groups") is None or default is None:
            continue
        on_default = [r for r in data["records"] if r["group"] == default]
        default_ranks = data["groups"].get(default, {}).get("ranks")
        covered = any(ranks is not None and default_ranks is not None
                      and sorted(ranks) == sorted(default_ranks)
                      for ranks in data["role_ranks"].values())
        if not on_default or covered or default in data["roles"].values():
            continue
        message = (
            f"{len(on_default)} collective(s) ran on the default group {default}, which the "
            f"registry never hands out (first {on_default[0]['op']} from "
            f"{on_default[0]['caller']}): that code bypasses the registry and shares the default "
            "communicator with whatever else uses it; fix: pass it a role's group "
            "(registry.group(role), a registry mesh) or issue through registry.collectives(role)"
        )
        found.append((("default", default), int(data["rank"]), Hazard(
            "default_group", "error", default, (), (), message, _traffic(on_default))))
    return _merge_by_key(found)


def foreign_group_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``foreign_group`` rule: collectives on a group the registry did not make.

    Args:
        rank_data: per-rank dicts; ranks recorded without a registry are skipped.

    Returns:
        One warning per such group (not the default group: see :func:`default_group_hazards`).

    Example::

        # FSDP2 flattened a registry mesh over dims no role covers: torch made group "9"
        [h.group for h in foreign_group_hazards(datas)]   # ['9']
    """
    found = []
    for data in rank_data:
        made = data.get("registry_groups")
        if made is None:
            continue
        for group, records in _by_group(data["records"]).items():
            if group in made or group == data["default_group"]:
                continue
            ranks = data["groups"].get(group, {}).get("ranks")
            message = (
                f"{len(records)} collective(s) ran on group {group} (ranks {ranks}), which the "
                f"registry did not make, first {records[0]['op']} from {records[0]['caller']}; "
                "fix: if it carries a role's traffic, declare that role so the registry makes its "
                "group (torch makes one when a registry mesh is flattened over dims no role spans)"
            )
            found.append((("foreign", group), int(data["rank"]), Hazard(
                "foreign_group", "warning", group, (), (), message, _traffic(records))))
    return _merge_by_key(found)


def uncounted_hazards(rank_data: Sequence[dict[str, Any]]) -> list[Hazard]:
    """The ``uncounted`` rule: a group's own count disagrees with the recorded calls.

    Args:
        rank_data: per-rank dicts with ``sequence`` (group -> [count when first met, at the end],
            from the backend: gloo and NCCL keep one; others are absent).

    Returns:
        One warning per (group, recorded, counted) where the two differ: calls the audit missed
        (another thread, a call that skips the dispatcher), or calls it saw that never ran.

    Example::

        # DCP async_save's background thread ran 3 collectives on the checkpoint group "5"
        [(h.details["recorded"], h.details["counted"]) for h in uncounted_hazards(datas)]
        # [(0, 3)]
    """
    found = []
    for data in rank_data:
        recorded = Counter(r["group"] for r in data["records"])
        for group, (start, end) in data.get("sequence", {}).items():
            counted = int(end) - int(start)
            if counted == recorded[group]:
                continue
            roles = _roles_of(data, group)
            message = (
                f"group {group}" + (f" (role(s) {', '.join(roles)})" if roles else "")
                + f" counted {counted} collective(s) while the audit recorded {recorded[group]}: "
                + ("calls the audit could not see (another thread, such as DCP async_save's, or "
                   "a call that skips the dispatcher)" if counted > recorded[group] else
                   "recorded calls that did not run")
                + "; fix: record on every thread that issues collectives, or read these counts "
                "as the truth for this group"
            )
            found.append((("uncounted", group, recorded[group], counted), int(data["rank"]), Hazard(
                "uncounted", "warning", group, roles, (), message,
                {"recorded": recorded[group], "counted": counted})))
    return _merge_by_key(found)
