"""commgroups.creation.sockets: a generation's sockets found by descriptor and inode, severed both
ways, never a listener, never a descriptor reused since (real sockets, one process)."""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from commgroups.creation.sockets import (
    SUPPORTED,
    SocketLedger,
    detach,
    detach_on_fork,
    gloo_sockets,
    new_sockets,
    open_sockets,
    sever,
)

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


class _Owner:
    """What detach_on_fork holds weakly (a generation, in the product)."""

    def __init__(self, refs: list[tuple[int, str]]) -> None:
        self.refs = refs


def _closes_while_child_lives(register: bool) -> bool:
    """Fork a child that outlives ``a``'s close here; whether ``b`` sees the end at once."""
    before = open_sockets()
    a, b = socket.socketpair()
    owner = _Owner([ref for ref in new_sockets(before, open_sockets()) if ref[0] == a.fileno()])
    if register:
        detach_on_fork(owner, lambda held: held.refs)
    child = os.fork()
    if child == 0:  # a DataLoader worker's stand-in: it holds what the fork gave it, idle
        time.sleep(30)
        os._exit(0)
    try:
        a.close()
        ready, _, _ = select.select([b], [], [], 2.0)
        return bool(ready) and b.recv(1) == b""
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        b.close()
        del owner
        gc.collect()


def test_a_forked_child_keeps_a_socket_open_unless_detached_on_fork() -> None:
    # The peer of a closed socket sees the end only once no process holds it: a child forked
    # earlier does, unless the owner had it detach the socket at the fork.
    assert not _closes_while_child_lives(register=False)
    assert _closes_while_child_lives(register=True)


def test_detach_points_a_socket_at_dev_null_and_skips_a_reused_descriptor() -> None:
    before = open_sockets()
    a, b = socket.socketpair()
    try:
        refs = [ref for ref in new_sockets(before, open_sockets()) if ref[0] == a.fileno()]
        stale = [(b.fileno(), "socket:[1]")]  # the number now names another inode
        assert detach(refs + stale) == 1
        assert os.readlink(f"/proc/self/fd/{a.fileno()}") == os.devnull  # number still taken
        assert os.readlink(f"/proc/self/fd/{b.fileno()}").startswith("socket:[")
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


Opener = Callable[[int], list[socket.socket]]


@pytest.fixture
def sockets() -> Iterator[Opener]:
    """``sockets(count)`` opens ``count`` sockets, as a gloo group of ``count`` members opens here
    (its listener and one per peer: :func:`gloo_sockets`); every one is closed after the test."""
    opened: list[socket.socket] = []

    def open_count(count: int) -> list[socket.socket]:
        made = [socket.socket() for _ in range(count)]
        opened.extend(made)
        return made

    yield open_count
    for sock in opened:
        sock.close()  # a second close (a test closed it already) does nothing


def _numbers(found: dict[str, tuple[tuple[int, str], ...]]) -> dict[str, set[int]]:
    return {name: {fd for fd, _ in refs} for name, refs in found.items()}


def test_the_ledger_gives_each_window_the_sockets_opened_in_it(sockets: Opener) -> None:
    """Windows told apart by the lowest free number alone: each socket goes to the group it was
    opened for (groups with the same members share a window); one opened in a gap (another
    backend's group) to nobody; one open before, or opened after the last group, to nobody."""
    (held,) = sockets(1)  # open before the first look: never anyone's
    ledger = SocketLedger()
    ledger.watch("first", (0, 1))
    first = sockets(gloo_sockets(2))
    ledger.watch("first-again", (0, 1))  # the same members: the same window
    again = sockets(gloo_sockets(2))
    ledger.gap()
    (between,) = sockets(1)  # another backend's group
    ledger.watch("second", (0, 2, 3))
    second = sockets(gloo_sockets(3))
    ledger.watch("elsewhere", None)  # a group this rank is not in: it opens nothing here
    found = _numbers(ledger.finish())
    sockets(1)  # opened after the last group
    mine = {sock.fileno() for sock in (*first, *again)}
    assert found == {"first": mine, "first-again": mine,
                     "second": {sock.fileno() for sock in second}, "elsewhere": set()}
    everyone = set().union(*found.values())
    assert held.fileno() not in everyone and between.fileno() not in everyone


def test_numbering_out_of_order_gives_every_group_every_new_socket(sockets: Opener) -> None:
    """A descriptor closed during creation (another thread's) sends the next socket back to its
    number, where the ranges no longer say whose it is: the counts do not add up, and every
    group gets every new socket (a sever never misses one). The socket on the closed number
    was open before by number: not recorded (its peer records its end)."""
    (held,) = sockets(1)
    ledger = SocketLedger()
    ledger.watch("first", (0, 1))
    first = sockets(2)
    ledger.watch("second", (0, 2))
    number = held.fileno()
    held.close()
    second = sockets(2)  # the first of them takes the closed number
    found = _numbers(ledger.finish())
    assert second[0].fileno() == number
    expected = {sock.fileno() for sock in (*first, second[1])}
    assert found == {"first": expected, "second": expected}


def test_a_foreign_socket_in_a_window_gives_every_group_every_new_socket(
        sockets: Opener) -> None:
    ledger = SocketLedger()
    ledger.watch("first", (0, 1))
    first = sockets(2)
    ledger.watch("second", (0, 2))
    second = sockets(3)  # one more than a gloo group of 2 opens: another thread's
    found = _numbers(ledger.finish())
    everything = {sock.fileno() for sock in (*first, *second)}
    assert found == {"first": everything, "second": everything}


def test_a_window_after_a_gap_starts_from_a_new_look(sockets: Opener) -> None:
    ledger = SocketLedger()
    ledger.watch("gloo", (0, 1))  # nothing opened
    ledger.gap()
    sockets(1)  # opened while the other backend's group (NCCL) was made
    ledger.watch("next", (0, 1))
    assert ledger.finish() == {"gloo": (), "next": ()}
