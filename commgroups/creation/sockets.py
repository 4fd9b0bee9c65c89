"""Severing a gloo generation: shutting its TCP sockets down so no rank waits out a collective.

After a rank loss, gloo frees a blocked collective only when its own timeout runs out or a peer's
socket closes: ``ProcessGroupGloo.abort()`` and ``shutdown()`` free nothing (measured on torch
2.13: a rank blocked on a live peer waited its whole 20 s timeout after either call, on itself or
on the peer). A dead rank's direct peers fail at once because the kernel closed its sockets; this
module does the same for a live rank, on purpose: :func:`sever` shuts down (``SHUT_RDWR``) every
connected socket a generation's gloo groups opened (never a listener: gloo aborts the process when
its listener fails), so this rank's pending operations on them fail at once
and so do its peers' (they see "Connection closed by peer"), who then sever theirs.

Which sockets are the groups' is learned at creation by a :class:`SocketLedger` around the gloo
groups made one after another (torch 2.10-2.15 connect every pair of a gloo group while
constructing it, and open no socket later). A socket is named by its descriptor and its inode, and
severed only while the descriptor still names that inode, so a descriptor number reused after the
group closed is never touched. Linux only (``/proc/self/fd``); elsewhere :data:`SUPPORTED` is False
and nothing is recorded: survivors then wait for the role timeout, as before.

A process forked from a rank (a ``DataLoader`` worker, a fork-started pool) holds every
descriptor of its parent, so a killed rank's sockets stay open for as long as such a child lives,
and its peers see nothing close: measured on 4 gloo ranks, a child living 8 s after its rank was
SIGKILLed held the survivors' failure back 8 s (0.2 s without), one living 60 s held it 40 s.
:func:`detach_on_fork` lets every child forked later let go of a generation's sockets
(:func:`detach`).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import socket
import stat
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from commgroups.creation.descriptor_table import FDS, lowest_free, open_descriptors

__all__ = ["GLOO_OTHER_DESCRIPTORS", "SUPPORTED", "SocketLedger", "SocketRef", "detach",
           "detach_on_fork", "gloo_descriptors", "gloo_sockets", "new_sockets", "open_sockets",
           "sever", "socket_ref"]

logger = logging.getLogger(__name__)

_Owner = TypeVar("_Owner")

SUPPORTED = sys.platform.startswith("linux") and os.path.isdir(FDS)
"""Whether this platform lets a process list its sockets (Linux's ``/proc``)."""

SocketRef = tuple[int, str]
"""A socket as (descriptor, ``socket:[inode]``): the inode tells a reused descriptor apart."""


def _socket_link(fd: int) -> str | None:
    """``socket:[inode]`` of descriptor ``fd`` if it is a socket, else None (also once closed).

    ``fstat`` rather than ``readlink``: half the cost (100 descriptors: 0.045 against 0.1 ms
    here), the same inode."""
    try:
        status = os.fstat(fd)
    except OSError:  # closed since listed
        return None
    return f"socket:[{status.st_ino}]" if stat.S_ISSOCK(status.st_mode) else None


def socket_ref(fd: int) -> SocketRef | None:
    """Descriptor ``fd`` as a :data:`SocketRef` if it is an open socket, else None."""
    link = _socket_link(fd)
    return None if link is None else (fd, link)


def _sockets_among(numbers: Iterable[int]) -> dict[int, str]:
    """The sockets among descriptors ``numbers``: descriptor -> ``socket:[inode]``."""
    return {fd: link for fd in numbers if (link := _socket_link(fd)) is not None}


def open_sockets() -> dict[int, str]:
    """Every socket this process holds: descriptor -> ``socket:[inode]`` (empty where unsupported)."""
    return _sockets_among(open_descriptors()) if SUPPORTED else {}


def gloo_sockets(members: int) -> int:
    """The sockets a gloo group of ``members`` ranks opens on each member while it is made: its
    listener and one connection per peer (checked on torch 2.10, 2.13 and 2.15 with one
    device; gloo also opens :data:`GLOO_OTHER_DESCRIPTORS` that are not sockets)."""
    return members


GLOO_OTHER_DESCRIPTORS = 3
"""Descriptors other than sockets that a gloo group opens on each member while it is made
(checked on torch 2.10, 2.13 and 2.15, as :func:`gloo_sockets`)."""


def gloo_descriptors(members: int) -> int:
    """Every descriptor a gloo group of ``members`` ranks opens on each member while it is made:
    its sockets (:func:`gloo_sockets`) and :data:`GLOO_OTHER_DESCRIPTORS`."""
    return gloo_sockets(members) + GLOO_OTHER_DESCRIPTORS


@dataclass
class _Window:
    """Groups made one after another with the same members here (none: another backend's)."""

    start: int
    """The lowest free descriptor number when the first of them began."""
    names: list[str]
    """Empty for another backend's groups (a gap)."""
    members: tuple[int, ...] | None
    """Whom the groups hold here (None: not this rank)."""
    sockets: int
    """How many sockets they open together (:func:`gloo_sockets` each)."""


class SocketLedger:
    """Which new sockets each of several gloo groups, made one after another, opened.

    Descriptors are numbered lowest free first, and gloo opens a group's sockets while making
    it and closes none, so one group's sockets take the lowest free numbers in order: every
    number from the lowest free one when a group starts up to the lowest free one when the
    next starts was either open before or is that group's. So the ledger reads the open
    descriptors once, when it starts (what was there); between groups and at :meth:`finish` it
    takes only the lowest free number (one open and close, a microsecond; a directory read
    between groups cost 8 gloo ranks on 2 cores about 1 ms each, on the path where every rank
    waits for the slowest), and at the end it reads the inode of each number from the first
    window's start up to that last one that was not open before. Groups made one after
    another with the same members here share one window: a loss interrupts both or neither,
    so their sockets need not be told apart. A socket that appeared while another backend's
    group was made (NCCL's bootstrap) is nobody's.

    Each window is checked: it must hold exactly the sockets its groups open
    (:func:`gloo_sockets`). Where one does not (another thread closed a descriptor during
    creation, so the numbering went back; a foreign socket opened meanwhile; gloo opening more,
    on more devices), every new socket of the windows counts for every group, so a sever never
    misses one (it may shut a sibling group's down early: the generation is retired as a
    whole). A socket that took the number of a descriptor open at the start, or a number above
    the lowest free one at the end, is not recorded here (both only follow a close during
    creation); its peer records its own end, and severing that frees both.

    Example: ``ledger = SocketLedger()`` right before the first gloo group; ``ledger.watch("cp",
    (0, 1))`` before making ``cp``; ``ledger.gap()`` before a group of another backend; then
    ``ledger.finish()["cp"]`` holds the sockets ``cp`` opened.
    """

    def __init__(self) -> None:
        self._old = frozenset(open_descriptors()) if SUPPORTED else frozenset()
        self._windows: list[_Window] = []

    def watch(self, name: str, members: tuple[int, ...] | None) -> None:
        """``name``'s group is made next; ``members``: whom it holds here (None: not this rank;
        a window of the same members stays open for it)."""
        expected = 0 if members is None else gloo_sockets(len(members))
        last = self._windows[-1] if self._windows else None
        if last is not None and last.names and last.members == members:
            last.names.append(name)
            last.sockets += expected
            return
        self._begin([name], members, expected)

    def gap(self) -> None:
        """A group of another backend is made next: its sockets are nobody's."""
        if not self._windows or self._windows[-1].names:
            self._begin([], None, 0)

    def finish(self) -> dict[str, tuple[SocketRef, ...]]:
        """Each watched group's new sockets, by name (every group named, empty where none)."""
        found: dict[str, list[SocketRef]] = {n: [] for w in self._windows for n in w.names}
        if not SUPPORTED or not self._windows:
            return {name: () for name in found}
        starts = [window.start for window in self._windows]
        placed: list[list[SocketRef]] = [[] for _ in self._windows]
        new = (fd for fd in range(starts[0], lowest_free()) if fd not in self._old)
        for fd, link in _sockets_among(new).items():  # in order: the numbers ascend
            placed[bisect.bisect_right(starts, fd) - 1].append((fd, link))
        if all(len(refs) == window.sockets
               for window, refs in zip(self._windows, placed) if window.names):
            for window, refs in zip(self._windows, placed):
                for name in window.names:
                    found[name] = refs
        else:
            every = sorted(ref for window, refs in zip(self._windows, placed)
                           if window.names for ref in refs)
            logger.debug("socket numbering went out of order during creation: every group's "
                         "%d new socket(s) count for each group", len(every))
            found = {name: every for name in found}
        return {name: tuple(refs) for name, refs in found.items()}

    def _begin(self, names: list[str], members: tuple[int, ...] | None, sockets: int) -> None:
        self._windows.append(_Window(lowest_free() if SUPPORTED else 0, names, members, sockets))


def new_sockets(before: Mapping[int, str], after: Mapping[int, str]) -> tuple[SocketRef, ...]:
    """The sockets in ``after`` that ``before`` did not hold (by descriptor and inode)."""
    return tuple(sorted((fd, link) for fd, link in after.items() if before.get(fd) != link))


def sever(sockets: Iterable[SocketRef]) -> int:
    """Shut every still-open socket of ``sockets`` down, both ways; returns how many. Local, quick.

    Idempotent (a second shutdown changes nothing); a closed or reused descriptor is skipped. The
    descriptors stay open (their owner, gloo, closes them when its group is destroyed).
    """
    severed = 0
    for fd, link in sockets:
        try:
            if _socket_link(fd) != link:
                continue  # closed, and the number reused by something else
            duplicate = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # Never a listener: gloo's accept loop aborts the process on a shut-down listener.
            if not duplicate.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                duplicate.shutdown(socket.SHUT_RDWR)
                severed += 1
        except OSError:  # not connected, or shut down already
            pass
        finally:
            duplicate.close()  # closes our duplicate only; shutdown acted on the shared socket
    logger.debug("severed %d socket(s)", severed)
    return severed


def detach(sockets: Iterable[SocketRef]) -> int:
    """In a forked child: let go of every still-open socket of ``sockets``; returns how many.

    Each descriptor is pointed at ``/dev/null`` rather than closed: its number stays taken, so
    nothing the child opens later gets it, and a later close by the child's copy of gloo (at its
    exit) closes ``/dev/null``, not something of the child's. The sockets themselves, which the
    parent still uses, are untouched (only this process's references to them go). A closed or
    reused descriptor is skipped, as :func:`sever` skips it.
    """
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return 0
    detached = 0
    try:
        for fd, link in sockets:
            if _socket_link(fd) == link:  # /dev/null's own number is no socket: skipped
                try:
                    os.dup2(null, fd, inheritable=False)
                    detached += 1
                except OSError:
                    pass
    finally:
        os.close(null)
    return detached


def detach_on_fork(owner: _Owner, sockets: Callable[[_Owner], Iterable[SocketRef]]) -> None:
    """Have every child forked from now on :func:`detach` ``sockets(owner)`` while ``owner``
    lives: its peers then see the sockets close when this process dies, whatever children it
    left behind. ``owner`` is held weakly: once it is gone a fork does nothing for it.

    ``os.register_at_fork`` keeps the hook for the process's life (there is no unregistering):
    one small function per call, which costs a fork a few microseconds once its owner is gone.
    The hook runs in the child only, on the forking thread, and takes no lock (the threads that
    held one did not survive the fork).
    """
    if not SUPPORTED:
        return
    owner_ref = weakref.ref(owner)

    def in_child() -> None:
        alive = owner_ref()
        if alive is not None:
            with contextlib.suppress(Exception):  # never let the child fail for this
                detach(sockets(alive))

    os.register_at_fork(after_in_child=in_child)
