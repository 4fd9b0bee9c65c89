"""Reading a run's per-rank audit files and merging them into one :class:`AuditReport`.

No torch import (see :mod:`commgroups.audit.records`): ``commgroups audit DIR`` runs wherever the
files are.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commgroups.audit.hazards import find_hazards
from commgroups.audit.records import AUDIT_DIR_ENV, FILE_FORMAT
from commgroups.audit.report import AuditReport
from commgroups.errors import AuditFileError  # defined there; importable from here as before

__all__ = ["AuditFileError", "check_rank_data", "load_dir", "merge", "merge_dir"]


def check_rank_data(data: Any, source: str) -> dict[str, Any]:
    """``data`` if it is one rank's audit recording, else an error naming ``source``.

    Args:
        data: a decoded per-rank file or a :meth:`Recorder.to_dict` result.
        source: what to call it in the error (a path, ``rank data #2``).

    Returns:
        ``data``, unchanged.

    Raises:
        AuditFileError: ``data`` is not a dict with ``format`` :data:`FILE_FORMAT`.
    """
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise AuditFileError(
            f"{source}: not a commgroups audit file (want format {FILE_FORMAT!r}); fix: point at "
            f"the directory {AUDIT_DIR_ENV} named, holding only rank*.json files"
        )
    return data


def load_dir(directory: str | Path) -> list[dict[str, Any]]:
    """Read every ``rank*.json`` of one run.

    Args:
        directory: the directory the run's ranks wrote their files into.

    Returns:
        One dict per file, sorted by rank.

    Raises:
        AuditFileError: the directory is missing or holds no rank file, a file cannot be read as
            an audit file, or two files name the same rank.

    Example::

        [d["rank"] for d in load_dir("/tmp/audit")]   # [0, 1, 2, 3]
    """
    path = Path(directory)
    if not path.is_dir():
        raise AuditFileError(f"{path}: no such directory; fix: pass the {AUDIT_DIR_ENV} of a run")
    files = sorted(path.glob("rank*.json"))
    if not files:
        raise AuditFileError(
            f"{path}: no rank*.json files; fix: run with {AUDIT_DIR_ENV}={path} around a "
            "cg.audit.from_env() block, or write files with Recorder.write()"
        )
    loaded = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise AuditFileError(f"{file}: cannot read it ({error}); fix: rerun that rank") from error
        loaded.append(check_rank_data(data, str(file)))
    seen: Counter[int] = Counter(int(d["rank"]) for d in loaded)
    twice = sorted(r for r, n in seen.items() if n > 1)
    if twice:
        raise AuditFileError(f"{path}: ranks {twice} have more than one file; fix: use one "
                             "directory per run")
    return sorted(loaded, key=lambda d: int(d["rank"]))


def merge_dir(directory: str | Path) -> AuditReport:
    """Merge the per-rank files of one run and find their hazards.

    Args:
        directory: the directory the run's ranks wrote their files into.

    Returns:
        The :class:`AuditReport` of :func:`merge` over :func:`load_dir`.

    Example::

        report = merge_dir("/tmp/audit")   # a run launched with COMMGROUPS_AUDIT_DIR=/tmp/audit
        print(report.render())
    """
    return merge(load_dir(directory))


def merge(rank_data: Sequence[dict[str, Any]]) -> AuditReport:
    """Merge per-rank recordings into one report, cross-rank sequence check included.

    Args:
        rank_data: per-rank dicts (:meth:`Recorder.to_dict`, or decoded files), one per rank.

    Returns:
        An :class:`AuditReport`: the ranks, the call counts per group summed over ranks, and every
        hazard of :func:`commgroups.audit.hazards.find_hazards`.

    Raises:
        AuditFileError: an entry is not an audit recording.

    Example::

        # on rank 0, after gathering every rank's recorder.to_dict() into `gathered`
        report = merge(gathered)
        report.summary["groups"]["1"]["calls"]   # calls on group 1 over all ranks
    """
    for index, data in enumerate(rank_data):
        check_rank_data(data, f"rank data #{index}")
    groups: dict[str, dict[str, Any]] = {}
    for data in rank_data:
        for name, info in data["groups"].items():
            entry = groups.setdefault(name, {"ranks": info["ranks"], "backend": info["backend"],
                                             "default": info["default"], "roles": [],
                                             "calls": 0, "blocking": 0, "async": 0})
            entry["roles"] = sorted(set(entry["roles"]) | set(info["roles"]))
        # Compute roles whose spec asks for async-and-wait (absent in files written before it was
        # kept). Checkpoint roles carry DCP's object collectives on gloo, where a blocking call
        # is what async-and-wait amounts to (the calling thread waits either way).
        purposes = data.get("purposes", {})
        wants = {role for role, on in data.get("async_and_wait", {}).items()
                 if on and purposes.get(role, "compute") == "compute"}
        for rec in data["records"]:
            entry = groups[rec["group"]]
            entry["calls"] += 1
            entry["blocking"] += rec["async_op"] is False
            entry["async"] += rec["async_op"] is True
            if rec["op"].startswith("_c10d_functional."):
                # Functional collectives (spmd_types 0.3's all_reduce and shard gather/scatter,
                # DTensor): always async on the group's own stream; counted apart from the
                # dist-module calls (said only where some).
                entry["functional"] = entry.get("functional", 0) + 1
            if rec["async_op"] is False:
                # A blocking call on a group whose role asked for async-and-wait: the rule did
                # not reach its caller (said per role in the summary line).
                for role in sorted(wants & set(entry["roles"])):
                    unmet = entry.setdefault("blocking_async_roles", {})
                    unmet[role] = unmet.get(role, 0) + 1
    worlds = {d["world_size"] for d in rank_data if d.get("world_size") is not None}
    return AuditReport(
        ranks=tuple(int(d["rank"]) for d in rank_data),
        world_size=max(worlds) if worlds else None,
        hazards=tuple(find_hazards(rank_data)),
        summary={"groups": groups},
    )
