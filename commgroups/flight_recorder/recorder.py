"""The recorder itself: a bounded ring buffer per role (:class:`RoleRecorder`) and one generation's
set of them (:class:`FlightRecorder`), with the compact status other ranks read and the full dump.

Cost per recorded call (measured by ``commgroups bench``, ``flight_recorder_us_per_collective``):
one counter read on the group, a frame walk cached per code object, an entry appended to a
``deque(maxlen)``. No lock: a role's calls come from one thread (RoleCollectives enforces it), and
readers (the status publisher's thread) only read the last entry and copy the deque.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch import Tensor

from commgroups import torch_internals
from commgroups.errors import RoleCollectiveError, RoleTimeoutError
from commgroups.flight_recorder.entries import (
    FlightEntry,
    SiteCache,
    caller_of,
    caller_stream,
    tensor_facts,
)
from commgroups.flight_recorder.settings import DEFAULT_ENTRIES

__all__ = ["DUMP_VERSION", "FlightRecorder", "RoleRecorder"]

DUMP_VERSION = 1
"""The version of :meth:`FlightRecorder.to_dict`'s schema (``commgroups flight merge`` reads it)."""


class RoleRecorder:
    """The newest ``maxlen`` collectives this rank issued on one role, and the role's counters.

    Args:
        role: the role's name.
        group: this rank's group of the role.
        maxlen: entries kept.
        sites: the plumbing cache shared by one generation's recorders.

    Example::

        entry = recorder.start("all_reduce", (tensor,), True, False, sys._getframe(1))
        ...   # issue and wait
        recorder.end(entry)
        recorder.last.caller     # "train.py:12 in step"
    """

    __slots__ = ("_async_stream", "_counter", "_final_count", "_sites", "diagnose", "entries", "group",
                 "group_name", "last", "role", "seq", "watch")

    def __init__(self, role: str, group: dist.ProcessGroup, maxlen: int = DEFAULT_ENTRIES,
                 sites: SiteCache | None = None) -> None:
        self.role = role
        self.group: dist.ProcessGroup | None = group
        """None once :meth:`detach` ran (the generation ended)."""
        self.group_name = str(group.group_name)
        self._async_stream = "group:" + self.group_name  # where an async call runs (NCCL's rule)
        self.entries: deque[FlightEntry] = deque(maxlen=maxlen)
        self.seq = 0
        self.last: FlightEntry | None = None
        self._sites = sites if sites is not None else SiteCache()
        self.diagnose: Callable[[RoleCollectiveError, FlightEntry | None], RoleCollectiveError] | None = None
        """Turns a failed call's error into one naming the ranks behind (set by the recorder's
        owner when ranks publish their status); None: the error stays as it is."""
        self.watch: Any = None
        """The generation's :class:`~commgroups.collectives.async_wait.InterruptWatch` where the
        group is gloo's (set by the generation's maker): calls recorded here wait in slices."""
        # The backend's collective count, if it keeps one (commgroups' single-rank backend does not).
        self._counter = torch_internals.group_sequence_counter(group)
        self._final_count: int | None = None

    def detach(self) -> None:
        """Let go of the group (its counter holds it too): a generation's groups are freed when
        it ends, while its recorder may live as long as the registry. The count stays what it
        was then: a dump after the end (an ask answered while closing) must not fall back to
        this rank's own calls, which count those the backend refused uncounted."""
        self._final_count = self.group_seq()
        self.group = None
        self._counter = None
        self.diagnose = None
        self.watch = None

    def group_seq(self) -> int | None:
        """The group's own collective count on this rank (every call on it), or None."""
        return self._counter() if self._counter is not None else self._final_count

    def start(self, op: str, args: tuple[Any, ...], issued_async: bool, caller_async: bool,
              frame: FrameType | None) -> FlightEntry:
        """Record a call about to be issued; ``frame`` is where the caller search starts."""
        seq = self.seq = self.seq + 1
        first: Tensor | None
        if len(args) == 1 and type(args[0]) is Tensor:  # all_reduce, broadcast: most calls
            first = args[0]
            shapes: tuple[Any, ...] = (first.shape,)
            dtype: Any = first.dtype
        else:
            shapes, dtype, first = tensor_facts(args)
        stream = self._async_stream if issued_async else caller_stream(first)
        counter = self._counter
        code, line = caller_of(frame, self._sites)
        entry = FlightEntry(op, seq, None if counter is None else counter() + 1, shapes, dtype,
                            issued_async, caller_async, stream, code, line)
        self.entries.append(entry)
        self.last = entry
        return entry

    def end(self, entry: FlightEntry, error: BaseException | None = None) -> None:
        """Mark ``entry`` returned (or failed with ``error``)."""
        entry.end_ns = time.monotonic_ns()
        if error is not None:
            text = str(error).strip()
            entry.error = (text.splitlines()[0] if text else repr(error))[:200]

    def failure(self, entry: FlightEntry, error: RuntimeError) -> RoleCollectiveError | None:
        """For a call recorded outside ``registry.collectives`` (a plain call under
        async-and-wait, FSDP2's comms) that timed out: the diagnosed :class:`RoleTimeoutError`
        (a :class:`~commgroups.errors.RoleHangError` with peers to ask); None for other failures,
        which keep torch's own error."""
        self.end(entry, error)
        text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            return None
        failure = RoleTimeoutError(
            f"role {self.role!r}: {entry.op} #{entry.seq} on group {self.group_name!r} timed out: "
            f"{text}; fix: check that every rank of the role is alive and issues the same "
            "collectives in the same order, or raise the role's timeout_s",
            role=self.role, op=entry.op, seq=entry.seq, cause=text)
        return self.diagnose(failure, entry) if self.diagnose is not None else failure

    def status(self) -> dict[str, Any]:
        """The compact status other ranks read: counters and the last call (op, seq, caller)."""
        last = self.last
        out: dict[str, Any] = {"seq": self.seq, "group_seq": self.group_seq()}
        if last is not None:
            out["last"] = {"op": last.op, "seq": last.seq, "group_seq": last.group_seq,
                           "caller": last.caller, "state": last.state}
        return out


class FlightRecorder:
    """One generation's recorders, one per role this rank is a member of.

    Args:
        groups: role name -> this rank's group (roles this rank is not in are left out).
        rank: this rank's global rank.
        generation: the generation's number.
        backends: role name -> backend name (for the dump and its hazards).
        maxlen: entries kept per role.
    """

    def __init__(self, groups: Mapping[str, dist.ProcessGroup], *, rank: int, generation: int,
                 backends: Mapping[str, str] | None = None, maxlen: int = DEFAULT_ENTRIES) -> None:
        sites = SiteCache()
        self.rank = rank
        self.generation = generation
        self.backends = dict(backends or {})
        self.roles: dict[str, RoleRecorder] = {
            name: RoleRecorder(name, group, maxlen, sites) for name, group in groups.items()}
        self._ranks: dict[str, list[int]] = {}

    def ranks(self, role: str) -> list[int]:
        """The global ranks of this rank's group of ``role`` (looked up when first needed: a
        world-spanning role's list is as long as the world)."""
        if role not in self._ranks:
            recorder = self.roles.get(role)
            if recorder is None or recorder.group is None:
                return []  # not a member, or the generation ended (its group is gone)
            self._ranks[role] = [int(r) for r in dist.get_process_group_ranks(recorder.group)]
        return self._ranks[role]

    def role(self, name: str) -> RoleRecorder | None:
        """The recorder of role ``name`` (None when this rank is not in it)."""
        return self.roles.get(name)

    def status(self) -> dict[str, Any]:
        """Every role's compact status (what the status publisher puts in the store)."""
        return {name: recorder.status() for name, recorder in self.roles.items()}

    def to_dict(self, call_sites: bool = True) -> dict[str, Any]:
        """The full dump: :meth:`snapshot` with :meth:`torch_trace`.

        Args:
            call_sites: give torch's entries their call sites (see :meth:`torch_trace`).
        """
        return {**self.snapshot(), "torch_trace": self.torch_trace(call_sites)}

    def snapshot(self) -> dict[str, Any]:
        """commgroups' own part of a dump, cheap to take: every role's counts, entries, group
        and backend, as they are now."""
        offset = time.time_ns() - time.monotonic_ns()
        return {
            "version": DUMP_VERSION,
            "rank": self.rank,
            "generation": self.generation,
            "time_s": time.time(),
            "roles": {
                name: {
                    "group": recorder.group_name,
                    "backend": self.backends.get(name, ""),
                    "ranks": self.ranks(name),
                    **recorder.status(),
                    "entries": [entry.to_dict(offset) for entry in list(recorder.entries)],
                }
                for name, recorder in self.roles.items()
            },
        }

    def torch_trace(self, call_sites: bool = True) -> list[dict[str, Any]]:
        """torch's own flight recorder entries of these groups, where torch keeps one (gloo and
        NCCL in torch 2.13). ``call_sites``: give them their call sites; torch symbolizes the
        stack of every entry in its ring to do so (about 1 s for 2000 entries on 2 loaded CPUs),
        so a dump on a hang's clock is written without first."""
        names = {recorder.group_name: name for name, recorder in self.roles.items()}
        return torch_internals.flight_trace_entries(names, call_sites=call_sites)
