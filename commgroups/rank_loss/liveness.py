"""Who is alive, learned through the store: one listening thread per rank that costs the store
almost nothing while nothing happens, and events that reach every rank at once when something does.

Two daemon threads per registry (:class:`Liveness`):

1. **the listener**, on its own connection to the job's TCPStore, blocks in ``wait`` on the
   registry's next event key (``event/<n>``). A blocked wait is one request that the store answers
   when the key is set: an idle listener sends nothing at all. (It never times out: a timed-out
   store wait makes torch print two warnings.) Events (:meth:`Liveness.emit`, from any rank):

   - ``loss``: a rank reported a loss in generation ``g`` (:meth:`Liveness.report`), naming the
     ranks that will take no further part in ``g`` (the reporter and the ranks it knows lost), or
     nobody in particular. The thread first answers that it is alive (:func:`answer`, two
     requests: the survivors' check-in waits for a rank that answered and counts one that did
     not within ``dead_after_s`` as dead), then ``on_loss(g, suspects)`` interrupts ``g``'s
     groups that hold a suspect (all of them when the report named nobody), so no rank waits
     out a collective timeout on a peer that left it, and a collective whose members are all
     still at it goes on;
   - ``ask``: a flight recorder asks for statuses (the subscriber of that prefix handles it: the
     event names the role, the asker and the ask's number, and only the asker's group answers);
   - ``decided``: a rebuild's check-in decided who is out (the check-in waiting on that prefix
     takes it: the decision is pushed, no follower polls or blocks a connection);
   - ``close``: the last member closed; every listener still waiting ends (``wake``: a rank that
     closed alone ends its own).

   Where the registry asks for it (``relay=True``: it does), a host's listeners hear events
   through its relay instead (:mod:`~commgroups.rank_loss.host_relay`): one rank per host waits
   and reads, and hands each event to the others over a local socket; a listener whose relay
   dies or goes quiet goes back to the store at its own next event. Those sockets also say
   when a process of the host dies, idle or not: the relay reports a member whose feed closed
   without its goodbye, a listener its relay, once ``/proc`` shows the process gone
   (:meth:`Liveness.report_if_gone`): milliseconds, where the beat below takes 10-30 s. The
   relay also answers a loss report for the host's ranks whose listeners it heard from within
   the last ``FRESH_S`` (0.3 s: each reads the relay's ticks, every 0.1 s), in the same two
   requests for the host (:func:`answer_for_host`); those listeners send none. A listener
   that cannot run (its process stopped, or holding the GIL in C) is not answered for.

2. **the beat** (the backstop, every ``interval_s``, on the job's shared connection): adds 1 to
   ``beat/<rank>`` and reads its ring
   successor's beat; a beat that has not moved for ``report_after_s`` (ten times ``dead_after_s``)
   is reported as a loss of that rank. A dead process is seen by its peers' sockets within
   milliseconds and by a roll call within ``dead_after_s``; the beat only catches a process alive
   but wedged (holding the GIL in C), so it can be slow. The same thread runs the periodic
   tasks given to :meth:`Liveness.every` (the flight publisher's look at its status).

Idle cost per rank: two requests every ``interval_s`` (the beat, the read of the successor's),
whatever the world's size; 0.2 per second at the default 10 s. Once, at its first periodic beat,
the beat's thread also reads which processes share this host (:meth:`Liveness.learn_host`): a
loss is then answered with the host's deaths confirmed from ``/proc`` without reading the host's
key (one request per rank fewer before a rebuild's decision). Requests from other threads
(reports, answers' checks, flight asks) go through the job's shared connection: the listener's
own is held by its wait.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # re-exported

from commgroups.creation.sockets import SocketRef, detach_on_fork, socket_ref
from commgroups.rank_loss.host_relay import HELLO, HostRelay, RelayFeed, relay_address, relay_of
from commgroups.rank_loss.local_peers import ProcessId, gone, host_key, parse_peers
from commgroups.util.store_reads import (
    append_numbers,
    parse_numbers,
    read_if_present,
    read_numbers,
)

__all__ = ["RELAY_ANSWERED", "Liveness", "OnLoss", "answer", "answer_for_host", "answered",
           "gone_peers", "own_connection"]

logger = logging.getLogger(__name__)

OnLoss = Callable[[int, frozenset[int] | None], None]
"""``on_loss(generation, suspects)``: suspects None means every group of that generation."""

_FOREVER = timedelta(days=365)  # the listener's wait: an event (a close included) ends it

REJOIN_AFTER_S = 10.0
"""A listener that went back to the store because its relay went quiet tries the relay again
after an event, once this long has passed (and again after as long): a relay slow for a moment
on loaded cores must not cost its host the relay for the registry's life. A relay still stopped
holds that one event up by the feed's silence (0.5 s)."""

GONE_WITHIN_S = 0.5
"""How long a process whose relay socket closed without a goodbye is looked for in ``/proc``
before it counts as alive: a dying process closes its sockets before it leaves ``/proc``."""

REPORT = 1 << 32
"""What each loss report adds to its generation's counter (``lost/<g>``); each answer adds 1.
The first report is the one whose add returns less than twice this; an answer whose add returns
less than this found the report released (:func:`answer`)."""


def own_connection(store: Store, timeout: timedelta) -> Store | None:
    """A new client connection to the TCPStore under ``store``, with the same key prefixes
    (``Store.clone()``, meant for one store per thread; on 2.10-2.15), or None when the job's
    store is not a TCPStore (a FileStore or HashStore: no listener then)."""
    inner = store
    for _ in range(8):
        if not hasattr(inner, "underlying_store"):
            break
        inner = inner.underlying_store
    if not isinstance(inner, TCPStore):
        return None
    client: Store = store.clone()  # type: ignore[attr-defined,unused-ignore]  # not in the stubs
    client.set_timeout(timeout)
    return client


def answer(store: Store, generation: int, ranks: Sequence[int]) -> bool:
    """Say that ``ranks`` heard generation ``generation``'s loss report and are alive: one
    append to the answers' list (``store``: the registry's namespace), which only a deciding
    rank reads, then one add of their number to the report's counter. Returns whether they
    answered (False: the report was released already)."""
    append_numbers(store, f"lost/{generation}/here", ranks)
    # The add after the append: a decider that sees the counter move finds the answer listed.
    # It also tells whether the report still exists: every report adds REPORT, so an add that
    # returns less found it released (once every survivor checked in; a listener that lagged on
    # loaded cores hears it late). Both keys were re-created then: they go again (a leak
    # otherwise), by every such late answer after its own append.
    if int(store.add(f"lost/{generation}", len(ranks))) < REPORT:
        with contextlib.suppress(RuntimeError):
            store.delete_key(f"lost/{generation}")
            store.delete_key(f"lost/{generation}/here")
        return False
    return True


RELAY_ANSWERED = "h"
"""The field of a loss report's event, as a host's relay hands it over, that lists the ranks
the relay answered the report for (:func:`answer_for_host`): their listeners send no answer."""


def answer_for_host(store: Store, raw: bytes, ranks: Collection[int],
                    answered: Mapping[int, Collection[int]] | None = None,
                    ) -> tuple[bytes, int | None]:
    """A host's relay's step before it hands event ``raw`` (as stored) to its host's listeners:
    where it is a loss report, answer it for ``ranks`` (the host's ranks whose listeners run) in
    one append and one add for the host (:func:`answer`), and return the event marked with them
    (:data:`RELAY_ANSWERED`) and the report's generation; else ``raw`` and None.

    ``answered``: the ranks this relay answered each generation's report for already (a second
    report of a generation: another ``alive=``, or one naming everyone after one naming a rank).
    They are marked, not answered again: the decider reads the answers' count against the
    check-ins, and a count above the live ranks holds its decision back (a listener answers each
    generation once for the same reason)."""
    if not ranks:
        return raw, None
    event = json.loads(raw)
    if event.get("k") != "loss":
        return raw, None
    generation, listed = int(event["g"]), sorted(ranks)
    before = set((answered or {}).get(generation, ()))
    fresh = [rank for rank in listed if rank not in before]
    if fresh and not answer(store, generation, fresh):
        return raw, None  # released already: each listener finds that out, as without a relay
    event[RELAY_ANSWERED] = listed
    return json.dumps(event).encode(), generation


def gone_peers(peers: Mapping[int, tuple[int, int]], rank: int,
               members: Collection[int]) -> list[int]:
    """The ``members`` among a host's ``peers`` (rank -> process, :func:`~commgroups.rank_loss.
    local_peers.parse_peers`), ``rank`` aside, whose process is gone (``/proc``), ascending."""
    return sorted(peer for peer, (pid, start) in peers.items()
                  if peer != rank and peer in members and gone(pid, start))


def confirm_local_deaths(store: Store, generation: int, rank: int, members: Collection[int],
                         host: str, peers: Mapping[int, tuple[int, int]] | None = None
                         ) -> list[int]:
    """Add the ``members`` on this host (``host``: :class:`~commgroups.rank_loss.local_peers.
    ProcessId`'s) whose process is gone to generation ``generation``'s confirmed dead (one read of
    the host's key, and one append where one is gone); returns them. ``peers``: the host's key
    as read before (:func:`~commgroups.rank_loss.local_peers.parse_peers`), not read again."""
    if peers is None:
        value = read_if_present(store, host_key(host))
        if value is None:
            return []
        peers = parse_peers(value)
    dead = gone_peers(peers, rank, members)
    note_dead(store, generation, dead)
    return dead


def note_dead(store: Store, generation: int, ranks: Collection[int]) -> None:
    """Add ``ranks`` to generation ``generation``'s confirmed dead (one append; none where
    ``ranks`` is empty), the list :meth:`Liveness.confirmed_dead` reads."""
    if ranks:
        append_numbers(store, f"lost/{generation}/dead", sorted(ranks))


def answered(store: Store, generation: int, ranks: Collection[int]) -> set[int]:
    """Which of ``ranks`` answered generation ``generation``'s loss report (:func:`answer`)."""
    return set(read_numbers(store, f"lost/{generation}/here")) & set(ranks)


def _suspects(token: str) -> set[int] | None:
    """A report's suspects (``"1,5"``; ``"*"``: everyone, None)."""
    if token == "*":
        return None
    return set(parse_numbers(token))



class Liveness:
    """The listening thread of one registry on one rank; see the module docstring.

    Args:
        client: the listener's own store connection (:func:`own_connection`), or a callable that
            makes it: the listener's thread then connects (off ``create()``'s path).
        shared: the job's store as the main thread uses it (the default group's).
        namespace: a key prefix the same on every rank of the registry, and no other registry's.
        rank: this rank's global rank.
        interval_s: seconds between backstop beats (and between the wait's renewals).
        dead_after_s: how long a check-in waits for a rank's answer to a loss report before it
            counts that rank as dead (:meth:`answered`).
        on_loss: called from the thread when a loss is reported (:data:`OnLoss`).
        process: this rank's process as its host-local peers can check it
            (:func:`~commgroups.rank_loss.local_peers.this_process`); published once, and used to
            confirm local peers' deaths at once. None: neither (deaths wait ``dead_after_s``).
        relay: hear events through the host's relay (:mod:`~commgroups.rank_loss.host_relay`;
            this rank is it where it published first on its host): needs ``process`` and a
            ``client`` callable (the relay's forwarder makes a connection of its own).
    """

    def __init__(self, client: Store | Callable[[], Store], shared: Store, namespace: str,
                 rank: int, *, interval_s: float, dead_after_s: float, on_loss: OnLoss,
                 process: ProcessId | None = None, relay: bool = False) -> None:
        self._namespace = namespace
        self._connect = None if isinstance(client, Store) else client
        # Until the listener's thread connected: the listener alone uses it, and only after.
        self._own = PrefixStore(namespace, client if isinstance(client, Store) else shared)
        self._shared = PrefixStore(namespace, shared)
        self._root = shared
        self.rank = rank
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.report_after_s = max(10 * dead_after_s, 3 * interval_s)
        self._on_loss = on_loss
        self._lock = threading.Lock()  # guards the watch state below
        self._watched: tuple[int, int | None] | None = None  # generation, the member watched
        self._members: frozenset[int] = frozenset()  # the watched generation's
        self._process = process
        # This host's processes, read once at the first periodic beat (learn_host): a loss
        # then costs no read of the host's key.
        self._host_peers: dict[int, tuple[int, int]] | None = None
        self._interrupted: dict[int, set[int] | None] = {}  # generation -> suspects handled
        self._answered: set[int] = set()  # generations whose loss report this rank answered
        # As this rank's host relay: generation -> the ranks it answered that report for (the
        # forwarder's thread only).
        self._relay_answered: dict[int, set[int]] = {}
        self._seen: tuple[int, int, float] | None = None  # successor, its beat, when it moved
        self._subscribers: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._decisions: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._kept_events: list[int] = []  # loss events a release could not delete yet
        self._known: set[int] = set()  # events this rank knows already: not read (known())
        self._next = 1
        self._stop = threading.Event()
        self._beating = threading.Lock()  # held by a beat under way: close() waits it out
        # Made by start_listener(): a Liveness that never starts (the benchmark's virtual ranks,
        # which share one listener) costs no thread objects (0.8 s per 16,384 ranks).
        self._listener: threading.Thread | None = None
        self._announced = threading.Event()  # the beat thread's first beat was sent
        self._listened = threading.Event()  # the listener's thread ended
        self._relay_wanted = relay and process is not None and self._connect is not None
        self._relay: HostRelay | None = None  # this rank's, where it relays for its host
        self.relayed = False
        """Whether the listener hears events through the host's relay now (not the store)."""
        self._relay_address: str | None = None  # the host's relay's, once this rank read it
        # The host's relay's rank and process, where it is another rank's (report_if_gone).
        self._relay_process: tuple[int, tuple[int, int]] | None = None
        self._feed: RelayFeed | None = None  # the listener's feed from the relay, while it hears it
        self._exit_finalizer: multiprocessing.util.Finalize | None = None  # see _settle_at_exit
        self._dying = False  # this process ends of an unhandled exception (_settle): no goodbye
        # prepare_relay()'s answer, the address the listener joins (None inside: no relay);
        # None: not prepared, the listener reads the host's key itself
        self._prepared: tuple[str | None] | None = None
        self._rejoin_at = 0.0  # on the store, try the relay again after an event from then on
        self.rejoin_after_s = REJOIN_AFTER_S
        # Periodic tasks the beat's thread runs besides the beat (every()): name -> period,
        # task, when next due. _wake ends the thread's wait early: a task added, or a stop.
        self._tasks: dict[str, tuple[float, Callable[[], object], float]] = {}
        self._wake = threading.Event()

    def start(self) -> None:
        """:meth:`anchor`, :meth:`publish_process`, then :meth:`start_threads`."""
        self.anchor()
        self.publish_process()
        self.start_threads()

    def anchor(self) -> None:
        """Read the next event's number: an event emitted after this call is heard, however
        late the threads start and the listener connects (it waits for that number). One store
        round trip; an event emitted before it is the caller's to catch up on (the registry's
        starter: :meth:`watch` reads the generation's loss report)."""
        self._next = int(self._shared.add("event/count", 0)) + 1

    def start_threads(self) -> None:
        """Start the listener's thread (:meth:`start_listener`) and a thread that runs
        :meth:`run_beats`, after :meth:`anchor`."""
        self.start_listener()
        beat = threading.Thread(target=self.run_beats, name=f"commgroups-beat-{self.rank}",
                                daemon=True)
        beat.start()

    def start_listener(self) -> None:
        """Start the listener's thread (its own connection; the host's relay where this rank
        is it, unless :meth:`prepare_relay` started it; then the relay's feed), after
        :meth:`anchor`; the beat is left to the caller (:meth:`run_beats`, on a thread of its
        own)."""
        self._settle_at_exit(True)  # undone when the listener ends
        # A forked child (a DataLoader worker) holding the relay's sockets would hide this
        # process's death from its host's relay (or from the relay's feeds) until it exits.
        detach_on_fork(self, Liveness.relay_sockets)
        self._listener = threading.Thread(target=self._connect_and_listen,
                                          name=f"commgroups-listen-{self.rank}", daemon=True)
        self._listener.start()

    def announced(self, timeout_s: float | None = None) -> bool:
        """Wait until the first beat was sent (or tried), by :meth:`run_beats`; True once it
        was."""
        return self._announced.wait(timeout_s)

    def _settle_at_exit(self, wanted: bool) -> None:
        """Have :meth:`_settle` run as this process ends normally, or no longer: through
        ``atexit``, and through multiprocessing's exit finalizers, which a process it forked or
        forkserved runs before its ``os._exit`` where ``atexit`` hooks never run. Either way the
        listener's socket to its host's relay then closes with its goodbye: an end of a rank
        that did not close its registry is no loss to its host's relay, as long as it ended
        through Python (``test_host_relay_world``: a rank's function that returned)."""
        if wanted:
            atexit.register(self._settle)
            self._exit_finalizer = multiprocessing.util.Finalize(
                None, self._settle, exitpriority=0)
        else:
            atexit.unregister(self._settle)
            finalizer, self._exit_finalizer = self._exit_finalizer, None
            if finalizer is not None:
                finalizer.cancel()

    def _settle(self) -> None:
        """At interpreter exit, before daemon threads are frozen: let the listener end first.

        A listener (or this host's relay's forwarder) that wakes during finalization (the last
        member's close event, arriving after this rank closed) re-enters Python from torch's
        C++ wait, whose thread then exits
        through C++ frames: "terminate called without an active exception", SIGABRT, a job
        that finished marked failed (seen under torchrun, torch 2.13). Usually the close event
        has come and this returns at once; else it waits up to 2 s for it, then wakes the
        listeners itself (one read each).

        A process dying of an unhandled exception (``sys.last_value`` set: Python's top level
        printed it) says no goodbye to its host's relay, nor its relay ``left``/``bye``: its end
        is a loss, which its host reports at once (a rank that crashed in a step, under
        torchrun); a normal end, with or without ``close()``, is none."""
        listener = self._listener
        if listener is None:  # registered by start_listener() just before it makes the thread
            return
        self._settle_at_exit(False)  # once: atexit's run and multiprocessing's would both come
        self._dying = getattr(sys, "last_value", None) is not None
        self._halt()
        relay = self._relay
        if relay is not None:  # this process ends: its host's listeners go back to the store
            relay.close(dying=self._dying)
        listener.join(timeout=2.0)
        if listener.is_alive() or (relay is not None and not relay.done.is_set()):
            with contextlib.suppress(RuntimeError):  # the store's host is gone: nothing wakes
                self._emit(self._shared, {"k": "wake"})
            listener.join(timeout=2.0)
            if relay is not None:
                relay.done.wait(timeout=2.0)

    def _connect_and_listen(self) -> None:
        """The listener's thread: the host's relay, or else its own connection, then
        :meth:`_listen`. A connection costs the store's host a round trip or two (1-10 ms on
        loaded cores): not on ``create()``'s path."""
        try:
            self._connect_and_listen_until_stopped()
        finally:
            self._listened.set()

    def _connect_and_listen_until_stopped(self) -> None:
        # The host's relay listens first where prepare_relay() ran (the registry's starter),
        # then the listener makes its own connection, then joins the relay. Its own connection
        # before the feed, even where it hears the relay: the relay's death is a loss its
        # host's ranks must answer within dead_after_s, and 8 ranks' listeners connecting as
        # their relay died stalled (a rank alive was decided dead). It costs the store a
        # connection per rank.
        prepared = self._prepared
        if not self._connect_own():
            relay = self._relay
            if relay is not None:
                relay.close()
            self._settle_at_exit(False)
            return
        # Never on the job's shared connection from this thread: the main thread may hold it in
        # a blocking wait (a rebuild's check-in) that needs this listener's answer.
        address = prepared[0] if prepared is not None else self._start_relay(self._own)
        feed = self._join_relay(address)
        try:
            self._listen(feed)
        finally:  # its connection goes with the thread, not with the registry's last reference
            if self._connect is not None:
                self._own = PrefixStore(self._namespace, self._root)
            self._listened.set()
            self._unsettle()

    def _connect_own(self) -> bool:
        """Make the listener's own connection (where it was given a callable that makes it);
        False where the store's host is gone (said at warning level: nothing to listen to)."""
        if self._connect is None:
            return True
        try:
            self._own = PrefixStore(self._namespace, self._connect())
        except Exception as error:
            if not self._stop.is_set():
                logger.warning("rank %d: liveness cannot listen, no store connection: %s",
                               self.rank, error)
            return False
        return True

    def _unsettle(self) -> None:
        """Nothing is left to settle at exit once the listener ended and this rank's relay
        stopped forwarding (each thread calls this as it ends): the registry may go."""
        relay = self._relay
        if self._listened.is_set() and (relay is None or relay.done.is_set()):
            self._settle_at_exit(False)

    def prepare_relay(self) -> None:
        """Before :meth:`start_listener`, where nothing else waits on the job's shared
        connection (the registry's starter, whose start-up every verb waits for): read the
        host's key on it and start the host's relay where this rank is it, so that the relay
        listens before this rank's listener makes its own connection (seconds now and then
        here: the host's ranks, which try the relay for ``CONNECT_WITHIN_S``, gave up on it
        and waited on the store until an event). Without this call the listener does both on
        its own connection, once made."""
        self._prepared = (self._start_relay(self._shared),)

    def _start_relay(self, store: Store) -> str | None:
        """The address of this host's relay (:mod:`~commgroups.rank_loss.host_relay`), started
        here where this rank is it; None where no relay is wanted or known. One read of the
        host's key on ``store``, off ``create()``'s path; the relay's forwarder makes its
        connection on its own thread, so the relay listens at once."""
        if not self._relay_wanted or self._process is None or self._connect is None:
            return None
        try:
            peers = parse_peers(read_if_present(store, host_key(self._process.host)) or "")
            relay = relay_of(peers, self.rank)
            if relay is None:
                return None
            pid, start = peers[relay]
            address = relay_address(self._namespace, self._process.host, relay, pid, start)
            self._relay_address = address
            if relay != self.rank:
                self._relay_process = (relay, (pid, start))
                return address
            if self._stop.is_set():  # the registry closed before its listener started
                return None
            connect, namespace = self._connect, self._namespace
            server = HostRelay(address, lambda: PrefixStore(namespace, connect()), self._next,
                               self._stop.is_set, on_done=self._unsettle,
                               on_feed_lost=self._feed_lost, prepare=self._answer_for_feeds)
            if not server.start():
                return None
            self._relay = server
            if self._stop.is_set():  # closed meanwhile: _halt() did not see it
                server.close()
                return None
            return address
        except Exception as error:  # the store failed: listen on the store
            logger.debug("rank %d: no host relay: %r", self.rank, error)
            return None

    def _join_relay(self, address: str | None) -> RelayFeed | None:
        """The feed from the host's relay at ``address`` (:meth:`_start_relay`); None (the
        listener waits on the store) where there is none or it is not reached."""
        if address is None:
            return None
        feed = RelayFeed.connect(address, stop=self._stop.is_set)
        self.relayed = feed is not None
        return feed

    def relay_sockets(self) -> list[SocketRef]:
        """The sockets of the host's relay this rank holds: its feed, and the relay's own where
        this rank is it. Read in a forked child too (no lock: the threads that held one are
        gone there)."""
        numbers = []
        feed, relay = self._feed, self._relay
        if feed is not None:
            numbers.append(feed.fileno())
        if relay is not None:
            numbers += relay.sockets()
        return [ref for number in numbers if number >= 0 and (ref := socket_ref(number))]

    def _answer_for_feeds(self, store: Store, raw: bytes, pids: Collection[int]) -> bytes:
        """This rank's relay's ``prepare``: a loss report answered for the host's ranks whose
        feeds (processes ``pids``) it heard from lately, and the host's deaths confirmed, once
        for the host (:func:`answer_for_host`; the forwarder's thread and connection)."""
        process = self._process
        if process is None or json.loads(raw).get("k") != "loss":
            return raw
        peers = self._host_peers
        if peers is None or not set(pids) <= {pid for pid, _ in peers.values()}:
            # Before learn_host, or a process that published after it: one read of the host's
            # key, as each answering listener made before learn_host (a rank killed right
            # after create() is confirmed from it).
            peers = parse_peers(read_if_present(store, host_key(process.host)) or "")
        ranks = [rank for rank, (pid, _) in peers.items() if pid in pids]
        handed, generation = answer_for_host(store, raw, ranks, self._relay_answered)
        if generation is not None:
            self._relay_answered.setdefault(generation, set()).update(ranks)
            for old in [g for g in self._relay_answered if g < generation - 1]:
                del self._relay_answered[old]  # reports come for the watched generation only
            # Every rank of the host, not only this rank's generation's members (it may have
            # left the job and relay on): the decider keeps those it waits for.
            confirm_local_deaths(store, generation, self.rank, peers.keys(), process.host,
                                 peers)
        return handed

    def _feed_lost(self, pid: int, dying: bool) -> None:
        """The host's relay (this rank) lost a feed without its goodbye: the process ``pid``
        may have died (``dying``: it said it is ending). Its own thread (the relay's
        ``on_feed_lost``)."""
        if pid == os.getpid():
            return  # this process's own listener: it is closing, or this process is ending
        peers = self._host_peers
        if peers is None or all(process[0] != pid for process in peers.values()):
            with contextlib.suppress(Exception):  # the store's host is gone: nothing to say
                self.learn_host()
            peers = self._host_peers or {}
        for rank, process in peers.items():
            if process[0] == pid:
                self.report_if_gone(rank, process, "its host's relay lost its feed", dying)

    def report_if_gone(self, rank: int, process: tuple[int, int], why: str,
                       dying: bool = False) -> bool:
        """Report ``rank`` lost in the watched generation where it is a member and its process
        (pid, start time) leaves ``/proc`` within :data:`GONE_WITHIN_S` (``dying``: it said it
        is ending of an unhandled exception: reported at once, looked for after), and add it to
        the generation's confirmed dead once gone; True if it was seen gone (``dying``: said
        so). Blocks (up to that long, plus the requests on the job's shared connection): call it
        from a thread of its own.

        The death is confirmed even where no report goes out (this rank heard one of the
        generation that names everyone, as every ``rebuild()`` without ``alive=`` sends): a rank
        that answered that report while alive and died after would else count as alive in the
        check-in, which would wait for it until its window ends."""
        if not dying and not self._gone_within(process, GONE_WITHIN_S):
            return False
        with self._lock:
            watched, members = self._watched, self._members
        if watched is None or rank not in members or self._stop.is_set():
            return False
        try:
            self.report(watched[0], f"rank {rank}'s process is gone ({why})", {rank})
            if not dying or self._gone_within(process, GONE_WITHIN_S):
                self.confirm_dead(watched[0], [rank])
        except Exception as error:  # the store's host is gone: the job's next call says so
            logger.debug("rank %d: reporting rank %d failed: %r", self.rank, rank, error)
            return False
        return True

    def _gone_within(self, process: tuple[int, int], seconds: float) -> bool:
        """Whether ``process`` (pid, start time) leaves ``/proc`` within ``seconds`` (a look
        every 10 ms; False at once once this Liveness stopped)."""
        deadline = time.monotonic() + seconds
        while not gone(*process):
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            time.sleep(0.01)
        return True

    def publish_process(self) -> None:
        """Say, once, which process this rank is, under its host's key (local_peers): a peer
        on this host can then confirm its death from ``/proc`` at once. One append, before
        ``create()`` returns: a rank that dies any time after is confirmed (from a thread, a
        rank killed at once was not, and its loss waited ``dead_after_s``: the listener's own
        connection can take seconds, and under load even the beat's thread came too late)."""
        if self._process is None:
            return
        with contextlib.suppress(Exception):  # an optimisation only: dead_after_s still judges
            self._shared.append(  # type: ignore[attr-defined,unused-ignore]  # not in some stubs
                host_key(self._process.host), self._process.entry(self.rank))

    def learn_host(self) -> None:
        """Read, once, which processes publish under this host's key (one request; the beat's
        thread does it at its first periodic beat, once the host's ranks published: each does
        before ``create()`` returns). A loss report is then answered with the deaths on this
        host confirmed from ``/proc`` against what was read here, without reading the key again
        (at 65,536 ranks, one request per rank fewer before a rebuild's decision). A rank whose
        process published after this read is not known here: its death is confirmed by a peer
        that read later, or judged by ``dead_after_s``, as without this. A rank's process does
        not change while its registry lives (a lost rank is never replaced within it). Kept only
        where this rank's own entry is in it; else the next beat reads it again."""
        if self._process is None:
            return
        value = read_if_present(self._shared, host_key(self._process.host))
        peers = parse_peers(value or "")
        if self.rank in peers:  # else its own entry had not landed: a loss reads the key then
            self._host_peers = peers

    def watch(self, generation: int | None, members: Sequence[int] = ()) -> None:
        """Listen for losses in ``generation`` and watch its next member; None: beat only.

        A loss reported in ``generation`` before this call (before this rank listened) is
        handled now: the report's counter is state, the event only its wake-up."""
        ring = list(members)
        successor = (ring[(ring.index(self.rank) + 1) % len(ring)]
                     if self.rank in ring and len(ring) > 1 else None)
        with self._lock:
            self._watched = None if generation is None else (generation, successor)
            self._members = frozenset(ring)
            self._seen = None
        if generation is not None and int(self._shared.add(f"lost/{generation}", 0)) > 0:
            self._answer(generation, self._shared)
            self._handle_loss(generation, self._read_suspects(generation, self._shared))

    def local_deaths(self) -> list[int]:
        """The members of the watched generation on this host whose process is gone, from
        ``/proc`` against the host's key (read once here where :meth:`learn_host` has not
        yet: one request); empty where this rank has no process entry."""
        if self._host_peers is None and self._process is not None:
            with contextlib.suppress(Exception):  # the store's host is gone: nothing to say
                self.learn_host()
        peers = self._host_peers
        with self._lock:
            members = self._members
        return [] if peers is None else gone_peers(peers, self.rank, members)

    def heard(self, generation: int) -> bool:
        """Whether this rank heard a loss report of ``generation`` (its own included). Local."""
        with self._lock:
            return generation in self._interrupted

    def report(self, generation: int, reason: str,
               suspects: Collection[int] | None = None) -> bool:
        """Report a loss in ``generation`` to every rank; True if it was the first report.

        ``suspects``: the ranks that take no further part in ``generation`` (a rank that calls
        ``rebuild()`` names those missing from its ``alive=``, never itself); None: unknown,
        every group is interrupted.
        The reason goes to this rank's log. Nothing is sent where this rank already heard a
        report of ``generation`` that covers ``suspects`` (every rank heard it: at 65,536 ranks
        each survivor's own report would cost the store four requests for nothing)."""
        with self._lock:
            heard = generation in self._interrupted
            done = self._interrupted.get(generation, set())
        if heard and (done is None or (suspects is not None and set(suspects) <= done)):
            return False
        return self._report(self._shared, generation, reason, suspects)

    def _report(self, store: Store, generation: int, reason: str,
                suspects: Collection[int] | None) -> bool:
        token = "*" if suspects is None else ",".join(str(r) for r in sorted(suspects))
        # One event per distinct report, not per reporter: every survivor of a loss reports it,
        # and each event costs every listener a read.
        # The first report claims the key; a later one with other suspects appends and wakes
        # the listeners again (a rank that calls rebuild() before it heard the first, with
        # another alive= list). Every event is released with the generation (release).
        mine = f"{token}@{self.rank};"
        who = bytes(store.compare_set(f"lost/{generation}/who", "", mine)).decode()
        claimed = who == mine
        new = claimed or token not in [part.split("@")[0] for part in who.split(";")]
        if new and not claimed:
            # Store.append: at runtime on 2.10-2.15, missing from some releases' stubs.
            store.append(f"lost/{generation}/who", mine)  # type: ignore[attr-defined,unused-ignore]
        # Answers may come in between the reports: the first is the one that finds no report.
        first = int(store.add(f"lost/{generation}", REPORT)) < 2 * REPORT
        if new:  # the event carries the suspects: no listener reads ``who`` for them
            number = self._emit(store, {"k": "loss", "g": generation, "s": token})
            append_numbers(store, f"lost/{generation}/events", [number])
        if first:
            logger.info("rank %d: reported a loss in generation %d (%s; suspects: %s)",
                        self.rank, generation, reason, token)
        return first

    def emit(self, event: dict[str, Any]) -> int:
        """Wake every rank's thread with ``event`` (two requests, from the calling thread);
        returns its number (see :meth:`forget`)."""
        return self._emit(self._shared, event)

    def forget(self, numbers: Collection[int]) -> None:
        """Delete events ``numbers``, once every listener handled them (a generation later: a
        listener handles events in order, and every member of the next generation is past
        them). One request each."""
        with contextlib.suppress(RuntimeError):  # the store's host is gone
            for number in numbers:
                self._shared.delete_key(f"event/{number}")

    @staticmethod
    def _emit(store: Store, event: dict[str, Any]) -> int:
        number = int(store.add("event/count", 1))
        store.set(f"event/{number}", json.dumps(event))
        return number

    def answered(self, generation: int, ranks: Collection[int]) -> set[int]:
        """Which of ``ranks`` answered the loss report of ``generation`` (alive when they heard
        it). One request (a read of the answers' list), from the calling thread."""
        return answered(self._shared, generation, ranks)

    def confirmed_dead(self, generation: int) -> set[int]:
        """The ranks whose process a peer on their host saw gone since generation
        ``generation``'s loss report (:func:`confirm_local_deaths`): dead for sure."""
        return set(read_numbers(self._shared, f"lost/{generation}/dead"))

    def confirm_dead(self, generation: int, ranks: Collection[int]) -> None:
        """Add ``ranks``, whose process this rank saw gone, to generation ``generation``'s
        confirmed dead (:meth:`confirmed_dead`): one append, from the calling thread."""
        note_dead(self._shared, generation, ranks)

    def answers(self, generation: int) -> int:
        """How many answers generation ``generation``'s loss report got so far (one request)."""
        return int(self._shared.add(f"lost/{generation}", 0)) % REPORT

    def every(self, name: str, period_s: float, task: Callable[[], object] | None) -> None:
        """Run ``task()`` every ``period_s`` from the beat's thread (:meth:`run_beats`), the first
        time ``period_s`` from now; None: stop running ``name``'s task. A task that raises is
        logged and kept. The flight publisher's periodic look at its status runs here: one
        thread fewer per rank than a thread of its own (a start that every rank pays as it
        ends its groups)."""
        with self._lock:
            if task is None:
                self._tasks.pop(name, None)
            else:
                self._tasks[name] = (period_s, task, time.monotonic() + period_s)
        self._wake.set()

    def _halt(self) -> None:
        """Stop the threads' loops: the listener's at its next event (at once where it hears
        the host's relay), the beat's at once. This rank's relay goes on for its host's ranks
        still listening (:class:`~commgroups.rank_loss.host_relay.HostRelay`), which it tells
        at once that this rank left (its process's end is then no loss)."""
        self._stop.set()
        self._wake.set()
        relay = self._relay
        if relay is not None and not self._dying:
            relay.leave()

    def subscribe(self, prefix: str, handler: Callable[[dict[str, Any]], None] | None) -> None:
        """Call ``handler(event)`` from the thread on each ``ask`` event for ``prefix`` (None:
        stop); the event carries the ask's fields (role, asker, number) as the asker sent them."""
        if handler is None:
            self._subscribers.pop(prefix, None)
        else:
            self._subscribers[prefix] = handler

    def expect(self, prefix: str, handler: Callable[[dict[str, Any]], None] | None) -> None:
        """Call ``handler(event)`` from the thread on a ``decided`` event for ``prefix`` (a
        check-in's decision, pushed: no rank polls or blocks a connection for it); None: stop."""
        if handler is None:
            self._decisions.pop(prefix, None)
        else:
            self._decisions[prefix] = handler

    def known(self, number: int) -> None:
        """Event ``number`` needs nothing from this rank, which knows what it says (a group ask
        it joined and answered): the listener takes it without reading it, one request less
        per member of a group of any size. Ignored where the listener is past it."""
        with self._lock:
            if number >= self._next:
                self._known.add(number)

    @property
    def listening(self) -> bool:
        """Whether the listener runs (events reach :meth:`subscribe`'s and :meth:`expect`'s
        handlers)."""
        listener = self._listener
        return listener is not None and listener.is_alive() and not self._stop.is_set()

    def close(self, members: int = 0) -> None:
        """Stop the threads and delete this rank's beat; the last of ``members`` ranks to close
        wakes every listener still waiting and deletes the events. Local, and it waits for
        nobody: no beat runs after it returns, and the threads end on their own.

        The listener ends when its wait returns: at once where every member closes within a
        second (the last one's ``close`` event). Otherwise (a rank dropped, or closing alone)
        the beat's thread wakes the listeners after that second: one read for each of them.
        (``close()`` used to wait for that itself: 75-400 ms of every close, for the last
        member to arrive.)"""
        self._halt()
        with self._beating:  # a beat under way ends first: none re-creates the key deleted here
            pass
        with contextlib.suppress(RuntimeError):  # the store's host is gone
            self._shared.delete_key(f"beat/{self.rank}")
            if members and self._process is not None:  # every member closes: nobody looks now
                self._shared.delete_key(host_key(self._process.host))
            if members and int(self._shared.add("closed", 1)) >= members:
                self._emit(self._shared, {"k": "close"})
                count = int(self._shared.add("event/count", 0))
                # Every member's listener is stopped: none reads these after its wait returns.
                for key in ("closed", "event/count", *(f"event/{n}" for n in range(1, count + 1))):
                    self._shared.delete_key(key)

    def release(self, generation: int, survivors: Sequence[int] | None = None) -> None:
        """Delete ``generation``'s loss report and its answers (call on one rank once per
        generation, after every survivor read it: when the next generation exists).

        Its first event goes too where every one of ``survivors`` answered the report (their
        listeners handle events in order, so each is past it); the first where a survivor has
        not answered yet, and the later ones of the same generation (a report naming other
        ranks: each rank that called ``rebuild()`` before it heard the first), go with the next
        release; without ``survivors`` (``close()``: its own events go with the last member's
        close) they stay. A listener never waits on a deleted event. The later ones stayed
        until the registry closed before: a few keys per rebuild on a loaded machine
        (``test_rebuilds_leak_nothing_over_ten_cycles``, 4 ranks: 4 more over 9 rebuilds)."""
        with contextlib.suppress(RuntimeError):  # the store's host is gone
            # Events kept by the release before: a generation on, every survivor's listener
            # has handled later events (the check-in's pushed decision), so it is past them.
            kept, self._kept_events = self._kept_events, []
            for number in kept:
                self._shared.delete_key(f"event/{number}")
            if not self._shared.check([f"lost/{generation}"]):
                return  # nobody reported a loss in it: nothing was written
            numbers = sorted(read_numbers(self._shared, f"lost/{generation}/events"))
            passed = survivors is not None and len(self.answered(generation, survivors)) == len(
                survivors)
            for key in ("", "/who", "/events", "/here", "/dead"):
                self._shared.delete_key(f"lost/{generation}{key}")
            if numbers and passed:
                # An answer is sent as its listener handles the generation's first event.
                self._shared.delete_key(f"event/{numbers.pop(0)}")
            if survivors is not None:
                # A listener that lagged on loaded cores has not answered: it may not be past
                # the first event yet; nor, answered or not, past the later ones. Deleted by the
                # next release (kept until close() before: one key per such rebuild).
                self._kept_events += numbers

    # ----------------------------------------------------------------------------- the threads
    def _listen(self, feed: RelayFeed | None = None) -> None:
        """The listener: take the next event from ``feed`` (the host's relay) while it works,
        else block on the store for it (no timeout: a timed-out store wait costs a request and
        makes torch print two warnings, every time); handle it, repeat."""
        failures = 0
        self._feed = feed
        while not self._stop.is_set():
            try:
                if feed is not None:
                    if not self._take_relayed(feed):
                        ending = "left" if feed.relay_left else feed.ending
                        feed.close(dying=self._dying)  # stopped as the process ends
                        self._feed = None
                        feed, self.relayed = None, False
                        if self._stop.is_set():
                            break
                        if ending in ("closed", "silent", "died"):  # did it die?
                            self._look_for_the_relay(at_once=ending == "died")
                        logger.debug("rank %d: the host's relay is gone or quiet: listening on "
                                     "the store from event %d", self.rank, self._next)
                        self._rejoin_at = time.monotonic() + self.rejoin_after_s
                    failures = 0
                    continue
                self._own.wait([f"event/{self._next}"], _FOREVER)
                if self._stop.is_set():
                    return
                self.take(self._next)
                self._next += 1
                failures = 0
                feed = self._feed = self._rejoin()
            except Exception as error:  # a store hiccup must not kill the listener
                if self._stop.is_set():
                    return
                failures += 1
                logger.debug("rank %d: liveness listener failed (%d): %s", self.rank, failures,
                             error)
                if failures >= 20:  # the store's host is gone: nothing left to listen to
                    logger.warning("rank %d: liveness stopped, the store is unreachable: %s",
                                   self.rank, error)
                    return
                self._stop.wait(0.5)
        if feed is not None:
            feed.close(dying=self._dying)

    def _look_for_the_relay(self, at_once: bool) -> None:
        """The relay's socket closed or went quiet without its goodbye: on a thread of its own
        (never the listener's, which goes back to the store now), report the relay's rank if
        its process is gone (``at_once``: it said it is dying)."""
        relay = self._relay_process
        if relay is not None:
            threading.Thread(target=self.report_if_gone,
                             args=(relay[0], relay[1], "its relay's socket closed", at_once),
                             name=f"commgroups-relay-gone-{self.rank}", daemon=True).start()

    def _rejoin(self) -> RelayFeed | None:
        """The host's relay's feed again, where this listener is on the store (its relay was
        not up yet when it started, or went quiet) and :attr:`rejoin_after_s` has passed: one
        attempt to connect, on this host (no store request); None otherwise."""
        address = self._relay_address
        now = time.monotonic()
        if address is None or now < self._rejoin_at or self._stop.is_set():
            return None
        self._rejoin_at = now + self.rejoin_after_s
        feed = RelayFeed.connect(address, within_s=0.0)
        if feed is not None:
            logger.debug("rank %d: back on the host's relay from event %d", self.rank,
                         self._next)
            self.relayed = True
        return feed

    def _take_relayed(self, feed: RelayFeed) -> bool:
        """Take the relay's next frame: an event is handled (any this rank missed before it
        first read from the store); the relay's first number (``HELLO``) has any earlier event
        read from the store. False where the feed ended (the caller listens on the store)."""
        got = feed.receive(self._stop.is_set)
        if got is None:
            return False
        number, payload = got
        raw: bytes | None = payload
        if number == HELLO:
            number, raw = int(payload), None
        while self._next < number and not self._stop.is_set():
            self._own.wait([f"event/{self._next}"], _FOREVER)
            self.take(self._next)
            self._next += 1
        if raw is not None and number == self._next:
            self.take(number, raw)
            self._next += 1
        return True

    def run_beats(self) -> None:
        """The backstop beat on the calling thread until :meth:`close`: the first at once (so
        peers see this rank: until it lands a peer reads no beat of this rank, which it never
        reports), then every ``interval_s``, on the shared connection; after :meth:`close`, the
        wake of a listener still waiting a second later. Call after :meth:`start_listener`."""
        failures = 0
        with self._beating:
            if not self._stop.is_set():
                try:
                    self._shared.add(f"beat/{self.rank}", 1)
                except Exception as error:  # a store hiccup: the loop's next beat retries
                    logger.debug("rank %d: first beat failed: %s", self.rank, error)
        self._announced.set()
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            with self._lock:
                due = min([next_beat, *(task[2] for task in self._tasks.values())])
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()  # before the tasks are read: an every() after it wakes the next
            if self._stop.is_set():
                break
            now = time.monotonic()
            self._run_due_tasks(now)
            if now < next_beat:
                continue
            next_beat = now + self.interval_s
            try:
                with self._beating:
                    if self._stop.is_set():
                        break
                    self._beat()
                failures = 0
            except Exception as error:  # a store hiccup must not kill the heartbeat
                failures += 1
                logger.debug("rank %d: beat failed (%d): %s", self.rank, failures, error)
                if failures >= 20:
                    return
        # An event, not Thread.join: join asks threading for the current thread, which on the
        # registry's starter (a bare _thread: it goes on as the beat's) leaves a dummy Thread
        # registered for good (threading.active_count() grew by one a registry).
        # The last member's close event wakes the listener, normally; otherwise a member never
        # closes (dropped), or this rank alone did.
        # This rank's relay, where it serves nobody any more, ends at the next event too.
        relay = self._relay
        if not self._listened.wait(timeout=1.0) or (
                relay is not None and not relay.done.wait(timeout=0.01) and not relay.serving):
            with contextlib.suppress(RuntimeError):
                self._emit(self._shared, {"k": "wake"})

    def _run_due_tasks(self, now: float) -> None:
        """Run the :meth:`every` tasks due by ``now`` (on the beat's thread)."""
        with self._lock:
            due = [(name, task) for name, task in self._tasks.items() if task[2] <= now]
            for name, (period, run, _) in due:
                self._tasks[name] = (period, run, now + period)
        for name, (_, run, _) in due:
            try:
                run()
            except Exception as error:  # the task's own failure: it says what it does about it
                logger.debug("rank %d: periodic task %s failed: %r", self.rank, name, error)

    def take(self, number: int, raw: bytes | None = None) -> None:
        """Read event ``number`` and handle it: the listener's step once its wait returned.
        ``raw``: the event as stored, from the host's relay (not read again)."""
        with self._lock:
            if number in self._known:
                self._known.discard(number)
                return
        if raw is not None:
            self._dispatch(json.loads(raw))
            return
        key = f"event/{number}"
        # One request where get() is two (it waits for the key first). The key exists: the
        # wait returned. Were it missing (a wait woken early), this read would wake every
        # listener waiting on it (torch's libuv server wakes a key's waiters when anyone
        # compare_sets it while missing, 2.13): that rank then blocks in get(), reading no more.
        value = read_if_present(self._own, key)
        self._dispatch(json.loads(value if value is not None else bytes(self._own.get(key))))

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("k")
        if kind == "loss":
            generation = int(event["g"])
            if self.rank in event.get(RELAY_ANSWERED, ()):  # the host's relay answered for it
                with self._lock:
                    self._answered.add(generation)
            else:
                self._answer(generation, self._own)
            token = event.get("s")
            self._handle_loss(generation, self._read_suspects(generation, self._own)
                              if token is None else _suspects(str(token)))
        elif kind == "ask":
            handler = self._subscribers.get(str(event.get("p")))
            if handler is not None:
                handler(event)
        elif kind == "decided":
            decided = self._decisions.get(str(event.get("p")))
            if decided is not None:
                decided(event)
        elif kind == "close":
            self._halt()

    def _answer(self, generation: int, store: Store) -> None:
        """Say this rank is alive, once per generation whose loss it heard of (before the
        interrupt, which may take a while), and confirm the deaths on this host (from what
        :meth:`learn_host` read, once it did)."""
        with self._lock:
            if generation in self._answered:
                return
            self._answered.add(generation)
            members = self._members
        if answer(store, generation, [self.rank]) and self._process is not None:
            confirm_local_deaths(store, generation, self.rank, members, self._process.host,
                                 self._host_peers)

    def _read_suspects(self, generation: int, store: Store) -> set[int] | None:
        value = read_if_present(store, f"lost/{generation}/who")
        if value is None:
            return None  # reported by a version that names nobody: everything
        suspects: set[int] = set()
        for report in value.split(";"):
            named = _suspects(report.split("@")[0])
            if named is None:
                return None
            suspects |= named
        return suspects

    def _handle_loss(self, generation: int, suspects: set[int] | None) -> None:
        with self._lock:
            watched = self._watched
            if watched is None or watched[0] != generation:
                return  # an older generation's report (retired already) or a newer one's
            done = self._interrupted.get(generation, set())
            if done is None or (suspects is not None and suspects <= done):
                return
            self._interrupted[generation] = None if suspects is None else done | suspects
        self._on_loss(generation, None if suspects is None else frozenset(suspects))

    def _beat(self) -> None:
        self._shared.add(f"beat/{self.rank}", 1)
        if self._host_peers is None:  # learn_host sends nothing without a process
            with contextlib.suppress(Exception):  # an optimisation only: a loss reads it then
                self.learn_host()
        with self._lock:
            watched, seen = self._watched, self._seen
        if watched is None:
            return
        generation, successor = watched
        if successor is None:
            return
        if self._interrupted.get(generation, set()) is None:
            return  # everything is interrupted already: the rebuild is under way
        value = read_if_present(self._shared, f"beat/{successor}")
        if value is None:
            return  # closed (deleted its beat), or not yet beating: never reported
        beat, now = int(value), time.monotonic()
        if seen is None or seen[0] != successor or seen[1] != beat:
            with self._lock:
                self._seen = (successor, beat, now)
            return
        if now - seen[2] >= self.report_after_s:
            self._report(self._shared, generation, f"rank {successor} stopped beating for "
                         f"{self.report_after_s:g}s", None)
            with self._lock:
                self._seen = (successor, beat, now)
