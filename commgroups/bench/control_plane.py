"""The control plane at scale: the product's liveness, loss report and check-in for N simulated
ranks (many per process) against one real TCPStore server, with every store request counted.

What runs, per world size N (one fresh key namespace each):

1. **idle**: N real :class:`~commgroups.rank_loss.liveness.Liveness` objects, started (their
   listener blocked on its own connection, their beat every ``interval_s``), for ``idle_s``
   seconds; requests per rank per second. Only up to :data:`IDLE_THREADED_MAX` ranks (two threads
   and one socket each); above it the figure is the measured one carried over, marked
   *extrapolated*: nothing on the idle path depends on N (a listener sends nothing, a beat two
   requests). They run in this process and idle while phases 2 and 3 run in the workers, for
   every size: ten idle seconds need not be ten seconds of the bench (their requests are
   counted on their own connections; the other phases' events are in other namespaces).
2. **loss and check-in**: virtual rank N-1 is lost; its ring predecessor reports a loss
   (:meth:`Liveness.report`) naming nobody, as a stale beat's report and ``rebuild()`` without
   ``alive=`` do. Every other virtual rank runs what its listener and its main thread run
   (without a process: the lost rank's host peers, 7 of N, would each append its death,
   confirmed from what their beat's thread read once): it takes the loss event as its host's
   relay hands it over
   (:mod:`~commgroups.rank_loss.host_relay`: one wait and one read per host of
   :data:`RANKS_PER_HOST`) and answers it (``Liveness.take``, the listener's own code),
   checks in, as ``Recovery.rebuild`` does
   (:func:`~commgroups.rank_loss.check_in.check_in_at_open_attempt`: attempt 0, which nobody
   closed; :meth:`CheckIn.join`, whose first rank in also reads the made-generation key) and
   waits for the decision
   (:meth:`CheckIn.await_decision`); the first rank in decides (:meth:`CheckIn.look`, in its
   own thread). Reported: requests per rank, store bytes, and
   report -> decided.
3. **hang**: the N ranks are one role's group, in a collective that timed out on every member
   but one, which hung (it never answers; it published a status before). Every other member
   runs the product's diagnosis path of a timed-out call, as its timeout fires: it joins the
   group ask and answers (:meth:`StatusPublisher.ask_group`); the first to join asks, waits for
   the answers (:func:`~commgroups.flight_recorder.publisher.collect`, with the session's waits
   for a timeout at the default 1 s interval), diagnoses
   (:func:`~commgroups.flight_recorder.diagnosis.diagnose`) and shares the diagnosis
   (:meth:`StatusPublisher.share`); meanwhile every member's listener (``Liveness.take``) takes,
   through its host's relay, the ask (its real :class:`StatusPublisher` answers it where the
   member had not joined yet) and then the diagnosis, which each member raises
   (:meth:`~commgroups.flight_recorder.diagnosis.Diagnosis.from_share`). Reported: requests
   per member (every member's and the asker's, over N), and seconds from the timeout to the
   hung rank named silent by the asker and to the diagnosis read by every member: named within
   the role timeout plus that.

What 2 cores cannot run honestly: N sockets (the virtual ranks of a process share one
connection, one blocked wait per process stands for every host relay's, and an in-process
hand-over for each relay's local socket, which costs the store nothing) and N clients' CPUs (here
the workers share 2 cores with the store's server, so the measured time is the clients' time).
The *extrapolated* decision time is the requests the decision needs divided by the rate the
store served when saturated in the same run (its server is one thread: that rate, not the
number of clients, bounds a real job).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from commgroups.bench.progress import Progress
from commgroups.bench.stats import Table, number
from commgroups.flight_recorder.diagnosis import Diagnosis, diagnose
from commgroups.flight_recorder.publisher import (
    ANSWER_QUIET_S,
    DEFAULT_INTERVAL_S,
    StatusPublisher,
    answer_waits,
    collect,
)
from commgroups.rank_loss.check_in import CheckIn
from commgroups.rank_loss.liveness import Liveness, answer_for_host
from commgroups.rank_loss.local_peers import this_process
from commgroups.util.store_reads import read_bytes_if_present

__all__ = ["IDLE_THREADED_MAX", "CountingStore", "run"]

logger = logging.getLogger(__name__)

IDLE_THREADED_MAX = 1024
"""The largest world whose idle phase runs one real listener and beat per rank (2 threads and a
socket each: 2,048 threads on 2 cores)."""

_WORKERS = 4
RANKS_PER_HOST = 8
"""Virtual ranks per host (8 GPUs a node: NVIDIA's HGX, Ascend's 8-NPU servers): each host's
relay (:mod:`~commgroups.rank_loss.host_relay`) waits for and reads each event once for them."""
_BEAT_S = 10.0  # the product's default heartbeat (registry heartbeat_s)
_DEAD_AFTER_S = 1.0
_WINDOW_S = 120.0
_HANG_ROLE = "dp"
_HANG_TIMEOUT_S = 10.0  # the hang's role timeout (the ask comes when it fires; not waited out)
_HANG_GOAL_S = 2.0  # named within the role timeout plus this
_HANG_COUNT = 7  # the group's collective count every live member reached (the hung one: 6)


class CountingStore(Store):  # type: ignore[misc]  # torch's Store has no stubs for subclassing
    """A store that forwards to ``inner`` and counts the requests and bytes it sends.

    ``get`` counts two requests (torch's client waits for the key, then reads it), every other
    call one; bytes are keys plus values each way (the protocol's framing is left out)."""

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner = inner
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def _count(self, requests: int, size: int) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += size

    def set(self, key: str, value: str) -> None:
        self._count(1, len(key) + len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value: bytes = self.inner.get(key)
        self._count(2, 2 * len(key) + len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._count(1, len(key) + 8)
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value: bytes = self.inner.compare_set(key, expected, desired)
        self._count(1, len(key) + len(expected) + len(desired) + len(value))
        return value

    def append(self, key: str, value: str) -> None:
        self._count(1, len(key) + len(value))
        self.inner.append(key, value)  # type: ignore[attr-defined,unused-ignore]  # stubs vary

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values: list[bytes] = self.inner.multi_get(keys)
        self._count(2, 2 * sum(map(len, keys)) + sum(map(len, values)))  # a wait, then a read
        return values

    def delete_key(self, key: str) -> bool:
        self._count(1, len(key))
        return bool(self.inner.delete_key(key))

    def check(self, keys: list[str]) -> bool:
        self._count(1, sum(map(len, keys)))
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count(1, sum(map(len, keys)))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)


def _client(port: int) -> CountingStore:
    return CountingStore(TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=300)))


def _no_loss(generation: int, suspects: frozenset[int] | None) -> None:
    """The virtual ranks hold no groups: nothing to interrupt."""


class _IdleRanks:
    """``members`` real, started :class:`Liveness` objects (a connection and two threads each)
    in this process, their requests counted over a window of ``idle_s``.

    :meth:`start` sets them up and opens the window; the loss and hang phases run in the
    workers meanwhile (a window of idle ranks is seconds of waiting on 2 cores; their requests
    are counted on their own connections, and their namespace's events are theirs alone);
    :meth:`finish` waits for the window's end, counts and closes them."""

    def __init__(self, port: int, members: int, idle_s: float) -> None:
        self.members, self.idle_s = members, idle_s
        self.shared = _client(port)
        # In parallel: a connection now and then stalls for 5 s on this machine (torch's client).
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            self.owns = list(pool.map(lambda _: _client(port), range(members)))
        process = this_process()  # every rank publishes it, as each real rank does its own
        self.lives = [Liveness(own, self.shared, f"bench/idle/{members}/", rank,
                               interval_s=_BEAT_S, dead_after_s=_DEAD_AFTER_S, on_loss=_no_loss,
                               process=process)
                      for rank, own in enumerate(self.owns)]
        self.before = self.after = 0
        # Counts at the window's end, whatever the workers are doing then.
        self._window = threading.Timer(idle_s, self._count_window)

    def _requests(self) -> int:
        return self.shared.requests + sum(own.requests for own in self.owns)

    def _count_window(self) -> None:
        self.after = self._requests()

    def start(self) -> None:
        """Start every rank and open the window once each sent its first beat and listens (their
        threads' first requests are not idle ones)."""
        for rank, live in enumerate(self.lives):
            live.start()
            live.watch(0, _ring(rank, self.members))
        for live in self.lives:
            live.announced(60.0)
            # Once per rank, at its first periodic beat: not idle traffic (steady state here).
            live.learn_host()
        time.sleep(0.1)  # the listeners' first waits, sent as their threads start
        self.before = self._requests()
        self._window.start()

    def finish(self) -> float:
        """Requests per rank per second over the window (waited out first); closes the ranks."""
        self._window.join()
        self.close()
        return (self.after - self.before) / self.members / self.idle_s

    def close(self) -> None:
        """Close every rank (again: nothing)."""
        self._window.cancel()  # where a phase failed before the window ended
        lives, self.lives = self.lives, []
        for live in lives:
            live.close(self.members)  # the last closer of the world wakes every listener


class _VirtualListener(Liveness):
    """A virtual rank's Liveness whose listener is the worker's: it handles each event through
    :meth:`Liveness.take` for every virtual rank, after one blocked wait per process."""

    @property
    def listening(self) -> bool:
        return True


def _take_through_relays(lives: Iterable[Liveness], number: int, store: Store) -> int:
    """Every virtual rank takes event ``number`` as its host's relay hands it over: the relay's
    forwarder reads it once per host of :data:`RANKS_PER_HOST` (on ``store``, under the
    registry's namespace) and answers a loss report for the host's ranks in one append and one
    add (:func:`~commgroups.rank_loss.liveness.answer_for_host`, as the relay's ``prepare``
    does for the feeds it heard from lately: here every rank's); no rank reads it (the
    in-process hand-over stands for the relay's local socket, which costs the store nothing).
    Returns the hosts: each host's forwarder also waited once for it (one wait per process
    stood for theirs)."""
    hosts: dict[int, list[Liveness]] = {}
    for live in lives:
        hosts.setdefault(live.rank // RANKS_PER_HOST, []).append(live)
    for ranks in hosts.values():
        raw = read_bytes_if_present(store, f"event/{number}")
        if raw is None:
            raise RuntimeError(f"event {number} is missing")
        handed, _ = answer_for_host(store, raw, [live.rank for live in ranks])
        for live in ranks:
            live.take(number, handed)
    return len(hosts)


def _loss(port: int, namespace: str, ranks: Sequence[int], members: int, victim: int,
          start: Any, ready: Any) -> dict[str, Any]:
    """The virtual ranks ``ranks`` hear the loss, answer, check in and wait for the decision."""
    shared = _client(port)
    every = frozenset(range(members))  # shared by every CheckIn (frozenset() of it is itself)
    # No process: a real rank learned its host's processes once (Liveness.learn_host, at its
    # first periodic beat) and confirms their deaths from /proc with no request; here no
    # virtual rank shares the lost one's host, so it would append nothing. The same requests
    # as each learning it here, without 65,536 reads of setup (5 s of the bench).
    lives = {rank: _VirtualListener(shared, shared, namespace, rank, interval_s=_BEAT_S,
                                    dead_after_s=_DEAD_AFTER_S, on_loss=_no_loss)
             for rank in ranks if rank != victim}
    for rank, live in lives.items():
        live.watch(0, _ring(rank, members))
    listener = _client(port)  # referenced: a PrefixStore keeps only the C++ half alive
    events = PrefixStore(namespace, listener)
    loss_event = int(events.add("event/count", 0)) + 1
    ready.wait()
    start.wait()
    events.wait([f"event/{loss_event}"], timedelta(seconds=_WINDOW_S))
    heard = time.monotonic()
    before = shared.requests
    decided_at: list[float] = []
    checks: list[CheckIn] = []
    deciders: list[threading.Thread] = []
    keys = PrefixStore(namespace, shared)
    hosts = _take_through_relays(lives.values(), loss_event, keys)  # answer, then interrupt
    for rank, live in lives.items():
        # As Recovery.rebuild (check_in_at_open_attempt): attempt 0, which no rank closed here
        # (a rank that closed one reads the open attempt first), with the key a rank a
        # generation late learns it is out from (the first rank in reads it).
        check = CheckIn(shared, f"{namespace}check/0/", rank, every,
                        timedelta(seconds=_WINDOW_S), None, live, f"{namespace}made", 0)
        if check.join():
            decider = threading.Thread(target=_decide, args=(check, decided_at), daemon=True)
            decider.start()
            deciders.append(decider)
        checks.append(check)
    joined = time.monotonic()
    to_decide = shared.requests - before
    events.wait([f"event/{loss_event + 1}"], timedelta(seconds=_WINDOW_S))  # the decision
    _take_through_relays(lives.values(), loss_event + 1, keys)
    outs = {check.await_decision() for check in checks}
    if len(outs) != 1:
        raise AssertionError(f"virtual ranks were told different decisions: {len(outs)}")
    # Each rank's outcome() sorts the survivors (milliseconds at 65,536 on its own CPU): once
    # per process here, where thousands of virtual ranks share one.
    survivors = checks[0].outcome(next(iter(outs)))
    for decider in deciders:  # its followers may hear the decision before it notes the time
        decider.join(timeout=_WINDOW_S)
    waits = 2 * hosts  # each host's relay waits once per event (one wait stood for all)
    return {"requests": shared.requests - before + waits, "to_decide": to_decide + hosts,
            "bytes": shared.bytes, "heard": heard, "joined": joined,
            "decided": decided_at[0] if decided_at else None, "survivors": len(survivors)}


def _member_status(count: int, state: str) -> dict[str, Any]:
    """A member's status on the hang's role (what ``RoleRecorder.status`` gives)."""
    return {"seq": count, "group_seq": count,
            "last": {"op": "all_reduce", "seq": count, "group_seq": count,
                     "caller": "train.py:42 in step", "state": state}}


_HANG_FAILED = {"op": "all_reduce", "seq": _HANG_COUNT, "group_seq": _HANG_COUNT,
                "caller": "train.py:42 in step"}


def _hang(port: int, namespace: str, ranks: Sequence[int], members: int, hung: int,
          start: Any, ready: Any) -> dict[str, Any]:
    """The virtual members ``ranks`` of one role's group, every one but the hung one timed out
    in the same call: each joins the group ask on its main thread (``ask_group``, the
    session's first step), the first asks, collects, diagnoses and shares (a thread of its
    own, with a connection of its own, as its process would), while the listener (another
    thread and connection, one standing for every virtual rank's) takes the ask and the
    shared diagnosis. The hung one never answers: it published a status before."""
    shared, own, asker_store = _client(port), _client(port), _client(port)
    prefix = f"{namespace}flight/"
    group = range(members)  # membership in O(1): a list of N per virtual rank would be O(N^2)
    reached = {"status": {_HANG_ROLE: _member_status(_HANG_COUNT, "failed")}}

    def answer(role: str, asker: int) -> dict[str, Any] | None:
        return reached if role == _HANG_ROLE and asker in group else None

    lives: list[Liveness] = []
    publishers: list[StatusPublisher] = []
    for rank in ranks:
        if rank == hung:
            last = {_HANG_ROLE: _member_status(_HANG_COUNT - 1, "done")}
            StatusPublisher(shared, prefix, rank, last.copy).publish_now()
            continue
        live = _VirtualListener(own, shared, namespace, rank, interval_s=_BEAT_S,
                                dead_after_s=_DEAD_AFTER_S, on_loss=_no_loss)
        publisher = StatusPublisher(shared, prefix, rank, dict, DEFAULT_INTERVAL_S,
                                    answer=answer)
        # its handler answers the ask; known(): a member that learned the ask's number as it
        # joined takes that event without reading it
        publisher.listen_through(live.emit, live.subscribe, known=live.known)
        lives.append(live)
        publishers.append(publisher)
    events_client = _client(port)  # referenced: a PrefixStore keeps only the C++ half alive
    events = PrefixStore(namespace, events_client)
    ask_event = int(events.add("event/count", 0)) + 1
    out: dict[str, Any] = {}

    relayed = PrefixStore(namespace, own)  # the relays' forwarders' reads

    def listen() -> None:  # the listeners: the ask, then the asker's diagnosis
        for event in (ask_event, ask_event + 1):
            events.wait([f"event/{event}"], timedelta(seconds=_WINDOW_S))
            out["hosts"] = _take_through_relays(lives, event, relayed)
            if event == ask_event:
                out["ask_reads"] = own.requests - before_own
        out["told"] = time.monotonic()

    ready.wait()
    start.wait()
    before_own, before_shared = own.requests, shared.requests
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    asker: threading.Thread | None = None
    key = ""
    call = f"{_HANG_COUNT}-{_HANG_COUNT}-all_reduce"
    for publisher in publishers:  # every member's timeout fires: each joins the ask
        ask = publisher.ask_group(_HANG_ROLE, 0, call, {}, _HANG_FAILED, group)
        key = ask.key
        if ask.first:
            publisher.store = asker_store
            asker = threading.Thread(target=_hang_ask, args=(publisher, key, members, out),
                                     daemon=True)
            asker.start()
    out["joined"] = time.monotonic()
    joins = shared.requests - before_shared
    listener.join(timeout=_WINDOW_S)
    if asker is not None:
        asker.join(timeout=_WINDOW_S)
    if "told" not in out:
        raise RuntimeError("the asker's diagnosis never reached the listeners")
    # What a member raises: the asker's diagnosis, from the share its listener took (once per
    # process: each real rank builds it on its own CPU).
    if publishers:
        mine = publishers[-1]
        taken = mine.shared(key, 0.0)
        if taken is None:
            raise RuntimeError(f"member {mine.rank} took no diagnosis")
        found = Diagnosis.from_share(taken, _HANG_ROLE, mine.rank, _HANG_FAILED, group)
        out["member_silent"] = [state.rank for state in found.where("silent")]
    hosts = out.get("hosts", 0)
    waits = 2 * hosts  # each host's relay waits once per event (one wait stood for all)
    out["requests"] = (shared.requests + own.requests - before_own - before_shared + waits
                       + asker_store.requests)
    # what naming waits for: every member's join (its answer) and, on the same store, every
    # host relay's wake and read of the ask (the asker's own looks are few)
    out["to_name"] = joins + out.get("ask_reads", 0) + hosts
    out["bytes"] = shared.bytes + own.bytes + asker_store.bytes
    return out


def _hang_ask(publisher: StatusPublisher, key: str, members: int, out: dict[str, Any]) -> None:
    """The asker: collect, diagnose and share, as ``FlightSession`` does for a timed-out call
    (its waits at the default interval)."""
    wait_s, shortest_s = answer_waits(publisher.interval_s, publisher.poll_s, members,
                                      timed_out=True, pushed=True)
    published = collect(publisher, key, range(members), _HANG_ROLE, _HANG_FAILED,
                        wait_s=wait_s, shortest_s=shortest_s)
    found = diagnose(_HANG_ROLE, publisher.rank, _HANG_FAILED, published, 1)
    out["named"] = time.monotonic()
    publisher.share(key, found.share())
    out["asked"] = True
    out["silent"] = [state.rank for state in found.where("silent")]
    out["text"] = found.text()


def _note_time(times: list[float]) -> None:
    times.append(time.monotonic())


def _ring(rank: int, members: int) -> tuple[int, int]:
    """``rank`` and its ring successor: what ``Liveness.watch`` takes from the member list (a
    list of N per virtual rank would cost the bench O(N^2) here, and a real rank O(N) once)."""
    return rank, (rank + 1) % members


def _decide(check: CheckIn, decided_at: list[float]) -> None:
    out = check.look()
    while out is None:
        time.sleep(0.02)
        out = check.look()
    decided_at.append(time.monotonic())


def _worker(port: int, index: int, jobs: Any, start: Any, ready: Any, results: Any) -> None:
    """One process of virtual ranks: runs each job it is given (None ends it)."""
    logging.getLogger("commgroups").setLevel(logging.ERROR)
    while (job := jobs.get()) is not None:
        kind, namespace, members, arg = job
        share = -(-members // _WORKERS)
        ranks = range(index * share, min(members, (index + 1) * share))
        try:
            if kind == "hang":
                results.put(_hang(port, namespace, ranks, members, int(arg), start, ready))
            else:
                results.put(_loss(port, namespace, ranks, members, int(arg), start, ready))
        except BaseException as error:  # the parent reports it
            results.put({"error": repr(error)})
            ready.abort()  # nobody waits on a worker that is gone
            start.abort()
            raise


def _saturated_rate(port: int, seconds: float = 1.0) -> float:
    """Requests per second the store serves to :data:`_WORKERS` busy clients (one thread each in
    this process: their round trips overlap, as a job's clients' do).

    Timed from once every client is connected: a new connection stalls seconds now and then in
    this sandbox, and with the connections inside the second, a loaded machine once measured
    no request at all (a rate of 0, then a division by it)."""
    counts: list[int] = []
    window: list[float] = []  # start, stop: set once, as the last client connects
    connected = threading.Barrier(
        _WORKERS, action=lambda: window.extend([time.monotonic(), time.monotonic() + seconds]))

    def hammer() -> None:
        client = TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60))
        connected.wait()
        done = 0
        while time.monotonic() < window[1]:
            client.add("bench-rate", 1)
            done += 1
        counts.append(done)

    threads = [threading.Thread(target=hammer) for _ in range(_WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served = sum(counts)
    if served == 0:
        raise RuntimeError(f"the store at port {port} served no request in {seconds:g} s")
    return served / (time.monotonic() - window[0])


class _Workers:
    """:data:`_WORKERS` spawned processes of virtual ranks, started once for every size."""

    def __init__(self, port: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.start, self.ready = context.Barrier(_WORKERS + 1), context.Barrier(_WORKERS + 1)
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(_WORKERS)]
        self.processes = [context.Process(
            target=_worker, daemon=True,
            args=(port, index, self.jobs[index], self.start, self.ready, self.results))
            for index in range(_WORKERS)]
        for process in self.processes:
            process.start()

    def run(self, kind: str, namespace: str, members: int, arg: float,
            on_start: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Run one job on every worker: they set up, start together, then report."""
        for jobs in self.jobs:
            jobs.put((kind, namespace, members, arg))
        try:
            self.ready.wait(timeout=600)
            self.start.wait(timeout=60)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"control plane {kind} at {members:,} ranks: "
                               f"{self.results.get(timeout=10)}") from None
        if on_start is not None:
            on_start()
        out = [self.results.get(timeout=600) for _ in self.processes]
        errors = [result["error"] for result in out if "error" in result]
        if errors:
            raise RuntimeError(f"control plane {kind} at {members:,} ranks: {errors[0]}")
        return out

    def close(self) -> None:
        """End every worker."""
        for jobs in self.jobs:
            jobs.put(None)
        for process in self.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def run(sizes: Sequence[int], idle_s: float, progress: Progress,
        idle_max: int = IDLE_THREADED_MAX) -> tuple[list[Table], dict[str, Any]]:
    """Measure every size; returns the table and the summary (``control_plane_check_in_s``,
    ``control_plane_requests_per_rank_s``: {N: value}, with which are extrapolated)."""
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    port = int(server.port)
    rate = _saturated_rate(port)
    workers = _Workers(port)
    try:
        return _measure(server, port, rate, workers, sizes, idle_s, idle_max, progress)
    finally:
        workers.close()


def _one_size(server: Store, rate: float, workers: _Workers, size: int) -> dict[str, Any]:
    """The loss and the hang at ``size`` virtual ranks: their figures (see :func:`_measure`)."""
    namespace = f"bench/loss/{size}/"
    reporter = Liveness(server, server, namespace, size - 2, interval_s=_BEAT_S,
                        dead_after_s=_DEAD_AFTER_S, on_loss=_no_loss)
    reported: list[float] = []

    def report(reporter: Liveness = reporter, lost: int = size - 1,
               reported: list[float] = reported) -> None:
        reported.append(time.monotonic())
        # Naming nobody, as a stale beat's report and rebuild() without alive= do.
        reporter.report(0, f"rank {lost} stopped", None)

    parts = workers.run("loss", namespace, size, size - 1, on_start=report)
    decided = [part["decided"] for part in parts if part["decided"] is not None]
    if len(decided) != 1:
        raise RuntimeError(f"control plane at {size}: {len(decided)} deciders")
    wrong = {part["survivors"] for part in parts} - {size - 1}
    if wrong:  # a live rank decided out: its answer was judged late (a product bug)
        raise RuntimeError(f"control plane at {size}: survivors {wrong}, not {size - 1}")
    seconds = decided[0] - reported[0]
    requests = sum(part["requests"] for part in parts)
    check_in_bytes = sum(part["bytes"] for part in parts)
    to_decide = sum(part["to_decide"] for part in parts)
    # The decider judges the lost rank dead once it left the report unanswered for
    # dead_after_s: no store rate makes the decision sooner.
    extrapolated = max(_DEAD_AFTER_S, to_decide / rate) + 0.02
    hung = size // 2
    began: list[float] = []
    parts = workers.run("hang", f"bench/hang/{size}/", size, hung,
                        on_start=functools.partial(_note_time, began))
    askers = [part for part in parts if part.get("asked")]
    if len(askers) != 1:
        raise RuntimeError(f"control plane hang at {size}: {len(askers)} askers, not 1")
    (asker,) = askers
    silent = [part["member_silent"] for part in parts if "member_silent" in part]
    if asker["silent"] != [hung] or any(each != [hung] for each in silent):
        raise RuntimeError(f"control plane hang at {size}: named {asker.get('text')!r} "
                           f"(members: {silent}), not rank {hung} alone silent")
    named = asker["named"] - began[0]
    # The store serves the requests naming waits for at its saturated rate: what N real
    # ranks (each its own CPU) would see. Measured here, the workers' CPUs bound it. A
    # member never answers, so the asker waits at least its shortest wait and the quiet.
    _, shortest = answer_waits(DEFAULT_INTERVAL_S, DEFAULT_INTERVAL_S / 4, size,
                               timed_out=True, pushed=True)
    return {"check_in_requests": requests / (size - 1),
            "check_in_bytes": check_in_bytes / (size - 1),
            "check_in_s": seconds, "check_in_extrapolated_s": extrapolated,
            "hang_requests": sum(part["requests"] for part in parts) / size,
            "hang_named_s": named,
            "hang_named_extrapolated_s": max(shortest + ANSWER_QUIET_S,
                                             sum(part["to_name"] for part in parts) / rate),
            "hang_told_s": max(part["told"] for part in parts) - began[0],
            "hang_silent": asker["silent"]}


def _measure(server: Store, port: int, rate: float, workers: _Workers, sizes: Sequence[int],
             idle_s: float, idle_max: int, progress: Progress
             ) -> tuple[list[Table], dict[str, Any]]:
    table = Table(
        "control_plane", f"Control plane at scale: {_WORKERS} processes of virtual ranks, one "
        "TCPStore server",
        ["ranks", "idle req/rank/s", "check-in req/rank", "check-in bytes/rank",
         "report -> decided s (measured)", "report -> decided s (extrapolated)",
         "hang req/member", "hang timeout -> named s (measured)",
         "hang timeout -> named s (extrapolated)", "hang timeout -> every member told s",
         f"hang named in timeout+{_HANG_GOAL_S:g} s"])
    # One idle sample per distinct size up to idle_max (larger sizes carry the largest one
    # over), all of them idle while the loss and hang phases run (see _IdleRanks).
    idle_sizes = {size: min(size, idle_max) for size in sizes}
    idle_runs = {members: _IdleRanks(port, members, idle_s)
                 for members in sorted(set(idle_sizes.values()))}
    figures: dict[int, dict[str, Any]] = {}
    try:
        progress.describe("control plane: idle ranks")
        for each in idle_runs.values():
            each.start()
        for size in sizes:
            progress.describe(f"control plane: {size:,} ranks")
            figures[size] = _one_size(server, rate, workers, size)
            progress.advance()
        measured_idle = {members: each.finish() for members, each in idle_runs.items()}
    finally:
        for each in idle_runs.values():
            each.close()
    idle = {str(size): measured_idle[members] for size, members in idle_sizes.items()}
    idle_extrapolated = [size for size, members in idle_sizes.items() if members < size]
    for size, got in figures.items():
        named, extrapolated_named = got["hang_named_s"], got["hang_named_extrapolated_s"]
        table.add(f"{size:,}", number(idle[str(size)]) +
                  (" (extrapolated)" if size in idle_extrapolated else ""),
                  number(got["check_in_requests"]), number(got["check_in_bytes"]),
                  number(got["check_in_s"]), number(got["check_in_extrapolated_s"]),
                  number(got["hang_requests"]), number(named), number(extrapolated_named),
                  number(got["hang_told_s"]),
                  f"{'yes' if min(named, extrapolated_named) <= _HANG_GOAL_S else 'no'} "
                  f"({_HANG_TIMEOUT_S + extrapolated_named:.1f} s of "
                  f"{_HANG_TIMEOUT_S:g}+{_HANG_GOAL_S:g}, extrapolated)")
    table.notes += [
        f"idle: {idle_s:g} s with every rank's listener and beat running (beat every {_BEAT_S:g} s), "
        "while the loss and hang phases ran in the workers (requests counted on the idle ranks' "
        f"own connections), on at most {idle_max:,} ranks (each a socket and two threads; in "
        "this sandbox a new connection's name lookup stalls 5 s now and then without "
        "RES_OPTIONS=attempts:0); above, the figure is the measured one carried over "
        "(extrapolated: no idle request depends on N)",
        f"the store served {rate:,.0f} requests/s to {_WORKERS} busy clients here; the "
        "extrapolated decision time is the requests the decision waits for divided by that rate",
        "measured: the workers share 2 cores with the server, one connection per process",
        f"hang: every rank one role's group (timeout {_HANG_TIMEOUT_S:g} s), rank N/2 hung "
        "(published, then silent), every other rank's timeout fires at once: each joins the "
        "group ask and answers (the first asks, collects, diagnoses and shares the diagnosis), "
        "its listener takes the ask and the diagnosis through its host's relay "
        f"({RANKS_PER_HOST} ranks a host: one wait and one read of each event per host); "
        "timeout -> named: to the asker's "
        "diagnosis, -> every member told: to the last listener's read of it; requests per "
        "member: every member's (joins, answers, event waits and reads) and the asker's, over N; "
        "extrapolated: the requests naming waits for (joins, the relays' wakes and reads of the "
        "ask) over the store's rate",
    ]

    def by_size(name: str) -> dict[str, Any]:
        return {str(size): got[name] for size, got in figures.items()}

    summary = {"control_plane_check_in_s": by_size("check_in_s"),
               "control_plane_check_in_extrapolated_s": by_size("check_in_extrapolated_s"),
               "control_plane_requests_per_rank_s": idle,
               "control_plane_extrapolated_sizes": idle_extrapolated,
               "control_plane_store_requests_per_s": rate,
               "control_plane_hang_named_s": by_size("hang_named_s"),
               "control_plane_hang_told_s": by_size("hang_told_s"),
               "control_plane_hang_named_extrapolated_s": by_size("hang_named_extrapolated_s"),
               "control_plane_hang_requests_per_member": by_size("hang_requests"),
               "control_plane_hang_silent": by_size("hang_silent"),
               "control_plane_hang_role_timeout_s": _HANG_TIMEOUT_S}
    return [table], summary


if __name__ == "__main__":  # python -m commgroups.bench.control_plane [sizes...]
    import sys

    from commgroups.bench.progress import NullProgress

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    chosen = [int(arg) for arg in sys.argv[1:]] or [1024, 8192, 65536]
    tables, figures = run(chosen, 10.0, NullProgress())
    print(tables[0].text())
    print(json.dumps(figures, indent=1))
