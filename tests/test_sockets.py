"""commgroups.creation.sockets: a generation's sockets found by descriptor and inode, severed both
ways, never a listener, never a descriptor reused since (real sockets, one process)."""

from __future__ import annotations

import socket

import pytest

from commgroups.creation.sockets import SUPPORTED, new_sockets, open_sockets, sever

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
