"""A background publisher that keeps this rank's status in the store, so other ranks can read it
even while this rank is stuck (in Python, or in a collective that holds no GIL).

Self-contained on purpose: a store, a key prefix, a rank and a ``snapshot`` callable. The
collective's path never touches the store: a daemon thread looks at the snapshot every
``interval_s`` and publishes a change once it settled (the same at two looks in a row: the rank
stopped moving, which is what a reader of a silent rank's status needs), and at the latest
:data:`REFRESH_S` after the last publication (a group ask is answered with a line of its own,
:meth:`StatusPublisher.ask_group`, not by publishing the status). A training
rank's status changes with every collective: publishing each change at every look was one store
request per rank per second, 65,536 a second at 65,536 ranks, the whole of this machine's
store. Asks arrive as events through the registry's listener
(:meth:`StatusPublisher.listen_through`: no store request while nobody asks), and the periodic
look then runs on the heartbeat's thread (no thread of its own); without a listener (no TCPStore,
heartbeats off) the publisher's own thread reads the request counter a few times an interval.

A failed call's diagnosis asks only its group (:meth:`StatusPublisher.ask_group`): one ask per
role, group and failed call however many of its members diagnose it, answered by that group's
members alone, each with one compact answer pushed to the ask's answers key: one append of O(1)
size (a member that reached exactly the asker's call writes its rank alone, about 6 bytes; any
other its compact status). Only the first member to ask (the asker) watches that key, one
request per look, until every member answered (:func:`collect`), diagnoses, and pushes the
diagnosis to the others (:meth:`StatusPublisher.share`: one event); a member that timed out too
answers as it joins and waits for that (:meth:`StatusPublisher.shared`). No rank polls another's
status, and no key that every member reads grows with the group: when every member of a group
of 65,536 diagnosed on its own, each read the answers (400 kB) every 50 ms.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.util.store_reads import (
    append_numbers,
    read_bytes_if_present,
    read_if_present,
    read_numbers,
)

__all__ = ["ANSWER_LOOK_S", "ANSWER_QUIET_S", "ANSWER_WAIT_PER_MEMBER_S", "BLOCK_MEMBERS",
           "DEFAULT_INTERVAL_S", "LOSS_SHORTEST_S", "REFRESH_S", "REQUEST_POLLS_PER_INTERVAL",
           "SHARE_GRACE_S", "GroupAsk", "StatusPublisher", "answer_waits", "collect",
           "parse_answers", "read_status"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
"""Seconds between two looks at the snapshot."""

REFRESH_S = 30.0
"""The longest a changing status goes unpublished: a rank killed while it trains leaves a status
at most this old (a rank that stops moving publishes within two looks)."""

REQUEST_POLLS_PER_INTERVAL = 4
"""Looks at the request counter per interval: a rank asked after a peer's connection closed waits
for the others' answers while rank-loss handling waits for it, so they answer within a quarter
interval (one or two store reads each)."""

ANSWER_LOOK_S = 0.05
"""Seconds between two looks at an ask's answer counter (one request each)."""

ANSWER_QUIET_S = 0.1
"""Once the asker's shortest wait passed (0.3 s and an interval: what guards a small group's
slow member), it stops when no answer came for this long between two of its looks: a group of 65,536
answers in about 1.5-1.9 s on one store (a steady stream), and the asker names its silent
members 0.1 s after the last answer, not at the longest wait (2.8 s)."""

BLOCK_MEMBERS = 31
"""Members per join counter of a group ask (:meth:`StatusPublisher.ask_group`): each adds its
own bit (0-30); the bits from :data:`_EVENT_SHIFT` up carry the ask's event number. 2,115
counters for a group of 65,536, read in one request."""

_EVENT_SHIFT = 32
_BLOCK_MASK = (1 << BLOCK_MEMBERS) - 1

JOINED_WAIT_S = 2.0
"""The longest :meth:`StatusPublisher.joined`'s one-request read of a large group's join
counters waits (they exist when it starts: only a release deleting them meanwhile makes it wait)."""

SHARE_GRACE_S = 0.2
"""How long a member that joined an ask still waits for the asker's diagnosis once its
generation was interrupted (a loss reported: the asker stops collecting at once and shares what
it has; a rebuild waits for this member)."""

ANSWER_WAIT_PER_MEMBER_S = 50e-6
"""The asker's longest wait grows by this per member of the group: a member's answer costs the
store one or two requests, and one store serves 60,000-100,000 a second (65,536 members: 3.3 s
more). It ends early once every member answered, or answers stopped for
:data:`ANSWER_QUIET_S`: a slow stream of answers must not read as silent members."""


def answer_waits(interval_s: float, poll_s: float, members: int, timed_out: bool,
                 pushed: bool) -> tuple[float, float]:
    """The asker's (longest, shortest) wait for the answers of a group of ``members`` (see
    :func:`collect`): after a timeout up to 2.5 intervals (a loaded machine delays threads),
    else 1.5 request polls, each plus :data:`ANSWER_WAIT_PER_MEMBER_S` per member; the
    shortest 0.3 s and an interval, or :data:`LOSS_SHORTEST_S` after a failure that is not a
    timeout where answers are pushed (a peer's closed connection: most likely it died, and a
    rebuild waits for this diagnosis).

    A live member's listener answers in milliseconds, but on a loaded machine its threads wait
    for a core: 0.3 s and half an interval (0.8 s) named a live partner silent on torch 2.15's
    test leg beside two other workers. A hang was already a role timeout long; half a second
    more costs nothing there."""
    longest = (0.3 + (2.5 * interval_s if timed_out else 1.5 * poll_s)
               + members * ANSWER_WAIT_PER_MEMBER_S)
    shortest = min(longest, 0.3 + interval_s)
    if not timed_out and pushed:
        shortest = LOSS_SHORTEST_S
    return longest, shortest


LOSS_SHORTEST_S = 0.15
"""After a failure that is not a timeout, with answers pushed: the shortest wait for answers
before a quiet ``ANSWER_QUIET_S`` ends it (a loaded machine delays a listener by tens of ms)."""

_ASKS_READ = 64  # a polling publisher reads at most the newest this many asks it missed
_STALE_READ = 8  # the stale statuses read for members that never answered (the text names 3)


class GroupAsk(NamedTuple):
    """A member's part in a group ask (:meth:`StatusPublisher.ask_group`)."""

    key: str
    """The ask's store key (for :func:`collect`, :meth:`StatusPublisher.share` and
    :meth:`StatusPublisher.shared`)."""
    first: bool
    """Whether this member asked first: it collects the answers, diagnoses and shares the
    diagnosis; every other member waits for that."""


class StatusPublisher:
    """Publishes ``snapshot()`` under ``<prefix><rank>`` from a daemon thread.

    Args:
        store: where (the default group's store: it outlives a wedged communicator).
        prefix: the key prefix, ending in ``/``; ``<prefix>request`` is the request key.
        rank: this rank's global rank (the key's last part).
        snapshot: returns this rank's JSON-ready status; called from the thread.
        interval_s: seconds between two looks at the snapshot; the request key is looked at
            :data:`REQUEST_POLLS_PER_INTERVAL` times as often (:attr:`poll_s`).
        on_request: called from the thread with a request's payload (e.g. ``{"dump": dir}``)
            when another rank asks (:meth:`ask`, or :meth:`ask_group` where this rank answers).
        answer: ``answer(role, asker)``: this rank's compact answer about ``role`` (``{"status":
            {role: ..., another role in flight: ...}}``) when it is in ``asker``'s group of
            ``role``, else None (it does not answer); None: this rank answers no group ask.

    Each published value is ``{"t": wall seconds, "answered": request number, "status": ...}``.
    A reader knows a rank is alive when its ``answered`` reaches the number it asked with.
    """

    def __init__(self, store: Store, prefix: str, rank: int, snapshot: Callable[[], Any],
                 interval_s: float = DEFAULT_INTERVAL_S,
                 on_request: Callable[[dict[str, Any]], None] | None = None,
                 answer: Callable[[str, int], dict[str, Any] | None] | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.interval_s = interval_s
        self._snapshot = snapshot
        self.on_request = on_request
        self.answer = answer
        self._handled: set[int] = set()  # group asks answered (or not ours), by number
        self._answered_keys: set[str] = set()  # group asks this rank answered, by key
        self._shares: dict[str, dict[str, Any]] = {}  # ask key -> the asker's diagnosis
        self._shared = threading.Condition()
        self._handling = threading.Lock()  # the listener's thread and a polling one
        self._stop = threading.Event()
        self._lock = threading.Lock()  # publish_now from a failing call races the thread
        self._last: Any = None
        self._seen: Any = None  # the snapshot at the last look (publish_settled)
        self._published_at = float("-inf")  # monotonic time of the last publication
        self._released = False  # release() ran: nothing is written under the prefix again
        self._answered = 0
        self._thread: threading.Thread | None = None  # made by start(): 25 us a thread object
        self._emit: Callable[[dict[str, Any]], int] | None = None
        self._subscribe: Callable[[str, Callable[[dict[str, Any]], None] | None], None] | None = None
        self._every: Callable[[str, float, Callable[[], object] | None], None] | None = None
        self._known: Callable[[int], None] | None = None
        self._reader: Store | None = None  # a large group's join counters' reads (_read_all)
        self._reader_lock = threading.Lock()

    @property
    def poll_s(self) -> float:
        """Seconds between two looks at the request counter: how soon a live rank answers."""
        return self.interval_s / REQUEST_POLLS_PER_INTERVAL

    @property
    def key(self) -> str:
        """This rank's status key."""
        return f"{self.prefix}{self.rank}"

    def start(self) -> StatusPublisher:
        """Start the thread; it publishes once at once, then at ``interval_s``. (A publisher that
        listens through a heartbeat's thread needs none: :meth:`listen_through`.)

        The first publication is the thread's, not the caller's: a store round trip less on
        ``create()``'s path, where every rank waits for the slowest (0.5-2 ms each on 8 ranks
        sharing 2 cores). Until it lands (a millisecond or so) a diagnosis reads no status of
        this rank, as it reads none of a rank that has not reached create()'s end yet.
        """
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"commgroups-flight-{self.rank}")
        self._thread.start()
        return self

    def publish_now(self, force: bool = False) -> None:
        """Publish the snapshot if it changed (or ``force``); safe from any thread."""
        with self._lock:
            if self._released:
                return  # a late thread must not re-create a key release() deleted (a leak)
            status = self._snapshot()
            if not force and status == self._last:
                return
            self._write(status)

    def publish_settled(self) -> None:
        """The periodic look: publish the snapshot if it changed since the last publication and
        either stayed the same since the previous look or was last published :data:`REFRESH_S`
        ago; the first look publishes. Safe from any thread."""
        with self._lock:
            if self._released:
                return
            status = self._snapshot()
            moving, self._seen = status != self._seen, status
            if status == self._last or (
                    moving and time.monotonic() - self._published_at < REFRESH_S):
                return
            self._write(status)

    def _write(self, status: Any) -> None:
        """Publish ``status`` (under the lock)."""
        self._last, self._published_at = status, time.monotonic()
        value = {"t": time.time(), "answered": self._answered, "status": status}
        self.store.set(self.key, json.dumps(value, default=str))

    @property
    def pushed(self) -> bool:
        """Whether asks reach the members through their listeners (answered within milliseconds
        by a live rank) rather than through this thread's request polls."""
        return self._emit is not None

    def listen_through(self, emit: Callable[[dict[str, Any]], int],
                       subscribe: Callable[[str, Callable[[dict[str, Any]], None] | None], None],
                       every: Callable[[str, float, Callable[[], object] | None], None] | None
                       = None, known: Callable[[int], None] | None = None) -> None:
        """Hear asks as events (``subscribe(prefix, handler)``, called back from the listener's
        thread) and send them with ``emit``, instead of polling the request counter: every
        publisher of the prefix must do it alike (they do: the registry attaches each).

        ``every(prefix, interval_s, look)``: run the periodic look at the status from a thread
        the caller owns (the heartbeat's, :meth:`~commgroups.rank_loss.liveness.Liveness.every`;
        None stops it) instead of :meth:`start`'s thread: the first publication is made here,
        on the calling thread. Ignored where :meth:`start` ran already.

        ``known(number)``: tell the listener that event ``number`` is a group ask this rank
        joined and answered already (it need not read it: :meth:`ask_group`)."""
        self._emit, self._subscribe, self._known = emit, subscribe, known
        subscribe(self.prefix, self._heard)
        self._heard()  # an ask made before this publisher listened
        if every is not None and self._thread is None and not self._stop.is_set():
            self._every = every
            if self._look():
                every(self.prefix, self.interval_s, self._look)

    def _heard(self, event: dict[str, Any] | None = None) -> None:
        try:
            if event is not None and "d" in event:  # an asker's diagnosis, for its group
                self._take_share(str(event["q"]), event["d"])
            elif event is not None and "r" in event:  # a group ask: its fields are in the event
                self._answer_ask(event)
            else:
                self._poll()
        except Exception as error:  # the store went away, or a dump failed: keep listening
            logger.debug("flight recorder: answering an ask: %r", error)

    def ask(self, payload: dict[str, Any] | None = None) -> int:
        """Ask every publisher of ``prefix`` to publish now (and handle ``payload``); returns the
        request number their ``answered`` reaches once they did."""
        self.store.set(f"{self.prefix}request", json.dumps(payload or {}))
        number = int(self.store.add(f"{self.prefix}requests", 1))
        if self._emit is not None:
            self._emit({"k": "ask", "p": self.prefix})
        return number

    def ask_group(self, role: str, group: int, call: str,
                  payload: dict[str, Any] | None = None,
                  failed: Mapping[str, Any] | None = None,
                  members: Sequence[int] = ()) -> GroupAsk:
        """Ask the members of this rank's group of ``role`` (``group``: its lowest rank;
        ``members``: all of them, sorted) for their compact answers about ``role``, for the
        failed call ``call``, and give this rank's own; returns the ask (its key, and whether
        this rank asked first).

        One ask per role, group and call: the first of its members to ask emits it (``ask``
        event: prefix, role, asker, number, key, payload; kept under ``asked/<number>`` for a
        polling publisher or one that listened late), then collects the answers
        (:func:`collect`), diagnoses and shares the diagnosis (:meth:`share`); the others join
        it and wait for that (:meth:`shared`). Every member answers once, as it joins or when
        its listener hears the ask (:meth:`_answer_ask`, which also handles ``payload``, e.g. a
        dump), whichever comes first. ``failed``: the failed call (``op``, ``seq``,
        ``group_seq``), carried by the event.

        A member that reached exactly ``failed`` joins with one request that is also its
        answer: it adds its bit to its block's counter (:data:`BLOCK_MEMBERS` members each).
        The asker, once it emitted the ask, adds the event's number to every block's counter
        (one request per block), so a member that joins later learns it from its own add and
        its listener takes that event without reading it. Requests per member: one (two for
        the first in its block, before the asker marked it); for the asker, five and one per
        block. A member elsewhere (another role's call in flight) or a ``members`` left empty:
        an add and its answer appended."""
        key = f"ask/{role}/{group}/{call}"
        full = f"{self.prefix}{key}"
        wanted = {name: (failed or {}).get(name) for name in ("op", "seq", "group_seq")}
        with self._handling:
            if key in self._answered_keys:  # its listener heard the ask: not first, answered
                return GroupAsk(full, False)
        mine = self.answer(role, self.rank) if self.answer is not None else None
        index = bisect.bisect_left(members, self.rank)
        if (mine is not None and index < len(members) and members[index] == self.rank
                and _reached(mine, role, wanted) and self._claim(key)):
            block, bit = divmod(index, BLOCK_MEMBERS)
            value = int(self.store.add(f"{full}/joined/{block}", 1 << bit))
            if value >> _EVENT_SHIFT:  # the asker marked the block: the ask's event number
                if self._known is not None:
                    self._known(value >> _EVENT_SHIFT)
                return GroupAsk(full, False)
            if value != 1 << bit:  # another member of the block joined first: not the asker
                return GroupAsk(full, False)
            mine = None  # answered
        first = int(self.store.add(f"{full}/asks", 1)) == 1
        if first:
            number = int(self.store.add(f"{self.prefix}requests", 1))
            event = {"k": "ask", "p": self.prefix, "r": role, "a": self.rank, "n": number,
                     "q": key, "x": payload or {}, "c": wanted, "m": len(members)}
            self.store.set(f"{self.prefix}asked/{number}", json.dumps(event))
            with self._handling:  # its own listener skips it: it answers below, or did
                self._handled.add(number)
            emitted = self._emit(event) if self._emit is not None else 0
            self._note_event(emitted)
            # Every block's counter, once: a later joiner learns the event's number (and the
            # asker's collect reads the counters in one request, which needs them to exist).
            for block in range(-(-len(members) // BLOCK_MEMBERS)):
                self.store.add(f"{full}/joined/{block}", emitted << _EVENT_SHIFT)
        if mine is not None and self._claim(key):
            self._write_answer(key, mine, role, wanted)
        return GroupAsk(full, first)

    def _claim(self, key: str) -> bool:
        """Whether this rank is still to answer the ask ``key`` (it is from now on)."""
        with self._handling:
            if key in self._answered_keys:
                return False
            self._answered_keys.add(key)
            return True

    def _answer_ask(self, event: dict[str, Any]) -> None:
        """Answer a group ask where this rank is in the asker's group of its role: one append
        of the compact answer to the ask's answers; then handle the payload. Nothing (no
        request) where it is not in that group, or answered it already as it joined."""
        number = int(event["n"])
        with self._handling:
            if number in self._handled:
                return
            self._handled.add(number)
        if int(event["a"]) == self.rank or self.answer is None:
            return  # the asker answered its own ask
        mine = self.answer(str(event["r"]), int(event["a"]))
        if mine is None or not self._claim(str(event["q"])):
            return  # not in the asker's group of the role, or answered as it joined
        self._write_answer(str(event["q"]), mine, str(event["r"]), event.get("c") or {})
        payload = event.get("x") or {}
        if payload and self.on_request is not None:
            try:
                self.on_request(payload)
            except Exception:  # a failed dump must not end the publisher
                logger.exception("flight recorder: handling request %s failed", payload)

    def _write_answer(self, key: str, answer: dict[str, Any], role: str,
                      failed: Mapping[str, Any]) -> None:
        line = (str(self.rank) if _reached(answer, role, failed) else
                json.dumps({"r": self.rank, **answer}, separators=(",", ":"), default=str))
        with self._lock:
            if self._released:
                return  # the ask's keys may be deleted: an answer now would leak one
            # Store.append: at runtime on 2.10-2.15, missing from some releases' stubs.
            self.store.append(f"{self.prefix}{key}/answers", line + "\n")  # type: ignore[attr-defined,unused-ignore]

    def share(self, key: str, diagnosis: dict[str, Any]) -> None:
        """The asker's diagnosis of the ask ``key`` (:meth:`Diagnosis.share
        <commgroups.flight_recorder.diagnosis.Diagnosis.share>`), for the members that wait
        for it (:meth:`shared`): kept under ``<key>/diagnosis`` and pushed as an event (two
        requests each, one more for every listener)."""
        value = json.dumps(diagnosis, separators=(",", ":"), default=str)
        with self._lock:
            if self._released:
                return
            self.store.set(f"{key}/diagnosis", value)
        if self._emit is not None:
            self._note_event(self._emit({"k": "ask", "p": self.prefix, "q": key, "d": diagnosis}))

    def _note_event(self, number: int) -> None:
        """Note listener event ``number`` under ``events``, for the last rank to release to
        hand back (:meth:`release`): every rank's listener read it, so only the job can delete
        it, once every listener is past it (one append per ask or shared diagnosis: a few per
        failed call). They stayed until the registry closed before: two keys per diagnosed
        hang, four over a ten-rebuild test on loaded cores."""
        if number <= 0:
            return
        with self._lock:
            if not self._released:  # released meanwhile: the append would leave a key
                append_numbers(self.store, f"{self.prefix}events", [number])

    def _take_share(self, key: str, diagnosis: dict[str, Any]) -> None:
        """Keep the asker's diagnosis of ``key`` where this rank answered that ask (a member
        of its group: it waits, or will, in :meth:`shared`)."""
        with self._handling:
            if key.removeprefix(self.prefix) not in self._answered_keys:
                return
        with self._shared:
            self._shares[key] = diagnosis
            self._shared.notify_all()

    def shared(self, key: str, wait_s: float, stop: Callable[[], bool] = lambda: False,
               accept: Callable[[dict[str, Any]], bool] = lambda share: True
               ) -> dict[str, Any] | None:
        """The asker's diagnosis of the ask ``key`` (:meth:`share`), waited for up to
        ``wait_s``, and :data:`SHARE_GRACE_S` more once ``stop()``; None where none came (the
        asker died while it diagnosed). Pushed: no request until then, one read at the end
        where the event did not come; polling (no listener): one read every
        :data:`ANSWER_LOOK_S`. A diagnosis that ``accept`` refuses is passed over (a member
        that took over re-shares: :meth:`take_over`)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._shared:
                found = self._shares.pop(key, None)
                if found is None:
                    self._shared.wait(ANSWER_LOOK_S)
                    found = self._shares.pop(key, None)
            if found is not None and accept(found):
                return found
            now = time.monotonic()
            if self._emit is None or now >= deadline:
                value = read_if_present(self.store, f"{key}/diagnosis")
                if value is not None:
                    parsed: dict[str, Any] = json.loads(value)
                    if accept(parsed):
                        return parsed
                if now >= deadline:
                    return None
            if stop():
                deadline = min(deadline, now + SHARE_GRACE_S)

    def take_over(self, key: str) -> bool:
        """Whether this member diagnoses the ask ``key`` in its asker's place (the first member
        to ask: one add), where the asker gave no diagnosis in time (it died) or one this
        member must collect again; the others wait for its :meth:`share`. Every member reading
        the answers instead was O(N) each, O(N^2) for the group: 26 GB of store reads for a
        group of 65,536 whose asker died."""
        return int(self.store.add(f"{key}/takeover", 1)) == 1

    def _poll(self) -> None:
        # The counter, not the request key, says how many asks there were: two ranks asking at
        # once may leave the key at the older number, and the newer asker must see an answer.
        # Read, never add(0): a poll must not re-create a key the last rank to close deleted.
        number = self._requests()
        if number <= self._answered:
            return
        first, self._answered = self._answered + 1, number
        legacy = False  # an ask of every publisher (ask()): publish the whole status
        for asked in range(max(first, number - _ASKS_READ + 1), number + 1):
            with self._handling:
                if asked in self._handled:
                    continue
            record = read_if_present(self.store, f"{self.prefix}asked/{asked}")
            if record is None:
                legacy = True
            else:
                self._answer_ask(json.loads(record))
        if not legacy:
            return
        payload = read_if_present(self.store, f"{self.prefix}request")
        request = json.loads(payload) if payload is not None else {}
        if self.on_request is not None:
            try:
                self.on_request(request)
            except Exception:  # a failed dump must not end the publisher
                logger.exception("flight recorder: handling request %s failed", request)
        self.publish_now(force=True)

    def _look(self) -> bool:
        """Publish the status if it changed and settled (:meth:`publish_settled`); on a store
        failure (its host died) say so and stop looking. Returns whether it goes on."""
        try:
            self.publish_settled()
        except Exception as error:  # the store went away (its host died): stop quietly
            logger.warning("flight recorder publisher stops: %r", error)
            if self._every is not None:
                self._every(self.prefix, self.interval_s, None)
            return False
        return True

    def _run(self) -> None:
        polls = 0
        if not self._look():
            return
        while not self._stop.wait(self.interval_s if self._emit is not None else self.poll_s):
            try:
                if self._emit is not None:  # asks come as events: only publish a change
                    self.publish_settled()
                    continue
                self._poll()
                polls += 1
                if polls % REQUEST_POLLS_PER_INTERVAL == 0:
                    self.publish_settled()
            except Exception as error:  # the store went away (its host died): stop quietly
                logger.warning("flight recorder publisher stops: %r", error)
                return

    def stop(self, release: bool = True, members: int = 0) -> None:
        """Stop the thread; ``release``: :meth:`release` the keys (``close()``)."""
        self._stop.set()
        if self._subscribe is not None:
            self._subscribe(self.prefix, None)
        if self._every is not None:
            self._every(self.prefix, self.interval_s, None)
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 2 * self.interval_s))
        with self._reader_lock:
            self._reader = None  # its connection closes with it
        if release:
            self.release(members)

    def release(self, members: int, lost: tuple[int, ...] = ()) -> list[int]:
        """Delete this rank's key and, on the last of ``members`` ranks to release, the request
        keys they share and the keys of the ``lost`` ranks (dead: they never delete theirs).
        Every publisher of the prefix has stopped by then, so nothing writes them again.

        Returns, on the last rank to release, the numbers of the listener events the asks sent
        (:meth:`_note_event`), for the caller to delete once every listener is past them (a
        generation later: ``Liveness.forget``); else nothing."""
        with self._lock:  # no publish or answer is under way, and none follows
            self._released = True
        events: list[int] = []
        try:
            self.store.delete_key(self.key)
            if members and int(self.store.add(f"{self.prefix}closed", 1)) >= members:
                self._release_asks()
                events = read_numbers(self.store, f"{self.prefix}events")
                # spoken: the failed calls whose diagnosis one rank printed
                for name in ("request", "requests", "closed", "spoken", "events",
                             *map(str, lost)):
                    self.store.delete_key(f"{self.prefix}{name}")
        except Exception as error:  # the store may be gone with the job
            logger.debug("flight recorder: releasing %s: %s", self.key, error)
        return events


    def _requests(self) -> int:
        """How many asks were made of this prefix (0 before the first, or after the release).

        One read that never waits: a ``check`` then a ``get`` waited out the store's timeout
        (120 s in the tests' worlds) when the last member released the counter between the
        two, and held the job's shared connection, every other thread's requests with it, as
        long (CI: a rebuilt rank missed its first collective, its flight status went stale)."""
        value = read_if_present(self.store, f"{self.prefix}requests")
        return int(value) if value is not None else 0

    def _release_asks(self) -> None:
        """Delete the group asks' records and answers (the last member to release: a few asks,
        one per failed call diagnosed)."""
        for asked in range(1, self._requests() + 1):
            record = read_if_present(self.store, f"{self.prefix}asked/{asked}")
            if record is None:
                continue
            ask = json.loads(record)
            key = f"{self.prefix}{ask['q']}"
            blocks = -(-int(ask.get("m", 0)) // BLOCK_MEMBERS)
            for name in (f"{self.prefix}asked/{asked}", f"{key}/asks", f"{key}/answers",
                         f"{key}/diagnosis", f"{key}/takeover",
                         *(f"{key}/joined/{block}" for block in range(blocks))):
                self.store.delete_key(name)

    def answers(self, key: str) -> bytes:
        """The answers to the group ask ``key`` so far, one line each (one request; see
        :func:`parse_answers`)."""
        value = read_bytes_if_present(self.store, f"{key}/answers")
        return b"" if value is None else value

    def joined(self, key: str, members: int) -> list[int]:
        """The join counters of the group ask ``key`` of ``members`` members, each masked to
        its members' bits (:meth:`ask_group`): one read per counter that never waits, up to
        three counters (93 members); beyond, three requests (a check, then torch's
        ``multi_get``, which waits then reads), or one per counter where the asker has not
        created them all (it died first).

        The ``multi_get`` would wait for counters that the last member's release deleted
        between the check and it (a member judged lost while it still collects): it runs on a
        connection of its own that waits :data:`JOINED_WAIT_S` at most (the job's shared one,
        every thread's requests behind it, waited out the store's timeout), and the counters
        are then read one by one, as gone."""
        keys = [f"{key}/joined/{block}" for block in range(-(-members // BLOCK_MEMBERS))]
        if not keys:
            return []
        values = None
        if len(keys) > 3 and self.store.check(keys):
            values = self._read_all(keys)
        if values is None:
            values = [read_bytes_if_present(self.store, name) or b"0" for name in keys]
        return [int(value) & _BLOCK_MASK for value in values]

    def _read_all(self, keys: list[str]) -> list[bytes] | None:
        """``keys``' values in one ``multi_get``, on a connection of this publisher's (made at
        the first such read) that waits at most :data:`JOINED_WAIT_S`; None where one went
        meanwhile (the connection is then dropped: a timed-out wait may still be answered on
        it) or where the store cannot clone."""
        with self._reader_lock:
            try:
                if self._reader is None:
                    self._reader = self.store.clone()  # type: ignore[attr-defined,unused-ignore]
                    self._reader.set_timeout(timedelta(seconds=JOINED_WAIT_S))
                return [bytes(value) for value in self._reader.multi_get(keys)]
            except (RuntimeError, AttributeError, NotImplementedError):  # gone; no clone
                self._reader = None
                return None


def _reached(answer: Mapping[str, Any], role: str, failed: Mapping[str, Any]) -> bool:
    """Whether ``answer`` says exactly "at the failed call, in no other role's call": its rank
    alone says it (the asker rebuilds it from ``failed``)."""
    status = answer.get("status") or {}
    mine = status.get(role) or {}
    last = mine.get("last") or {}
    return (len(status) == 1 and failed.get("op") is not None
            and mine.get("seq") == failed.get("seq")
            and mine.get("group_seq") == failed.get("group_seq")
            and last.get("op") == failed.get("op") and last.get("seq") == failed.get("seq")
            and last.get("group_seq") == failed.get("group_seq"))


def parse_answers(value: bytes, role: str, failed: Mapping[str, Any],
                  joined: Iterable[int] = ()) -> dict[int, dict[str, Any]]:
    """rank -> compact answer, from :meth:`StatusPublisher.answers` (a rank alone: it reached
    ``failed`` on ``role``, its last call that one; where it was issued is not sent) and the
    ranks that ``joined`` the ask (:meth:`StatusPublisher.joined`: they reached it too)."""
    reached = {"status": {role: {"seq": failed.get("seq"), "group_seq": failed.get("group_seq")}}}
    out: dict[int, dict[str, Any]] = dict.fromkeys(joined, reached)
    for line in value.decode().splitlines():
        if line.isdigit():
            out[int(line)] = reached
        elif line:
            answer = json.loads(line)
            out[int(answer.pop("r"))] = answer
    return out


def collect(publisher: StatusPublisher, key: str, ranks: Sequence[int], role: str,
            failed: Mapping[str, Any], *, wait_s: float, shortest_s: float,
            stop: Callable[[], bool] = lambda: False) -> dict[int, Mapping[str, Any] | None]:
    """Wait for the answers to the group ask ``key`` (:meth:`StatusPublisher.ask_group`) from
    every one of ``ranks`` (the group, the asker too), then read them once; returns what
    :func:`~commgroups.flight_recorder.diagnosis.diagnose` takes (rank -> ``{"answered": 1,
    "status": ...}``, one value shared by the members that answered alike: read it, never change
    it; ``answered`` 0 for a member that never answered, with its last published status where it
    has one; None for one that has none: it closed its registry).

    ``ranks``: sorted, as :meth:`StatusPublisher.ask_group` was given them. Reads the answers
    and the join counters (:meth:`StatusPublisher.joined`), four requests per look every
    :data:`ANSWER_LOOK_S` (or as long as the last look took, where answers are many), until
    every member answered, ``stop()``, ``wait_s`` passed, or ``shortest_s`` passed and no
    answer came for :data:`ANSWER_QUIET_S`."""
    start = moved = time.monotonic()
    seen = -1
    while True:
        looked = time.monotonic()
        value = publisher.answers(key)
        blocks = publisher.joined(key, len(ranks))
        count = value.count(b"\n") + sum(block.bit_count() for block in blocks)
        now = time.monotonic()
        if count != seen:
            seen, moved = count, now
        if count >= len(ranks) or stop() or now - start > wait_s or (
                now - start > shortest_s and now - moved > ANSWER_QUIET_S):
            break
        time.sleep(max(ANSWER_LOOK_S, now - looked))
    joined = (ranks[block * BLOCK_MEMBERS + bit] for block, bits in enumerate(blocks)
              for bit in range(BLOCK_MEMBERS) if bits >> bit & 1)
    answers = parse_answers(value, role, failed, joined)
    published: dict[int, Mapping[str, Any] | None] = {}
    # One value per distinct answer, shared by the ranks that gave it (parse_answers shares
    # "reached at the failed call"): 65,536 members, one dict instead of 65,535.
    answered: dict[int, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    missing = 0
    for rank in ranks:
        if rank == publisher.rank:
            continue
        answer = answers.get(rank)
        if answer is not None:
            shared = answered.get(id(answer))
            if shared is None or shared[0] is not answer:
                shared = answered[id(answer)] = (answer, {"answered": 1, **answer})
            published[rank] = shared[1]
            continue
        missing += 1  # silent: its last published status says where it was, if it has one
        stale = (read_status(publisher.store, publisher.prefix, rank)
                 if missing <= _STALE_READ else {})
        published[rank] = None if stale is None else {**stale, "answered": 0}
    return published


def read_status(store: Store, prefix: str, rank: int) -> dict[str, Any] | None:
    """What rank ``rank`` last published under ``prefix``, or None (never published, or gone)."""
    key = f"{prefix}{rank}"
    try:
        text = read_if_present(store, key)  # never a get: the rank may release it meanwhile
        if text is None:
            return None
        value: dict[str, Any] = json.loads(text)
    except Exception as error:  # the store's host died: nothing to read
        logger.debug("flight recorder: reading %s: %s", key, error)
        return None
    return value
