"""torch's own flight-recorder dumps, read beside commgroups' and named by role.

NCCL's watchdog writes one file per rank when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT``, default on; ``TORCH_FR_DUMP_TEMP_FILE`` is the path prefix,
default ``/tmp/nccl_trace_rank_``, the rank appended). Each file holds torch's recorder: process
groups by c10d name (``pg_config``: description and member ranks, NCCL only), each group's
last enqueued / started / completed collective (``pg_status``: the watchdog's "last enqueued work:
242, last completed work: 210") and the entries. Only c10d names say which group hung ("PG ID 0
... default_pg"); this module puts the role and member ranks beside each name, from commgroups'
own dumps, and gives the counts that name the ranks torch counts behind on a role's group.

Everything here is pure (no torch): a merge runs where torch cannot be imported. The files are
pickles, read with an unpickler that builds only plain containers and refuses every class (torch's
dumps hold nothing else), so a file from elsewhere cannot run code. JSON dumps
(``_dump_nccl_trace_json``, ``_dump_fr_trace_json``) are read too. Format checked on torch
2.13.0 (CPU: the generic recorder, ``_dump_fr_trace``, which records gloo); NCCL's own dump has
the same keys (torch's ``flight_recorder`` analyzer reads both alike).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from commgroups.errors import FlightDumpError

__all__ = ["TORCH_DUMP_PREFIX", "TorchDump", "enqueued_counts", "load_torch_dumps",
           "torch_group_rows"]

TORCH_DUMP_PREFIX = "nccl_trace_rank_"
"""The file-name part of torch's default ``TORCH_FR_DUMP_TEMP_FILE`` (``/tmp/nccl_trace_rank_``);
a job that set another prefix passes its directory and the files' common prefix."""

_RANK = re.compile(r"(\d+)(?:\.json)?$")


@dataclasses.dataclass(frozen=True)
class TorchDump:
    """One rank's dump of torch's flight recorder: ``rank`` (from the file name, as torch's own
    analyzer takes it), ``status`` per c10d group name (last enqueued, started, completed),
    ``ranks`` per group name where the dump says (NCCL), and the ``last`` entry per group."""

    rank: int
    status: dict[str, dict[str, int]]
    ranks: dict[str, list[int]]
    last: dict[str, dict[str, Any]]


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers only: any class in the stream is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: torch's dumps hold only plain data")


def _read(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    try:
        data = (json.loads(raw) if raw[:1] in (b"{", b"[")
                else _PlainUnpickler(io.BytesIO(raw)).load())
    except (ValueError, pickle.UnpicklingError, EOFError) as error:
        raise FlightDumpError(f"{path}: not a torch flight-recorder dump ({error}); fix: pass the "
                              "directory torch wrote (TORCH_FR_DUMP_TEMP_FILE)") from None
    if not isinstance(data, dict) or "entries" not in data:
        raise FlightDumpError(f"{path}: not a torch flight-recorder dump (no entries); fix: pass "
                              "the directory torch wrote (TORCH_FR_DUMP_TEMP_FILE)")
    return data


def _member_ranks(config: Any) -> list[int] | None:
    ranks = config.get("ranks") if isinstance(config, dict) else None
    if isinstance(ranks, str):  # torch writes them as the text of a list: "[0, 1]"
        try:
            ranks = json.loads(ranks)
        except ValueError:
            return None
    if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
        return list(ranks)
    return None


def _dump(path: Path, rank: int) -> TorchDump:
    data = _read(path)
    ranks: dict[str, list[int]] = {}
    for key, config in (data.get("pg_config") or {}).items():
        members = _member_ranks(config)
        name = str(config.get("name") or key) if isinstance(config, dict) else str(key)
        if members is not None and name:
            ranks[name] = members
    status = {str(name): {k: int(v) for k, v in values.items() if isinstance(v, int)}
              for name, values in (data.get("pg_status") or {}).items()
              if isinstance(values, dict)}
    last: dict[str, dict[str, Any]] = {}
    for entry in data.get("entries") or []:
        where = entry.get("process_group") or ("", "")
        name = str(where[0])
        if name and entry.get("collective_seq_id", -1) >= last.get(name, {}).get("seq", -1):
            last[name] = {"op": str(entry.get("profiling_name", "")),
                          "seq": int(entry.get("collective_seq_id") or 0),
                          "state": str(entry.get("state", ""))}
    return TorchDump(rank, status, ranks, last)


def load_torch_dumps(directory: str | Path, prefix: str = TORCH_DUMP_PREFIX) -> list[TorchDump]:
    """Every ``<prefix><rank>`` file of torch's in ``directory``, sorted by rank (none: empty).

    Example::

        dumps = load_torch_dumps("/tmp")          # NCCL wrote /tmp/nccl_trace_rank_0, ...
        rows = torch_group_rows(dumps, report.groups)
    """
    folder = Path(directory)
    found = []
    for path in sorted(folder.glob(f"{prefix}*")) if folder.is_dir() else []:
        match = _RANK.search(path.name[len(prefix):])
        if path.is_file() and match is not None:
            found.append(_dump(path, int(match.group(1))))
    return sorted(found, key=lambda d: d.rank)


def torch_group_rows(dumps: Sequence[TorchDump], groups: Mapping[str, Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
    """One row per rank and c10d group in torch's dumps: the role (from commgroups' ``groups``
    table: c10d name -> role, ranks), member ranks, torch's counts and its last call there."""
    rows = []
    for dump in dumps:
        for name in sorted(set(dump.status) | set(dump.last)):
            ours = groups.get(name) or {}
            status = dump.status.get(name, {})
            last = dump.last.get(name, {})
            rows.append({
                "rank": dump.rank, "group": name, "role": ours.get("role"),
                "ranks": list(ours.get("ranks") or dump.ranks.get(name) or []),
                "enqueued": status.get("last_enqueued_collective"),
                "started": status.get("last_started_collective"),
                "completed": status.get("last_completed_collective"),
                "last": f"{last['op']} #{last['seq']} ({last['state']})" if last else "",
            })
    return rows


def enqueued_counts(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, dict[int, int]]]:
    """c10d group -> (its role, or ``group <name>`` where none, rank -> torch's last enqueued
    collective) over :func:`torch_group_rows`' rows: what names the ranks torch counts behind."""
    found: dict[str, tuple[str, dict[int, int]]] = {}
    for row in rows:
        if row["enqueued"] is not None:
            label = row["role"] or f"group {row['group'][:14]}"
            found.setdefault(row["group"], (label, {}))[1][row["rank"]] = int(row["enqueued"])
    return found
