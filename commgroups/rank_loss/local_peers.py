"""Whether a rank's process is gone, asked of the operating system by a rank on the same host.

A killed or crashed rank is the common loss, and its host knows at once: its process is no longer
in ``/proc`` (or is a zombie its launcher has not reaped). A rank on another host can only wait
for an answer that never comes (the check-in's ``dead_after_s``); a rank on the same host can
look. :class:`ProcessId` is what a rank publishes once, under its host's key, so that its
host-local peers can look it up; :func:`gone` is their look.

Which ranks share a host is decided by the kernel, not a name: the host key is the kernel's boot
id (``/proc/sys/kernel/random/boot_id``, one per machine and boot, shared by its containers) and
the process's pid namespace, so only processes that see each other's pids compare them (two
machines with the same hostname, or two containers of one machine, never do). A pid reused since
is told apart by the process's start time. Linux only; elsewhere :func:`this_process` is None and
nothing is published: deaths are then judged by ``dead_after_s`` alone, as before.

Example: ranks 4-7 on one machine publish ``4:31337:2261872;5:31338:2261873;...`` under
``host/<key>``; rank 7 is SIGKILLed; when the loss is reported, ranks 4-6 each read that key
once, find ``/proc/31340`` gone and add 7 to the report's confirmed dead, and the check-in
decides without waiting ``dead_after_s`` for rank 7's answer.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

__all__ = ["ProcessId", "gone", "host_key", "parse_peers", "this_process"]

_PROC = "/proc"


@dataclass(frozen=True)
class ProcessId:
    """A process as its host-local peers can check it."""

    host: str
    """The kernel's boot id and the pid namespace: equal exactly where pids are comparable."""
    pid: int
    start: int
    """Its start time (``/proc/<pid>/stat``'s 22nd field, clock ticks since boot)."""

    def entry(self, rank: int) -> str:
        """This process's entry in its host's key, for global rank ``rank``."""
        return f"{rank}:{self.pid}:{self.start};"


def _read(path: str) -> str:
    """A small ``/proc`` file's text: one open and one read (no ``pathlib``, whose first use in a
    process costs ``create()``'s path 0.05-0.1 ms)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        return os.read(descriptor, 4096).decode()
    finally:
        os.close(descriptor)


def _stat(pid: int) -> tuple[str, int] | None:
    """``pid``'s state letter and start time, or None where it does not exist. Raises
    ``OSError`` where ``/proc`` cannot say now (this process out of descriptors, no permission):
    that is no sign the process ended."""
    try:
        text = _read(f"{_PROC}/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):  # never there, or reaped after the open
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[19])


def this_process() -> ProcessId | None:
    """This process's id, or None where the platform cannot say (no ``/proc``: not Linux)."""
    try:
        boot = _read(f"{_PROC}/sys/kernel/random/boot_id").strip()
        namespace = os.readlink(f"{_PROC}/self/ns/pid")
        stat = _stat(os.getpid())
    except OSError:
        return None
    if stat is None or not boot:
        return None
    return ProcessId(host=f"{boot}/{namespace}", pid=os.getpid(), start=stat[1])


def host_key(host: str) -> str:
    """The store key (under the registry's namespace) of ``host``'s processes: a short hash."""
    return f"host/{hashlib.sha256(host.encode()).hexdigest()[:16]}"


def parse_peers(value: str) -> dict[int, tuple[int, int]]:
    """A host key's value -> global rank -> (pid, start time); the last entry of a rank wins."""
    peers: dict[int, tuple[int, int]] = {}
    for entry in value.split(";"):
        parts = entry.split(":")
        if len(parts) == 3:
            peers[int(parts[0])] = (int(parts[1]), int(parts[2]))
    return peers


def gone(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` has ended: no longer listed, a
    zombie (dead, not yet reaped by its launcher), or its pid now another process's. False where
    ``/proc`` cannot say now (this process out of descriptors, no permission): a death confirmed
    here cuts the rank at once, so only a sure one counts."""
    try:
        stat = _stat(pid)
    except OSError:
        return False
    return stat is None or stat[0] in ("Z", "X", "x") or stat[1] != start
