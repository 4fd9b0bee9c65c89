"""A host's relay: one rank per host reads the registry's listener events from the job's store and
hands them to the host's ranks over a local socket, so an event costs the store two requests per
host rather than per rank.

Why: every event (a loss report, a flight recorder's ask, a check-in's decision, a diagnosis
shared) wakes every rank's listener, and each listener's wake and read are two requests on the
job's one store: 131,072 at 65,536 ranks, 1.6 s of a store that serves 81,000 a second, on the
path of a rebuild's decision and of a hang's naming. With 8 ranks a host the relays send 16,384.

Who relays: the first rank in its host's key (:mod:`~commgroups.rank_loss.local_peers`: each rank
appends its process there before ``create()`` returns, so the first entry never changes) whose
process lives. Every rank of the host works that out alike from one read, with no exchange. The
relay's :class:`HostRelay` waits on the store on a connection of its own (a forwarder thread) and
sends each event to every connected :class:`RelayFeed`, as it read it, plus a tick every
:data:`TICK_S` (a second thread, which touches no store). The relay's own listener is a feed like
its peers'.

A death on the host is reported at once, whoever is idle: a feed whose socket closes without
its goodbye (:data:`GOODBYE`, sent by every close of a live listener) tells the relay that its
process may have died; the relay's ``on_feed_lost`` hears the process id (the socket's peer
credentials) and its owner reports the loss once ``/proc`` confirms the process gone. Likewise
a listener whose relay's socket closes without the relay's :data:`BYE` looks for the relay's
process. Without this only the heartbeat's backstop (10-30 s) saw a rank die while no peer
was in a collective with it (a rank's sockets to its peers close at its death, but a socket
nobody reads tells nobody).

When the relay fails, nothing is missed: a feed whose socket closed (the relay's process died, or
it closed its registry) or that heard nothing, not even a tick, for :data:`SILENT_S` (its process
stopped, or it holds the GIL in C) ends, and its listener goes back to the store at its own next
event number (events stay in the store until every member handled them), trying the relay again
after an event now and then (``Liveness``'s ``REJOIN_AFTER_S``). Meanwhile the host costs the
store what it did without a relay. A feed is told the first event the relay forwards
(:data:`HELLO`); the listener reads any event before it from the store itself.

Frames on the socket: ``!qI`` (the event's number, the payload's length), then the payload (the
event's JSON as stored). Number :data:`TICK` carries nothing; :data:`HELLO` carries the first
number forwarded, as text; :data:`BYE` (nothing) says the relay closes and its process lives;
:data:`LEFT` (nothing) that its rank's registry closed (it relays on for its host: its
process's end is no loss); :data:`DIED` (nothing) that its process is ending of an unhandled
exception (a loss: reported at once, without waiting for ``/proc``).
A feed sends :data:`ALIVE` for each tick it reads (its listener's thread runs), and
:data:`GOODBYE` (or :data:`DYING`), once, as it closes.

A loss report costs the store two requests per host for the answers too: the relay's owner
(``prepare``) answers it for the host's ranks whose feeds sent :data:`ALIVE` lately, in one
append and one add, and hands those feeds the event marked with the ranks it answered for;
their listeners send no answer of their own (two requests per rank: 131,072 at 65,536 ranks,
on the path of a rebuild's decision). A feed not heard from lately answers for itself.

The socket is Linux's abstract namespace (no file to leave behind when a process is killed),
named from the registry's namespace, the host and the relay's process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported

from commgroups.rank_loss.local_peers import gone
from commgroups.util.store_reads import read_bytes_if_present

__all__ = ["ALIVE", "BYE", "CONNECT_WITHIN_S", "DIED", "DYING", "FRESH_S", "GOODBYE", "HELLO",
           "LEFT", "SILENT_S", "TICK", "TICK_S", "HostRelay", "RelayFeed", "peer_pid",
           "relay_address", "relay_of"]

logger = logging.getLogger(__name__)

TICK_S = 0.1
"""Seconds between the relay's ticks: a feed that hears nothing for :data:`SILENT_S` gives up."""

SILENT_S = 0.5
"""How long a feed waits for any frame before its listener goes back to the store. Short: a loss
report must be answered within the check-in's ``dead_after_s`` (1 s by default) even when the
relay's process stopped; a false alarm (a relay slow on loaded cores) only costs the host the
store requests it saved."""

CONNECT_WITHIN_S = 1.0
"""How long a listener tries to reach its host's relay (which may still be starting) before it
listens on the store itself."""

SEND_TIMEOUT_S = 0.5
"""A feed that does not take a frame within this (its socket buffer full) is dropped: it then
goes back to the store."""

TICK = 0
HELLO = -1
BYE = -2
LEFT = -3
DIED = -4

GOODBYE = b"\x01"
"""What a feed sends as its listener closes it (its process lives): the relay then drops it
without reporting anything."""

DYING = b"\x02"
"""What a feed sends as it closes where its process is ending of an unhandled exception: the
relay reports its rank lost at once (its process may take a while to leave ``/proc``)."""

ALIVE = b"\x03"
"""What a feed sends for each tick it reads: its listener's thread runs (see :data:`FRESH_S`)."""

FRESH_S = 3 * TICK_S
"""A feed whose :data:`ALIVE` came within this is one whose listener runs: the relay's
``prepare`` (a loss report answered for the host's ranks, in one request for the host) covers
only such feeds. A feed quiet longer (its process stopped, its listener wedged, or only late on
loaded cores) answers for itself, as without a relay: never answered for while it cannot."""

_FRAME = struct.Struct("!qI")
_FOREVER = timedelta(days=365)

STOPPED_POLL_S = 0.1
"""How often a relay whose own registry closed looks for the next event (a ``check``, never a
wait): the last member's close deletes the events, and a wait begun just after that would hold
the thread and its connection for good. Only while its host's ranks still listen: seconds."""


def relay_address(namespace: str, host: str, rank: int, pid: int, start: int) -> str:
    """The abstract socket name of ``rank``'s relay (process ``pid`` started at ``start`` on
    ``host``) for the registry keyed ``namespace``."""
    digest = hashlib.sha256(f"{namespace}|{host}|{rank}|{pid}|{start}".encode()).hexdigest()
    return f"\0commgroups-relay-{digest[:24]}"


def relay_of(peers: Mapping[int, tuple[int, int]], rank: int) -> int | None:
    """The relay of a host whose key lists ``peers`` (in the order they published), as ``rank``
    sees it: the first listed whose process lives (``rank`` itself counts as alive). None where
    ``rank`` is not listed (its own entry has not landed: it cannot tell)."""
    if rank not in peers:
        return None
    for peer, (pid, start) in peers.items():
        if peer == rank or not gone(pid, start):
            return peer
    return None


def _frame(number: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(number, len(payload)) + payload


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(connection: socket.socket) -> int | None:
    """The process id of a Unix socket's peer (``SO_PEERCRED``, Linux), or None."""
    try:
        raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    except (OSError, AttributeError):
        return None
    return int(_CREDENTIALS.unpack(raw)[0])


def _last_word(feed: socket.socket) -> bytes:
    """What ``feed`` sent as it closed (:data:`GOODBYE`, :data:`DYING`, after any
    :data:`ALIVE` not read yet), read without waiting; empty where it sent nothing (a closed or
    reset socket with nothing left unread)."""
    try:
        return feed.recv(4096, socket.MSG_DONTWAIT)
    except OSError:
        return b""


def _loss(pid: int | None, word: bytes) -> tuple[int, bool] | None:
    """The loss a feed's end tells of: its process id and whether it said it is dying; None
    where it said goodbye (or its process is unknown)."""
    if pid is None or GOODBYE in word:
        return None
    return pid, DYING in word


def _close_quietly(connection: socket.socket, last: bytes = b"") -> None:
    """Send ``last`` where it fits at once, then close ``connection``."""
    with contextlib.suppress(OSError):
        if last:
            connection.setblocking(False)
            connection.send(last)
    with contextlib.suppress(OSError):
        connection.close()


class HostRelay:
    """The relay's side: a forwarder thread connects to the store (a connection of its own,
    under the registry's namespace), waits for each event from ``first`` on and sends it to
    every connected feed; a second thread accepts feeds (each told :data:`HELLO` the next
    number forwarded), ticks, and hears a feed close: without its :data:`GOODBYE`,
    ``on_feed_lost(pid, dying)`` runs on a thread of its own (``dying``: it said
    :data:`DYING`). The forwarder ends after the last member's ``close`` event, or after any
    event once ``stop()`` (this rank's registry closed) and no feed is left; :meth:`close` ends
    both threads at once (the forwarder's store wait at the next event, as the listener's
    does).

    Args:
        address: :func:`relay_address`.
        store: the forwarder's own connection (its wait holds it), or a callable that makes
            it on the forwarder's thread: the relay listens (its host's listeners reach it) at
            once, however long a connection takes (5 s now and then in this sandbox).
        first: the first event number to forward (this rank's listener's anchor).
        stop: whether this rank's liveness stopped: checked after each event (it forwards
            while a feed is left).
        on_done: called from the forwarder's thread as it ends, after :attr:`done` is set.
        on_feed_lost: called with a feed's process id (its socket's peer) and whether it said it
            is dying, where the feed closed without its goodbye or failed: its process may have
            died (the callee looks, unless it said so).
        prepare: called on the forwarder's thread before an event is handed over, with the
            forwarder's connection, the event as stored and the process ids of the feeds
            heard from within :data:`FRESH_S`; returns what those feeds are handed instead
            (the others get the event as stored). An exception hands the event over as stored.
    """

    def __init__(self, address: str, store: Store | Callable[[], Store], first: int,
                 stop: Callable[[], bool], on_done: Callable[[], None] = lambda: None,
                 on_feed_lost: Callable[[int, bool], None] | None = None,
                 prepare: Callable[[Store, bytes, frozenset[int]], bytes] | None = None,
                 ) -> None:
        self.address = address
        self._on_done: Callable[[], None] | None = on_done
        self._on_feed_lost = on_feed_lost
        self._prepare = prepare
        self._store: Store | Callable[[], Store] | None = store
        self._next = first
        self._stop = stop
        self._lock = threading.Lock()  # the feeds and _next: the forwarder and the acceptor
        self._feeds: dict[socket.socket, int | None] = {}  # each feed's process id
        self._heard_at: dict[socket.socket, float] = {}  # each feed's last ALIVE (or accept)
        self._closed = threading.Event()
        self._left = False  # the feeds were told LEFT (leave())
        self.done = threading.Event()
        """Set once the forwarder's thread ended (its store wait returned)."""
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def start(self) -> bool:
        """Listen on :attr:`address` and start the threads; False (nothing started) where the
        address is taken (a relay of the same process and namespace exists)."""
        try:
            self._server.bind(self.address)
            self._server.listen(256)
        except OSError as error:
            logger.debug("relay %r not started: %s", self.address, error)
            self._server.close()
            self.done.set()
            return False
        threading.Thread(target=self._forward, name="commgroups-relay-forward",
                         daemon=True).start()
        threading.Thread(target=self._serve, name="commgroups-relay-serve", daemon=True).start()
        return True

    @property
    def serving(self) -> bool:
        """Whether a feed is connected (a listener of this host still hears through it)."""
        with self._lock:
            return bool(self._feeds)

    def sockets(self) -> list[int]:
        """The descriptors of the relay's listening socket and its feeds (a forked child lets
        go of them: :func:`~commgroups.creation.sockets.detach_on_fork`). No lock: also read
        in a forked child, where the thread that held it is gone."""
        return [self._server.fileno(), *(feed.fileno() for feed in list(self._feeds))]

    def close(self, dying: bool = False) -> None:
        """Stop accepting and ticking, and close every feed, each told :data:`BYE` first
        (their listeners go back to the store at once, at their own next event, and report
        nothing; ``dying``: :data:`DIED` instead, this process ends of an unhandled exception,
        and they report it at once). Idempotent."""
        with self._lock:
            self._closed.set()
            feeds, self._feeds = self._feeds, {}
            self._heard_at = {}
        for feed in feeds:
            _close_quietly(feed, _frame(DIED if dying else BYE))
        with contextlib.suppress(OSError):
            self._server.close()

    def leave(self) -> None:
        """This rank's registry closed: tell every feed (:data:`LEFT`), and every feed that
        connects from now on, that this process's end is no loss. Idempotent; the relay goes on
        relaying."""
        with self._lock:
            if self._left or self._closed.is_set():
                return
            self._left = True
            lost = self._send_all(_frame(LEFT))
        self._lost(lost)

    def _send_all(self, data: bytes, prepared: bytes = b"",
                  to: Collection[socket.socket] = ()) -> list[tuple[int, bool]]:
        """Send ``data`` to every feed (under the lock), ``prepared`` instead to those in
        ``to``; drop a feed that does not take it. Returns the losses of those dropped without
        their goodbye (:func:`_loss`)."""
        kept: dict[socket.socket, int | None] = {}
        lost = []
        for feed, pid in self._feeds.items():
            try:
                feed.sendall(prepared if feed in to else data)
                kept[feed] = pid
            except OSError:
                loss = _loss(pid, _last_word(feed))
                if loss is not None:
                    lost.append(loss)
                _close_quietly(feed)
                self._heard_at.pop(feed, None)
        self._feeds = kept
        return lost

    def _lost(self, losses: list[tuple[int, bool]]) -> None:
        """Tell ``on_feed_lost`` of each, each on a thread of its own (it looks at ``/proc``
        and reports through the store: never on the forwarder's or the ticks' thread)."""
        callback = self._on_feed_lost
        if callback is None or self._closed.is_set():
            return
        for pid, dying in losses:
            threading.Thread(target=callback, args=(pid, dying), name="commgroups-relay-lost",
                             daemon=True).start()

    def _forward(self) -> None:
        try:
            self._forward_until_closed()
        except Exception as error:  # the store's host is gone: the feeds go back to it
            logger.debug("relay %r: forwarding ended: %r", self.address, error)
        finally:
            # Its connection goes with the thread, not with the registry's last reference (a
            # cycle through the liveness: freed only when the garbage collector runs).
            self._store = None
            self.close()
            self.done.set()
            on_done, self._on_done = self._on_done, None
            if on_done is not None:
                on_done()

    def _forward_until_closed(self) -> None:
        made = self._store
        assert made is not None
        store = made if isinstance(made, Store) else made()
        while not self._closed.is_set():
            with self._lock:
                idle = not self._feeds
            if self._stop() and (idle or read_bytes_if_present(store, "event/count") is None):
                # Nobody to serve, or every member closed already (the last one deletes the
                # events and their count; a feed whose listener ended may not be dropped yet,
                # until a tick to it fails), and this rank's registry closed: a wait now could
                # outlive the last member's close and hold the thread for good.
                return
            key = f"event/{self._next}"
            if self._stop():  # see STOPPED_POLL_S: the events may be deleted right after the read
                if not store.check([key]):
                    self._closed.wait(STOPPED_POLL_S)
                    continue
            else:
                store.wait([key], _FOREVER)
            # Deleted between the wait and the read: the last member closed; nothing follows.
            raw = read_bytes_if_present(store, key)
            if raw is None or self._closed.is_set():
                return
            prepared, fresh = self._prepared(store, raw)
            with self._lock:
                frame = _frame(self._next, raw)
                lost = self._send_all(frame, _frame(self._next, prepared) if fresh else frame,
                                      fresh)
                self._next += 1
                left = bool(self._feeds)
            self._lost(lost)
            # Every listener ends at the last member's close; a relay whose own registry closed
            # goes on for its host's ranks still listening (else each would open a connection
            # and wait on the store: 57,344 connections as a 65,536-rank job ends), and ends at
            # the first event once they are gone.
            if json.loads(raw).get("k") == "close" or (self._stop() and not left):
                return

    def _prepared(self, store: Store, raw: bytes) -> tuple[bytes, list[socket.socket]]:
        """``prepare``'s payload for the feeds heard from within :data:`FRESH_S`, and those
        feeds (none where there is no ``prepare`` or it failed). Outside the lock: ``prepare``
        may make store requests, and the ticks must go on meanwhile."""
        if self._prepare is None:
            return raw, []
        with self._lock:
            now = time.monotonic()
            fresh = {feed: pid for feed, pid in self._feeds.items()
                     if pid is not None and now - self._heard_at.get(feed, -FRESH_S) <= FRESH_S}
        if not fresh:
            return raw, []
        try:
            prepared = self._prepare(store, raw, frozenset(fresh.values()))
        except Exception as error:  # the feeds answer for themselves, as without a relay
            logger.debug("relay %r: preparing an event failed: %r", self.address, error)
            return raw, []
        return prepared, [] if prepared is raw else list(fresh)

    def _serve(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while not self._closed.is_set():
            with self._lock:
                feeds = [feed for feed in self._feeds if feed.fileno() >= 0]
            try:
                ready, _, _ = select.select([self._server, *feeds], [], [],
                                            max(0.0, next_tick - time.monotonic()))
            except (OSError, ValueError):  # closed under us: the relay, or a feed just dropped
                if self._closed.is_set():
                    return
                continue
            try:
                for connection in ready:
                    if connection is self._server:
                        self._accept()
                    else:
                        self._hear(connection)
            except (OSError, ValueError):  # the listening socket closed under us
                return
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                with self._lock:
                    lost = self._send_all(_frame(TICK))
                self._lost(lost)

    def _accept(self) -> None:
        feed, _ = self._server.accept()
        feed.settimeout(SEND_TIMEOUT_S)
        with self._lock:
            try:
                if self._closed.is_set():  # close() emptied the feeds already
                    raise OSError("the relay closed")
                feed.sendall(_frame(HELLO, str(self._next).encode())
                             + (_frame(LEFT) if self._left else b""))
                self._feeds[feed] = peer_pid(feed)
                self._heard_at[feed] = time.monotonic()
            except OSError:
                feed.close()

    def _hear(self, feed: socket.socket) -> None:
        """A feed is readable: :data:`ALIVE` (noted), its goodbye (its listener closed it), or
        its end without one (its process may have died): dropped either way."""
        word = _last_word(feed)
        with self._lock:
            if feed not in self._feeds:
                return  # dropped meanwhile
            if word and GOODBYE not in word and DYING not in word:
                self._heard_at[feed] = time.monotonic()
                return
            pid = self._feeds.pop(feed)
            self._heard_at.pop(feed, None)
        loss = _loss(pid, word)
        _close_quietly(feed)
        if loss is not None:
            self._lost([loss])


class RelayFeed:
    """A listener's side of its host's relay: :meth:`receive` gives the next event (number and
    its stored JSON) or the relay's :data:`HELLO`, and None once the relay failed or went quiet
    for :data:`SILENT_S` (then the caller listens on the store; :attr:`ending` says which)."""

    def __init__(self, connection: socket.socket) -> None:
        self._socket = connection
        self._buffer = b""
        self.ending = ""
        """Why :meth:`receive` returned None: ``bye`` (the relay closed, its process lives),
        ``died`` (its process is ending of an unhandled exception), ``closed`` (its socket
        closed without either: its process may have died), ``silent`` (nothing for
        :data:`SILENT_S`), ``stopped`` (the caller's ``stop()``); empty before."""
        self.relay_left = False
        """Whether the relay said :data:`LEFT`: its rank's registry closed, so its process's end
        is no loss."""

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed)."""
        return self._socket.fileno()

    @classmethod
    def connect(cls, address: str, within_s: float = CONNECT_WITHIN_S,
                stop: Callable[[], bool] = lambda: False) -> RelayFeed | None:
        """A feed from the relay at ``address``, tried every 20 ms for ``within_s`` (the relay
        may be starting); None where it cannot be reached."""
        deadline = time.monotonic() + within_s
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(address)
                return cls(connection)
            except OSError:
                connection.close()
            if stop() or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def receive(self, stop: Callable[[], bool]) -> tuple[int, bytes] | None:
        """The next frame other than a tick (or :data:`LEFT`, noted): ``(number, payload)``;
        None where the relay's socket closed or was silent for :data:`SILENT_S`, or ``stop()``
        (checked every tick); :attr:`ending` says which."""
        heard = time.monotonic()
        while not stop():
            if len(self._buffer) >= _FRAME.size:
                number, size = _FRAME.unpack_from(self._buffer)
                if len(self._buffer) >= _FRAME.size + size:
                    payload = self._buffer[_FRAME.size:_FRAME.size + size]
                    self._buffer = self._buffer[_FRAME.size + size:]
                    heard = time.monotonic()
                    if number in (BYE, DIED):
                        self.ending = "bye" if number == BYE else "died"
                        return None
                    if number == LEFT:
                        self.relay_left = True
                        continue
                    if number != TICK:
                        return number, payload
                    with contextlib.suppress(OSError):  # full or closed: the next recv says
                        self._socket.send(ALIVE, socket.MSG_DONTWAIT)
                    continue
            left = heard + SILENT_S - time.monotonic()
            if left <= 0:
                self.ending = "silent"
                return None
            try:
                ready, _, _ = select.select([self._socket], [], [], min(left, TICK_S))
                if not ready:
                    continue
                chunk = self._socket.recv(1 << 16)
            except (OSError, ValueError):
                chunk = b""
            if not chunk:
                self.ending = "closed"
                return None
            self._buffer += chunk
        self.ending = "stopped"
        return None

    def close(self, dying: bool = False) -> None:
        """Say :data:`GOODBYE` and close the socket (the relay drops this feed without reporting
        anything; a feed of a process that died closes without it); ``dying``: say
        :data:`DYING` instead (this process ends of an unhandled exception: reported at once)."""
        _close_quietly(self._socket, DYING if dying else GOODBYE)
