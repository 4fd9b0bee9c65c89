"""The rank-loss package's entry point: what one rank keeps from a generation to the next, and the
rebuild.

A :class:`Recovery` belongs to one :class:`~commgroups.GroupRegistry` on one rank. It holds the
heartbeat (:mod:`commgroups.rank_loss.liveness`), the NCCL shrink spine
(:mod:`commgroups.creation.shrink`), the retired generations not yet released and the check-in
attempts. One rebuild is one path, in this order: :meth:`Recovery.rebuild` (report the loss,
interrupt generation g, check in, replan, retire g, make g+1 through
:func:`~commgroups.generation.make_generation`), the registry makes g+1 current, then
:meth:`Recovery.finish` (watch g+1, release g). The registry keeps the lifecycle state and calls
only these verbs; nothing below :mod:`commgroups.generation` imports this package.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta

import numpy as np
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]  # re-exported

from commgroups import torch_internals
from commgroups.creation.agreement import store_barrier
from commgroups.creation.role_groups import CreationContext
from commgroups.creation.shrink import Spine, prepare_spine
from commgroups.creation.store_keys import AttemptStore
from commgroups.errors import RebuildError
from commgroups.generation import STORE_PREFIX, Generation, dims_needing_groups, make_generation
from commgroups.planning.plan import plan
from commgroups.rank_loss.attempt_channel import AttemptChannel
from commgroups.rank_loss.check_in import (
    AGREED,
    check_in,
    check_in_at_open_attempt,
    check_in_window,
    close_check_in_attempt,
    forget_check_ins,
    open_check_in_attempt,
    record_made,
)
from commgroups.rank_loss.liveness import Liveness, own_connection
from commgroups.rank_loss.local_peers import this_process
from commgroups.rank_loss.loss_barrier import LossBarriers
from commgroups.rank_loss.rebuild_report import RebuildReport
from commgroups.rank_loss.replan import alive_ranks, replan_arrays

__all__ = ["LINGER_COLLECT_S", "STARTER_WAIT_S", "Recovery"]

logger = logging.getLogger(__name__)

LINGER_COLLECT_S = 1.0
"""How long after a release its lingering groups are collected (see ``release_retired``)."""

STARTER_WAIT_S = 30.0
"""The longest a verb waits for generation 0's starter thread (see ``Recovery.wait_started``)."""

@dataclass
class Recovery:
    """One registry's rank-loss state on one rank (see the module docstring)."""

    rank: int
    registry_id: int
    """The agreement epoch of ``create()``: the same on every rank, a namespace of its own."""
    liveness: Liveness | None = None
    spine: Spine | None = None
    retired: list[Generation] = field(default_factory=list)
    """Retired generations not yet released (see :meth:`release_retired`)."""
    attempts: int = 0
    """The check-in attempt this rank last used toward the next generation (the store's open
    one: attempts before it were decided and failed afterwards)."""
    attempts_made: int = 0
    """How many check-ins the last successful rebuild took."""
    closed_toward: int | None = None
    """The generation toward which this rank last closed a check-in attempt: its next check-in
    toward it reads the open attempt; any other starts at attempt 0 without reading it."""
    closed_members: tuple[int, ...] = ()
    """The members the closed attempt (``closed_toward``) decided on. Its retry waits for them
    only: the ranks it dropped or kept as spares have left ``rebuild()`` with their place, and
    answered the loss report while alive, so the check-in waited for them until its window
    ended (8 s in ``test_rebuild``'s second loss; the window is the longest role timeout)."""
    previous_check_ins: tuple[str, int] | None = None
    """The last successful rebuild's check-in prefix and attempt count, deleted one rebuild later."""
    flight_events: list[int] = field(default_factory=list)
    """Listener events of released generations' flight-recorder asks (this rank released their
    keys last), deleted at the next rebuild's end (:meth:`finish`)."""
    previous_flight_events: list[int] = field(default_factory=list)
    """Those the last rebuild's end took over: deleted at this one's, with the check-in's."""
    lingering: list[weakref.ref[dist.ProcessGroup]] = field(default_factory=list)
    """Released groups something still held at release (see :meth:`release_retired`)."""
    collector: threading.Timer | None = None
    collector_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Guards ``lingering`` and ``collector`` (the timer's thread and the main one)."""
    starter: threading.Event | None = None
    """Set once the thread that starts generation 0's background threads is done
    (:meth:`start_threads`); None once waited for."""
    barriers: LossBarriers = field(default_factory=LossBarriers)
    """The store barriers this rank waits in (:meth:`store_barrier`), which a loss report ends."""

    # ------------------------------------------------------------------------------- heartbeat
    def start_threads(self, current: Generation, members: Sequence[int], heartbeat_s: float | None,
                      dead_after_s: float, connect_timeout_s: float,
                      live: Callable[[], Generation | None]) -> None:
        """Start generation 0's background threads: its flight publisher and this rank's
        heartbeat watching ``current`` (none where there is nobody to watch: one rank, the fake
        backend, a store that is not a TCPStore, heartbeats off), and send the note that this
        rank is done creating ``current`` (:meth:`Generation.announce_created`). ``live``
        returns the registry's current generation (read from the heartbeat thread).

        ``create()``'s path, where every rank waits for the slowest, keeps one store request
        (this rank's process entry, :meth:`Liveness.publish_process`, an append: no reply
        awaited); a starter thread of this Recovery does the rest
        (:meth:`_start_in_background`): the note; the listener's thread start, which waits
        for the new thread to run, and four round trips (8 ranks sharing 2 cores: 1-6 ms a
        thread start, 0.5-3 ms a round trip); then it beats and runs the flight publisher's
        periodic look. Every other verb waits for the starter's start-up first
        (:meth:`wait_started`). The starter never waits for its peers on the job's connection,
        which the main thread shares (a TCPStore connection serves one request at a time, a
        wait included): the main thread's next store request after ``create()``, a
        ``new_group``'s rendezvous, would wait with it, and so would the peers that
        rendezvous needs.

        The starter reads the listener's anchor (:meth:`Liveness.anchor`) first: an event
        emitted before it is one the starter's next steps catch up on (a loss report: the
        watch reads the generation's report; an ask: the flight publisher looks for one as it
        attaches), as one emitted before ``create()`` returned was.
        """
        if heartbeat_s is None or len(members) == 1 or str(dist.get_backend()) == "fake":
            self._start_without_heartbeat(current)
            return
        store = torch_internals.default_store()
        if not _over_tcp_store(store):
            logger.debug("rank %d: the job's store is not a TCPStore: no heartbeats", self.rank)
            self._start_without_heartbeat(current)
            return
        timeout = timedelta(seconds=connect_timeout_s)

        def on_loss(number: int, suspects: frozenset[int] | None) -> None:
            generation = live()  # the listening thread: no lock, the main thread may be
            if generation is not None and generation.number == number:  # blocked in g
                logger.info("rank %d: a loss was reported in generation %d: interrupting %s",
                            self.rank, number, "it" if suspects is None
                            else f"its groups holding ranks {sorted(suspects)}")
                generation.note_loss(suspects)  # a call that fails now says why
                generation.interrupt(self._kept(generation, from_thread=True), suspects)
            self.barriers.wake(store, number, self.rank)

        # The listener's own connection is made by its thread, later still.
        self.liveness = Liveness(lambda: _connected(own_connection(store, timeout)), store,
                                 f"{STORE_PREFIX}/live/{self.registry_id}/", self.rank,
                                 interval_s=heartbeat_s, dead_after_s=dead_after_s,
                                 on_loss=on_loss, process=this_process(), relay=True)
        self.liveness.publish_process()  # before create() returns: see publish_process
        self.starter = threading.Event()
        # _thread, not threading: Thread.start() waits until the new thread runs, 1-6 ms here
        # at the end of creation (every rank's cores busy), 0.1 ms on a quiet one; this start
        # does not wait. The event says when the starter is done (wait_started).
        _thread.start_new_thread(self._start_in_background,
                                 (current, self.liveness, tuple(members), self.starter))

    def _start_without_heartbeat(self, current: Generation) -> None:
        """What :meth:`start_threads` does where no heartbeat runs: the note, then the flight
        publisher on a thread of its own (:meth:`_attach_flight`), here (there is no starter
        thread)."""
        current.announce_created()
        self._attach_flight(current)

    def _start_in_background(self, current: Generation, liveness: Liveness,
                             members: tuple[int, ...], done: threading.Event) -> None:
        """The starter: the heartbeat's anchor, its listener and the watch of ``current``, and
        the flight publisher, which then hears asks through the listener; ``done`` is set then,
        whatever happened, and the starter goes on as the beat's thread (:meth:`Liveness.run_beats`),
        which also runs the publisher's periodic look (:meth:`Liveness.every`). Two thread
        starts fewer per rank, as every rank ends its groups at once: 8 gloo ranks on 2 cores
        made creation 1.26-1.27x DeviceMesh with the beat's, 1.34-1.42x without. A store
        failure here is logged, and nothing beats: the listener reports what it cannot do."""
        try:
            # No wait for the peers' notes here (see start_threads): one on the job's shared
            # connection held the main thread's next store request with it, up to 1 s on 8
            # gloo ranks (a new_group right after create()); it saved a peer still creating
            # 0.02-0.03x DeviceMesh of cores (8 and 4 ranks on 2 cores, 16-20 fresh worlds).
            current.announce_created()
            liveness.anchor()
            liveness.prepare_relay()
            liveness.start_listener()
            liveness.watch(current.number, members)
            self._attach_flight(current)
        except Exception as error:  # the store's host died: the job's next call says so
            logger.warning("rank %d: starting the heartbeat failed: %r", self.rank, error)
            return
        finally:
            done.set()
        liveness.run_beats()

    def store_barrier(self, name: str, position: int, members: Sequence[int],
                      timeout: timedelta, what: str, number: int) -> None:
        """Every rank of generation ``number`` (``members``; ``position``: this rank's index)
        reaches ``name``, a key of the job's store, before any leaves; a loss report of that
        generation ends the wait (:class:`~commgroups.rank_loss.loss_barrier.LossBarriers`).
        Without a heartbeat nothing reports: a plain store barrier."""
        self.wait_started()
        store = torch_internals.default_store()
        if self.liveness is None:
            store_barrier(store, name, position, len(members), timeout, what, members=members)
            return
        liveness = self.liveness
        self.barriers.wait(
            store, name, position, members, timeout, what, number, liveness.heard,
            liveness.local_deaths,
            lambda dead: liveness.report(number, f"ranks {list(dead)} are gone from this host "
                                         f"(rank {self.rank} waited at {what})", dead))

    def wait_started(self) -> None:
        """Wait for the starter thread (:meth:`start_threads`), if one still runs; every verb
        that touches the heartbeat or the flight publisher calls this first.

        At most :data:`STARTER_WAIT_S`: its four store requests take milliseconds; one held
        that long waits on a store that stopped answering, and the verb then goes on (and says
        so) rather than hang the job with it."""
        starter, self.starter = self.starter, None
        if starter is not None and not starter.wait(STARTER_WAIT_S):
            logger.warning("rank %d: the heartbeat's starter has not finished after %g s (the "
                           "store is slow or gone); going on without it", self.rank,
                           STARTER_WAIT_S)

    def attach_flight(self, generation: Generation) -> None:
        """Start ``generation``'s flight publisher: it hears asks through the listener (no
        polling) and looks at its status from the beat's thread (:meth:`Liveness.every`: no
        thread of its own); without a heartbeat, on a thread of its own."""
        self.wait_started()
        self._attach_flight(generation)

    def _attach_flight(self, generation: Generation) -> None:
        flight = generation.flight
        if flight is None:
            return
        if self.liveness is not None and flight.publisher is not None:
            flight.publisher.listen_through(self.liveness.emit, self.liveness.subscribe,
                                            self.liveness.every, self.liveness.known)
        else:
            flight.start()

    def _kept(self, generation: Generation, from_thread: bool = False) -> list[dist.ProcessGroup]:
        """Groups an interrupt leaves alone: the spine a shrink needs; from the heartbeat thread on
        a bound default group, every device group (the spine is chosen by ``rebuild()``)."""
        spine = self.spine
        keep = [] if spine is None else [spine.group]
        if from_thread and generation.request.context.device_bound:
            keep += [group for made in generation.roles.values() if made.adapter.aborts
                     for group in made.owned]
        return keep

    def stop_liveness(self, members: int = 0) -> None:
        """Stop the listening thread: a rank out of the job, or ``close()`` of a generation of
        ``members`` ranks (the last of them to close wakes every thread still waiting)."""
        self.wait_started()
        if self.liveness is not None:
            self.liveness.close(members)
            self.liveness = None

    # --------------------------------------------------------------------------------- rebuild
    def rebuild(self, current: Generation, alive: Iterable[int] | None,
                timeout: float | timedelta | None, meshes: Sequence[tuple[str, ...]],
                timeout_overrides: Mapping[str, timedelta],
                ) -> tuple[RebuildReport, Generation | None]:
        """Make generation g+1 from ``current`` (g) on the survivors. Collective over them.

        ``alive`` and ``timeout`` are ``GroupRegistry.rebuild()``'s; ``meshes``: the meshes to
        make again, in order; ``timeout_overrides``: ``set_timeout()``'s, which lengthen the
        check-in window. Input is checked before anything is reported or interrupted.

        Returns the report and the new generation (None where this rank has no place in it; the
        report's ``place`` says spare or dropped). ``current`` is retired on return, and on any
        error raised after the survivors were decided.
        """
        self.wait_started()
        members = current.plan.members or tuple(range(current.layout.world_size))
        known = None if alive is None else alive_ranks(alive, current.plan, self.rank)
        self.check_rebuildable(current)
        window = check_in_window(timeout, current.layout, timeout_overrides,
                                 current.request.create_timeout_s)
        seconds: dict[str, float] = {}
        started = time.monotonic()
        the_plan = current.plan
        # The ranks known lost take no further part in g: the others' groups holding one of them
        # are interrupted, and only those (a collective among ranks still at it finishes; this
        # rank's own groups are interrupted below, which frees a gloo peer blocked on it).
        # Nobody known: every group. Every rank listed alive: nothing to tell.
        suspects = None if known is None else set(members) - set(known.tolist())
        if self.liveness is not None and suspects != set():
            self.liveness.report(current.number, f"rank {self.rank} called rebuild()", suspects)
        current.interrupt(self._kept(current))  # ours too: another thread may be blocked on g
        if str(dist.get_backend()) == "fake":
            if known is None:
                raise RebuildError("rebuild() under the fake backend simulates one rank: fix: pass "
                                   "alive= (there is nobody to check in with)")
            survivors = known
        else:
            root = torch_internals.default_store()
            # The attempt is the store's, not this rank's (open_check_in_attempt says why); a
            # rank that closed none toward g+1 starts at 0 without reading it.
            prefix = self._rebuild_prefix(current.number + 1)
            retry = self.closed_toward == current.number + 1
            first = open_check_in_attempt(root, prefix) if retry else 0
            checking = members
            expected = None if known is None else known.tolist()
            if retry and self.closed_members:  # whom the closed attempt chose (closed_members)
                checking = self.closed_members
                if known is not None:  # arrays: a list's ``in`` per rank is O(N^2) at 65,536
                    expected = known[np.isin(known, checking)].tolist()
            decided, attempt = check_in_at_open_attempt(
                root, prefix, first, self.rank,
                lambda keys: check_in(root, keys, self.rank, checking, window, expected,
                                      self.liveness, self._made_key, current.number))
            survivors = np.asarray(decided, dtype=np.int64)
            self.attempts = attempt
        seconds["check_in"] = time.monotonic() - started

        mark = time.monotonic()
        # Arrays from here on: at 65,536 ranks each Python step per rank costs milliseconds.
        decision = replan_arrays(current.layout, the_plan.positions(survivors))
        new_members = the_plan.global_ranks(decision.ranks)
        lost, spares, dropped = (tuple(the_plan.global_ranks(positions).tolist())
                                 for positions in (decision.lost, decision.spares, decision.dropped))
        new_plan = plan(decision.layout, new_members)
        seconds["replan"] = time.monotonic() - mark

        mark = time.monotonic()
        if self.spine is not None:  # taken from its role before the retire aborts it
            self.spine = self.spine.retarget(new_plan.members or (), self.rank)
        self.retire(current)
        seconds["retire"] = time.monotonic() - mark
        number = current.number + 1
        if not bool(new_plan.holds(np.array([self.rank]))[0]):
            self.release_retired(decision.lost.tolist(), first=False)
            self.stop_liveness()
            place = "spare" if self.rank in spares else "dropped"
            return RebuildReport(number, decision.layout, new_plan.members or (), lost, spares,
                                 dropped, place, seconds), None

        mark = time.monotonic()
        context = CreationContext.detect()  # once per generation: torch_npu's probe is slow
        request = replace(current.request, number=number, layout=decision.layout, plan=new_plan,
                          context=context, spine=self.spine, lost=len(lost),
                          mesh_dims=dims_needing_groups(decision.layout, new_plan, meshes, context),
                          outcomes=self._outcomes(number, new_plan.members or ()))
        try:
            generation = make_generation(request)
        except BaseException:
            self._close_attempt(number, new_plan.members or ())  # every survivor checks in anew
            raise
        self.attempts_made = self.attempts + 1
        seconds["create"] = time.monotonic() - mark
        new = new_plan.members or ()
        return RebuildReport(number, decision.layout, new, lost, spares, dropped, "member",
                             seconds), generation

    def finish(self, report: RebuildReport, previous: Generation, generation: Generation) -> float:
        """After ``generation`` (g+1) is current: watch it, release ``previous`` (g) and the
        check-in keys of a rebuild ago; returns the seconds it took (the report's ``release``)."""
        mark = time.monotonic()
        self.attach_flight(generation)
        members = generation.plan.members or tuple(range(generation.layout.world_size))
        lost_positions = previous.plan.positions(np.asarray(report.lost, dtype=np.int64)).tolist()
        if self.liveness is not None:
            self.liveness.watch(report.generation, members)
        first = bool(members) and members[0] == self.rank
        self.release_retired(lost_positions, first, members)
        # Events of asks a generation ago: every member's listener handled this rebuild's
        # decision since, which came after them (as forget_check_ins' below).
        if self.liveness is not None and self.previous_flight_events:
            self.liveness.forget(self.previous_flight_events)
        self.previous_flight_events, self.flight_events = self.flight_events, []
        if first and str(dist.get_backend()) != "fake":
            root = torch_internals.default_store()
            record_made(root, self._made_key, report.generation, len(members))
            if self.previous_check_ins is not None:  # a generation ago: nobody reads them now
                events = forget_check_ins(root, *self.previous_check_ins)
                if self.liveness is not None:
                    self.liveness.forget(events)
        self.previous_check_ins = (self._rebuild_prefix(report.generation), self.attempts_made)
        return time.monotonic() - mark

    def check_rebuildable(self, current: Generation) -> None:
        """Refuse, on every rank alike, backends whose groups cannot be made without the dead
        rank; on a bound NCCL default group, find the spine to shrink."""
        self.spine = prepare_spine(current.roles, current.plan, self.spine, CreationContext.detect())

    # ------------------------------------------------------------------------------ teardown
    def retire(self, current: Generation) -> None:
        """Retire ``current``; it is released once this rank is past the check-in."""
        if not current.ended:
            current.retire()
            self.retired.append(current)

    def release_retired(self, lost_positions: Sequence[int] = (), first: bool = False,
                        survivors: Sequence[int] | None = None) -> None:
        """Release every retired generation: its groups are interrupted on every survivor (no
        collective waits on them) and every survivor is past the check-in that read its keys.
        ``first``: this rank deletes the shared keys (one rank does); ``survivors``: the
        current members, if known."""
        self.wait_started()
        for old in self.retired:
            if old.release(lost_positions):
                self.linger(old.lingering)
                self.flight_events += old.flight_events
                if first and self.liveness is not None:
                    self.liveness.release(old.number, survivors)
        self.retired = [old for old in self.retired if old.ended != "released"]

    def linger(self, groups: Sequence[weakref.ref[dist.ProcessGroup]]) -> None:
        """Collect ``groups`` (released or destroyed, something still held them) a second from
        now, once, if a reference cycle holds one then.

        Off the rebuild's and close()'s path: the caller's exception (rebuild() in the except
        block of the failed step) holds the old groups until that block ends, a caller of
        close() may still hold a mesh; a full collection later frees what only a cycle holds
        then (their sockets and threads), from this timer's thread while the job runs on."""
        with self.collector_lock:
            self.lingering += groups
            if self.lingering and self.collector is None:
                self.collector = threading.Timer(LINGER_COLLECT_S, self.collect_lingering)
                self.collector.daemon = True
                self.collector.start()

    def collect_lingering(self) -> None:
        """Free the released groups that reference cycles still hold: one full collection, only
        if one is still alive. From the collector's timer (:meth:`linger`)."""
        with self.collector_lock:
            self.collector = None
            alive = any(ref() is not None for ref in self.lingering)
        if alive:
            gc.collect()
        with self.collector_lock:
            self.lingering = [ref for ref in self.lingering if ref() is not None]

    def close(self, number: int, first: bool, members: Sequence[int] = ()) -> None:
        """``close()`` of generation ``number`` (on ``members``, if this rank is one): stop the
        listening thread, release the retired generations, close the spine; ``first`` (one
        rank): delete the rebuild records too."""
        self.wait_started()
        if first and self.liveness is not None:
            self.liveness.release(number)
        self.stop_liveness(len(members))
        self.release_retired()  # what lingers is collected by the timer: never here
        if (first and self.previous_check_ins is not None and dist.is_initialized()
                and str(dist.get_backend()) != "fake"):
            root = torch_internals.default_store()
            forget_check_ins(root, *self.previous_check_ins)
            with contextlib.suppress(RuntimeError):  # never written: no rebuild ran
                root.delete_key(self._made_key)
            self.previous_check_ins = None
        if self.spine is not None:
            self.spine.close()
            self.spine = None

    def _close_attempt(self, generation: int, members: Sequence[int]) -> None:
        """After a decided attempt failed here: mark it closed and open the next one, for every
        rank (once: :func:`~commgroups.rank_loss.check_in.close_check_in_attempt`); ``members``:
        whom it decided on (:attr:`closed_members`)."""
        if str(dist.get_backend()) == "fake":
            return
        self.closed_toward = generation  # this rank's retry reads the open attempt
        self.closed_members = tuple(members)
        close_check_in_attempt(torch_internals.default_store(), self._rebuild_prefix(generation),
                               self.attempts)

    def _outcomes(self, number: int, members: Sequence[int],
                  ) -> Callable[[AttemptStore], AttemptChannel] | None:
        """Where generation ``number``'s agreement hears its outcome
        (:mod:`~commgroups.rank_loss.attempt_channel`); None without a listener (a store wait)."""
        liveness = self.liveness
        if liveness is None or not liveness.listening or str(dist.get_backend()) == "fake":
            return None
        root = torch_internals.default_store()
        events = f"{self._rebuild_prefix(number)}{AGREED}"
        return lambda attempt: AttemptChannel(liveness, attempt.namespace, members, number - 1,
                                              root, events)

    def _rebuild_prefix(self, generation: int) -> str:
        """The store namespace of the check-ins toward ``generation`` (one per attempt below it)."""
        return f"{STORE_PREFIX}/rebuild/{self.registry_id}/{generation}/"

    @property
    def _made_key(self) -> str:
        return f"{STORE_PREFIX}/rebuild/{self.registry_id}/made"


def _over_tcp_store(store: Store) -> bool:
    """Whether ``store`` is a TCPStore, under any prefixes (a FileStore or HashStore job has no
    listener: nothing to block on)."""
    inner = store
    for _ in range(8):
        if not hasattr(inner, "underlying_store"):
            break
        inner = inner.underlying_store
    return isinstance(inner, TCPStore)


def _connected(client: Store | None) -> Store:
    if client is None:  # checked before: the store changed under the registry
        raise RuntimeError("the job's store is not a TCPStore")
    return client
