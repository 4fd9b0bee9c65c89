"""Severing a gloo generation: shutting its TCP sockets down so no rank waits out a collective.

After a rank loss, gloo frees a blocked collective only when its own timeout runs out or a peer's
socket closes: ``ProcessGroupGloo.abort()`` and ``shutdown()`` free nothing (measured on torch
2.13: a rank blocked on a live peer waited its whole 20 s timeout after either call, on itself or
on the peer). A dead rank's direct peers fail at once because the kernel closed its sockets; this
module does the same for a live rank, on purpose: :func:`sever` shuts down (``SHUT_RDWR``) every
connected socket a generation's gloo groups opened (never a listener: gloo aborts the process when
its listener fails), so this rank's pending operations on them fail at once
and so do its peers' (they see "Connection closed by peer"), who then sever theirs.

Which sockets are the groups' is learned at creation: :func:`open_descriptors` before and after a
gloo group is made (torch 2.10-2.15 connect every pair of a gloo group while constructing it, and open
no socket later), and :func:`new_sockets` reads what only the second look holds. A socket is named by
its descriptor and its inode, and severed only while the descriptor still names that inode, so a
descriptor number reused after the group closed is never touched. Linux only (``/proc/self/fd``);
elsewhere :data:`SUPPORTED` is False and nothing is recorded: survivors then wait for the role
timeout, as before.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from pathlib import Path

__all__ = ["SUPPORTED", "SocketRef", "new_sockets", "open_descriptors", "sever"]

logger = logging.getLogger(__name__)

_FDS = Path("/proc/self/fd")
SUPPORTED = sys.platform.startswith("linux") and _FDS.is_dir()
"""Whether this platform lets a process list its sockets (Linux's ``/proc``)."""

SocketRef = tuple[int, str]
"""A socket as (descriptor, ``socket:[inode]``): the inode tells a reused descriptor apart."""


def open_descriptors() -> frozenset[int]:
    """The descriptors this process holds now, by number: one directory read, no link read
    (empty where unsupported)."""
    if not SUPPORTED:
        return frozenset()
    # The listing's own descriptors are left out: closed right after, their numbers are the next
    # sockets', which must read as new. listdir(fd) reads a duplicate of ``folder`` (CPython),
    # which takes the lowest free number: ``spare``'s.
    folder = os.open(_FDS, os.O_RDONLY | os.O_DIRECTORY)
    try:
        spare = os.dup(folder)
        os.close(spare)
        return frozenset(int(name) for name in os.listdir(folder)) - {folder, spare}
    finally:
        os.close(folder)


def new_sockets(before: AbstractSet[int], after: AbstractSet[int]) -> tuple[SocketRef, ...]:
    """The sockets among the descriptors ``after`` holds and ``before`` did not, by descriptor and
    inode.

    Only the new numbers' links are read: a scan of every descriptor's link before and after each
    gloo group was a third of create()'s own CPU time with 120 descriptors open (3 of 14 ms per
    rank on 8 ranks, where 8 ranks share 2 cores: about 12 ms of the job's wall time). A number
    held in both looks is taken for the same descriptor; one closed and reused between them
    (nothing in create() closes a descriptor it held before a group) would be missed, and its
    group severed on its other sockets only.
    """
    found: list[SocketRef] = []
    for fd in sorted(after - before):
        try:
            link = os.readlink(f"{_FDS}/{fd}")  # a str: a pathlib join costs more than the read
        except OSError:  # closed since listed
            continue
        if link.startswith("socket:"):
            found.append((fd, link))
    return tuple(found)


def sever(sockets: Iterable[SocketRef]) -> int:
    """Shut every still-open socket of ``sockets`` down, both ways; returns how many. Local, quick.

    Idempotent (a second shutdown changes nothing); a closed or reused descriptor is skipped. The
    descriptors stay open (their owner, gloo, closes them when its group is destroyed).
    """
    severed = 0
    for fd, link in sockets:
        try:
            if os.readlink(_FDS / str(fd)) != link:
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
