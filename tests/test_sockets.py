"""commgroups.creation.sockets: a generation's sockets found by descriptor and inode, severed both
ways, never a listener, never a descriptor reused since (real sockets, one process)."""

from __future__ import annotations

import socket

import pytest

from commgroups.creation.sockets import SUPPORTED, SocketLedger, new_sockets, open_sockets, sever

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="needs /proc/self/fd (Linux)")


def test_new_sockets_are_the_ones_opened_between_two_looks() -> None:
    before = open_sockets()
    a, b = socket.socketpair()
    try:
        found = new_sockets(before, open_sockets())
        assert {fd for fd, _ in found} == {a.fileno(), b.fileno()}
        assert all(link.startswith("socket:[") for _, link in found)
    finally:
        a.close()
        b.close()


def test_sever_shuts_a_connected_socket_down_and_its_peer_sees_the_end() -> None:
    before = open_sockets()
    a, b = socket.socketpair()
    try:
        mine = [ref for ref in new_sockets(before, open_sockets()) if ref[0] == a.fileno()]
        assert sever(mine) == 1
        assert b.recv(1) == b""  # the peer reads end-of-stream at once, as after a death
        with pytest.raises(OSError):
            a.send(b"x")
        sever(mine)  # idempotent: a second time changes nothing
        with pytest.raises(OSError):
            a.send(b"x")
    finally:
        a.close()
        b.close()


def test_sever_leaves_listeners_and_reused_descriptors_alone() -> None:
    before = open_sockets()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        refs = new_sockets(before, open_sockets())
        assert sever(refs) == 0  # gloo aborts the process when its listener fails
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening
        fd, _ = refs[0]
        assert sever([(fd, "socket:[0]")]) == 0  # another inode: the number was reused
    finally:
        listener.close()


def test_the_ledger_gives_each_window_the_sockets_opened_in_it() -> None:
    """Windows closed by number-only looks: each socket goes to the group it was opened for
    (groups with the same members share a window); one opened in a gap (another backend's) to
    nobody; a closed descriptor whose number a new socket takes, unseen by any look, to every
    group (a sever never misses it); one opened after the last group to nobody."""
    held = socket.socket()  # a descriptor before the first look: never anyone's
    ledger = SocketLedger()
    ledger.watch("first", (0, 1))
    first = socket.socketpair()
    ledger.watch("first-again", (0, 1))  # the same members: the same window
    again = socket.socket()
    ledger.gap()
    between = socket.socket()  # another backend's group
    ledger.watch("second", (0, 2))
    second = socket.socketpair()
    number = held.fileno()
    held.close()
    reused = socket.socket()  # the lowest free number: the one just closed
    found = ledger.finish()
    late = socket.socket()
    try:
        assert reused.fileno() == number
        fds = {name: {fd for fd, _ in refs} for name, refs in found.items()}
        mine = {first[0].fileno(), first[1].fileno(), again.fileno(), number}
        assert fds == {"first": mine, "first-again": mine,
                       "second": {second[0].fileno(), second[1].fileno(), number}}
        assert between.fileno() not in fds["first"] | fds["second"]
    finally:
        for sock in (*first, *second, again, between, reused, late):
            sock.close()


def test_a_window_after_a_gap_starts_from_a_new_look() -> None:
    ledger = SocketLedger()
    ledger.watch("gloo", (0, 1))  # nothing opened
    ledger.gap()
    nccl = socket.socket()  # opened while the other backend's group was made
    ledger.watch("next", (0, 1))
    try:
        assert ledger.finish() == {"gloo": (), "next": ()}
    finally:
        nccl.close()
