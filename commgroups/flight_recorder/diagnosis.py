"""Who is behind: a failed call on a role compared with what every rank of the role published.

Pure: from this rank's failed entry and the statuses read from the store (see
:mod:`commgroups.flight_recorder.publisher`) to a :class:`Diagnosis`, its short text and its
JSON-ready details. Ranks are compared by the group's own collective count (torch counts every
call on the group, plain and functional ones too), or by the role's recorded calls where the
backend keeps no count.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["SHARED_STATES", "Diagnosis", "RankState", "diagnose", "short_site"]

# Ranks listed by name in the error's text (the details list all of them).
_LISTED = 3

STALE_AFTER_S = 5.0
"""A silent rank's status older than this says its age in the text: a rank publishes a status
once it settles, a moving one at most every 30 s, so a rank killed while training may have left
an old one (the publisher's REFRESH_S)."""


SHARED_STATES = 64
"""The most ranks apart (not at the failed call) an asker's shared diagnosis lists one by one
(:meth:`Diagnosis.share`); the rest are counted. The share goes to every member of the group:
at 65,536 members, 64 states are about 10 kB, the whole list could be megabytes."""


def short_site(caller: str) -> str:
    """``train.py:12`` from ``/path/to/train.py:12 in step`` (the error's text keeps it short)."""
    where = caller.split(" in ")[0]
    return os.path.basename(where) if where else caller


@dataclasses.dataclass(frozen=True)
class RankState:
    """One rank of the role as its published status shows it.

    Args:
        rank: the global rank.
        position: ``behind``, ``ahead``, ``reached``, ``mismatch``, ``silent`` (a stale status:
            dead, or its process frozen) or ``left`` (no status: it closed its registry).
        count: its count on the role (group count, else recorded calls); None when silent.
        last: its last recorded call on the role (op, seq, group_seq, caller, state), if any.
        now: a call of another role it is in right now (role, op, seq, caller), if any.
        age_s: for a silent rank, how old its status was when diagnosed (by the diagnosing
            rank's clock against the publisher's), if it has one.
    """

    rank: int
    position: str
    count: int | None
    last: dict[str, Any] | None = None
    now: dict[str, Any] | None = None
    age_s: float | None = None

    def text(self) -> str:
        """``rank 2 (last all_reduce #4 at train.py:12; now in fsdp all_gather #3 at m.py:40)``."""
        parts = []
        if self.position == "silent":
            parts.append("no fresh status: dead or frozen")
            if self.age_s is not None and self.age_s >= STALE_AFTER_S:
                parts.append(f"its status {self.age_s:.0f} s old")
        if self.position == "left":
            parts.append("closed its registry")
        if self.last is not None:
            parts.append(f"last {self.last['op']} #{self.last['seq']} at "
                         f"{short_site(str(self.last['caller']))}")
        elif self.position not in ("silent", "left"):
            parts.append("nothing recorded on the role")
        if self.now is not None:
            parts.append(f"now in {self.now['role']} {self.now['op']} #{self.now['seq']} at "
                         f"{short_site(str(self.now['caller']))}")
        return f"rank {self.rank} ({'; '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Every rank of a role compared with this rank's failed call.

    Args:
        role: the role.
        rank: this rank.
        op, seq, count: the failed call (its group count, or role count).
        caller: where this rank issued it.
        ranks: the other ranks' states.
        dump: where this rank's recorder was written, if it was.
        more: ranks apart in each position beyond those in ``ranks`` (a diagnosis shared by
            the asker lists :data:`SHARED_STATES` of them; the text counts the rest).
        asker: the rank whose diagnosis this is, where another rank of the group made it.
    """

    role: str
    rank: int
    op: str
    seq: int
    count: int | None
    caller: str
    ranks: tuple[RankState, ...]
    dump: str = ""
    more: Mapping[str, int] = dataclasses.field(default_factory=dict)
    asker: int | None = None

    def where(self, position: str) -> list[RankState]:
        """The ranks in ``position``."""
        return [state for state in self.ranks if state.position == position]

    def text(self) -> str:
        """The diagnosis in a few words: behind, mismatched, silent and ahead ranks."""
        out = []
        for position, label in (("behind", "behind"), ("silent", "silent"),
                                ("mismatch", "different op at this seq"), ("left", "left"),
                                ("ahead", "ahead")):
            states = self.where(position)
            if not states:
                continue
            shown = [state.text() if position not in ("ahead", "left") else f"rank {state.rank}"
                     for state in states[:_LISTED]]
            total = len(states) + self.more.get(position, 0)
            more = f" +{total - _LISTED} more" if total > _LISTED else ""
            out.append(f"{label}: {', '.join(shown)}{more}")
        if not out:
            out.append("every rank reached it")
        return "; ".join(out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready details (the error's ``flight`` attribute, and the dump)."""
        return {
            "role": self.role, "rank": self.rank, "op": self.op, "seq": self.seq,
            "count": self.count, "caller": self.caller, "dump": self.dump,
            "ranks": [dataclasses.asdict(state) for state in self.ranks],
            **{position: [state.rank for state in self.where(position)]
               for position in ("behind", "ahead", "mismatch", "silent", "left", "reached")},
            **({"more": dict(self.more)} if self.more else {}),
            **({"asker": self.asker} if self.asker is not None else {}),
        }

    def share(self) -> dict[str, Any]:
        """What the asker sends the other members of its group (:meth:`from_share`): the ranks
        apart (up to :data:`SHARED_STATES`, the rest counted); every other rank reached it."""
        apart = [state for state in self.ranks if state.position != "reached"]
        more = dict(self.more)
        for state in apart[SHARED_STATES:]:
            more[state.position] = more.get(state.position, 0) + 1
        return {"asker": self.rank, "more": more,
                "ranks": [dataclasses.asdict(state) for state in apart[:SHARED_STATES]]}

    @classmethod
    def from_share(cls, shared: Mapping[str, Any], role: str, rank: int,
                   failed: Mapping[str, Any], members: Collection[int]) -> Diagnosis:
        """This rank's diagnosis of the same failed call from the asker's :meth:`share`: the
        same ranks apart, every other member of the group (``members``, the asker too) at the
        call; this rank's own call and site. Where the share counted ranks apart without
        listing them, no rank is listed as having reached it (which did is not known here).

        Example::

            Diagnosis.from_share({"asker": 0, "more": {}, "ranks": [{"rank": 2, "position":
                "silent", "count": None}]}, "cp", 1, failed, [0, 1, 2]).text()
            # 'silent: rank 2 (no fresh status: dead or frozen)'
        """
        by_group = failed.get("group_seq") is not None
        mine = int(failed["group_seq"] if by_group else failed["seq"])
        listed = [RankState(**state) for state in shared.get("ranks", ())
                  if int(state["rank"]) != rank]
        more = {str(position): int(count)
                for position, count in (shared.get("more") or {}).items()}
        known = {state.rank for state in listed} | {rank}
        reached = [] if more else [RankState(other, "reached", mine)
                                   for other in members if other not in known]
        return cls(role=role, rank=rank, op=str(failed["op"]), seq=int(failed["seq"]),
                   count=mine, caller=str(failed.get("caller", "")),
                   ranks=tuple(sorted(listed + reached, key=lambda state: state.rank)),
                   more=more, asker=int(shared["asker"]))


def _count(status: Mapping[str, Any]) -> int | None:
    value = status.get("group_seq")
    return int(value) if value is not None else None


def diagnose(role: str, rank: int, failed: Mapping[str, Any],
             published: Mapping[int, Mapping[str, Any] | None], asked: int,
             now: float | None = None) -> Diagnosis:
    """Compare this rank's failed call on ``role`` with every other rank's published status.

    Args:
        role: the role the call failed on.
        rank: this rank.
        failed: the failed entry (``op``, ``seq``, ``group_seq``, ``caller``).
        published: rank -> its published value (``{"t", "answered", "status"}``) or None.
        asked: the request number a live rank's ``answered`` has reached.
        now: the wall-clock time (``time.time()``, the default) a silent rank's status age is
            counted to.

    Example::

        diagnose("cp", 0, {"op": "all_reduce", "seq": 5, "group_seq": 5, "caller": "t.py:9"},
                 {1: {"answered": 1, "status": {"cp": {"seq": 4, "group_seq": 4, "last": ...}}}},
                 asked=1).text()
        # 'behind: rank 1 (last all_reduce #4 at t.py:7)'
    """
    by_group = failed.get("group_seq") is not None
    mine = int(failed["group_seq"] if by_group else failed["seq"])
    wall = time.time() if now is None else now
    states = []
    # Most members answer alike (at 65,536, every one that reached the call shares one value
    # object: see collect): judge each distinct value once (0.21 s -> 0.03 s at 65,536).
    judged: dict[int, tuple[Mapping[str, Any], str, int | None, Any, Any]] = {}
    for other in sorted(published):  # ints only: a third of sorting the items
        value = published[other]
        if other == rank:
            continue
        if value is None:
            states.append(RankState(other, "left", None))
            continue
        seen = judged.get(id(value))
        if seen is None or seen[0] is not value:
            seen = judged[id(value)] = (value, *_judge(value, role, mine, by_group, failed,
                                                       asked))
        _, position, count, last, current = seen
        age = (max(0.0, wall - float(value["t"]))
               if position == "silent" and value.get("t") is not None else None)
        states.append(RankState(other, position, count, last, current, age))
    return Diagnosis(role=role, rank=rank, op=str(failed["op"]), seq=int(failed["seq"]),
                     count=mine, caller=str(failed.get("caller", "")), ranks=tuple(states))


def _judge(value: Mapping[str, Any], role: str, mine: int, by_group: bool,
           failed: Mapping[str, Any], asked: int) -> tuple[str, int | None, Any, Any]:
    """One published value's position against the failed call, its count, last and now."""
    status = value.get("status") or {}
    mine_there = status.get(role) or {}
    now = next(({"role": name, **info["last"]} for name, info in status.items()
                if name != role and (info.get("last") or {}).get("state") == "in flight"),
               None)
    last = mine_there.get("last")
    if int(value.get("answered", 0)) < asked:
        return "silent", None, last, now
    count = _count(mine_there) if by_group else mine_there.get("seq")
    if count is None:
        return "silent", None, last, now
    if count < mine:
        return "behind", int(count), last, now
    if count > mine:
        return "ahead", int(count), last, now
    if last is not None and (last.get("group_seq") if by_group else last.get("seq")) == mine \
            and last.get("op") != failed["op"]:
        return "mismatch", int(count), last, now
    return "reached", int(count), last, now
