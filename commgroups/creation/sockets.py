"""Severing a gloo generation: shutting its TCP sockets down so no rank waits out a collective.

After a rank loss, gloo frees a blocked collective only when its own timeout runs out or a peer's
socket closes: ``ProcessGroupGloo.abort()`` and ``shutdown()`` free nothing (measured on torch
2.13: a rank blocked on a live peer waited its whole 20 s timeout after either call, on itself or
on the peer). A dead rank's direct peers fail at once because the kernel closed its sockets; this
module does the same for a live rank, on purpose: :func:`sever` shuts down (``SHUT_RDWR``) every
connected socket a generation's gloo groups opened (never a listener: gloo aborts the process when
its listener fails), so this rank's pending operations on them fail at once
and so do its peers' (they see "Connection closed by peer"), who then sever theirs.

Which sockets are the groups' is learned at creation: :func:`open_sockets` before and after a gloo
group is made (torch 2.10-2.15 connect every pair of a gloo group while constructing it, and open no
socket later). A socket is named by its descriptor and its inode, and severed only while the
descriptor still names that inode, so a descriptor number reused after the group closed is never
touched. Linux only (``/proc/self/fd``); elsewhere :data:`SUPPORTED` is False and nothing is
recorded: survivors then wait for the role timeout, as before.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["SUPPORTED", "SocketRef", "new_sockets", "open_sockets", "sever"]

logger = logging.getLogger(__name__)

_FDS = Path("/proc/self/fd")
SUPPORTED = sys.platform.startswith("linux") and _FDS.is_dir()
"""Whether this platform lets a process list its sockets (Linux's ``/proc``)."""

SocketRef = tuple[int, str]
"""A socket as (descriptor, ``socket:[inode]``): the inode tells a reused descriptor apart."""


def open_sockets() -> dict[int, str]:
    """Every socket this process holds: descriptor -> ``socket:[inode]`` (empty where unsupported)."""
    if not SUPPORTED:
        return {}
    found: dict[int, str] = {}
    # Relative to an open descriptor of the folder: no path to build and resolve per descriptor
    # (a pathlib join and a full lookup each cost more than the readlink itself: 2 ms a call
    # with 115 descriptors open, a call before and after every gloo group of create()).
    folder = os.open(_FDS, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(folder):
            try:
                link = os.readlink(name, dir_fd=folder)
            except OSError:  # closed since listed
                continue
            if link.startswith("socket:"):
                found[int(name)] = link
    finally:
        os.close(folder)
    return found


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
