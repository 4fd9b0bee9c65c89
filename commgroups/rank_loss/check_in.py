"""The survivors' check-in after a rank loss: every survivor learns the same set of lost ranks, at a
store cost per rank that does not grow with the job.

Each survivor appends its global rank to one list (``joined``) and adds 1 to a counter (``count``).
The first rank in is the decider: it alone looks at the check-in (every 20 ms: the counter, and the
lists only when the counter moved), and it decides exactly once, by one compare-and-set on the key
``decided``, as soon as:

- every rank it expects (``expected``: the ranks the caller knows to be alive, else every member
  of the old generation) checked in; or
- without ``expected``, with a listening thread per rank
  (:class:`~commgroups.rank_loss.liveness.Liveness`): every absent member left the loss report
  unanswered for ``dead_after_s``. A live rank's thread answers within milliseconds, wherever its
  main thread is, so nobody waits for a window to end and an absent rank that answered is waited
  for. A rank the caller listed in ``expected`` is never counted dead: only the window ends the
  wait for it; or
- its window (counted from its own check-in, the backstop) ended: the ranks in by then are the
  survivors, if they are a majority of the live members (an absent member that is listed, or
  answered the loss report, is alive; with heartbeats off nothing says who is dead, so of every
  member). A minority decides nothing and raises: a lone ``rebuild()`` never splits the job.

The decision names the ranks *out* (members that did not check in): a few, where the list of
survivors would be the whole job. The decider pushes it to every rank as one listener event
(``decided``), so all get the same answer and no follower polls or blocks a store connection
(a blocked store wait would hold the connection the beat and the flight recorder share); without
a listener (no TCPStore) a follower reads ``decided`` every 50 ms. A follower whose window ends
first takes the decider's last look itself (the decider may have died). A rank that checks in
after the decision is out and raises :class:`~commgroups.errors.LeftOutError` (the others
rebuilt without it); it never forms a world of its own. Only the store is used (no process
group: the old groups hold a dead rank).

Cost per follower, whatever the job's size: two requests of constant size (the append, the add),
plus its listener's two for the decision event (the wait, the read; one per host with the host
relay). The first rank in also reads the made-generation key: its add alone cannot tell a fresh
check-in from one whose keys were forgotten a generation after its decision (every later rank's
add finds the check-in live, or decided: :data:`DECIDED_MARK`).
The decider adds :data:`DECIDED_MARK` to the counter as it decides, so a follower's own add says
whether it came after the decision (then it reads ``decided``: it is out) or before (then the
pushed event reaches it). The decider's reads of the two lists (O(N) bytes, one rank) happen
only when the counter moved.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # re-exported

from commgroups.creation.agreement import store_calls
from commgroups.errors import AttemptClosed, LeftOutError, RebuildError
from commgroups.layout import limits
from commgroups.layout.specs import Layout
from commgroups.util.store_reads import (
    append_numbers,
    parse_numbers,
    read_if_present,
    read_numbers,
)

__all__ = ["AGREED", "CLOSED_MARK", "DECIDED_MARK", "Answers", "CheckIn", "check_in",
           "check_in_at_open_attempt", "check_in_window", "close_check_in_attempt",
           "forget_check_ins", "open_check_in_attempt", "record_made", "window_slack_s"]

_JOINED = "joined"
_COUNT = "count"
_DECIDED = "decided"
_EVENT = "event"  # the number of the listener event that pushed the decision
AGREED = "agreed"
"""The key, beside a rebuild's check-ins, listing the events that announced its agreements'
outcomes (:mod:`~commgroups.rank_loss.attempt_channel`): deleted with the check-ins."""
_POLL_S = 0.02  # between the decider's looks: the decision waits at most this much longer
_POLL_FOLLOWER_S = 0.05  # between a follower's reads of the decision, without a listener
_REREAD_S = 0.25  # the decider's lists at most this often while more ranks answered than joined
_MAX_CLOSED_ATTEMPTS = 100  # a rank sent on this often: something closes attempts in a loop
DECIDED_MARK = 1 << 32
"""What the decider adds to the check-in's counter once its decision holds: a rank whose own
add returns at least this checked in after the decision (check-ins stay below it)."""
CLOSED_MARK = 1 << 40
"""What each rank that closes an attempt (:func:`close_check_in_attempt`: it was decided, then
its generation failed to be made) adds to the attempt's counter: a rank whose own add returns at
least this checked in to a closed attempt (:class:`AttemptClosed`). Check-ins and the decider's
one :data:`DECIDED_MARK` stay below it; 2**20 closing ranks stay below 2**63."""


class Answers(Protocol):
    """Who answered a loss report, and the channel a decision is pushed through
    (:class:`~commgroups.rank_loss.liveness.Liveness` is one)."""

    dead_after_s: float
    """How long an unanswered report counts as nothing yet; after it, as death."""

    def answered(self, generation: int, ranks: Collection[int]) -> set[int]:
        """Which of ``ranks`` answered generation ``generation``'s loss report."""

    def answers(self, generation: int) -> int:
        """How many ranks answered generation ``generation``'s loss report so far."""

    def confirmed_dead(self, generation: int) -> set[int]:
        """The ranks a peer on their host saw gone since generation ``generation``'s report."""

    @property
    def listening(self) -> bool:
        """Whether events reach this rank (else the check-in polls for the decision)."""

    def emit(self, event: dict[str, Any]) -> int:
        """Send ``event`` to every rank's listener; returns its number."""

    def expect(self, prefix: str, handler: Callable[[dict[str, Any]], None] | None) -> None:
        """Have the listener call ``handler`` with the ``decided`` event of ``prefix``."""


class CheckIn:
    """One rank's check-in toward the next generation, in steps (:meth:`join`, :meth:`look`,
    :meth:`await_decision`) that :func:`check_in` runs in order; the benchmark drives them for
    many simulated ranks at once.

    Args: as :func:`check_in`.
    """

    def __init__(self, root: Store, prefix: str, rank: int, members: Collection[int],
                 window: timedelta, expected: Sequence[int] | None = None,
                 liveness: Answers | None = None, made_key: str | None = None,
                 generation: int = 0) -> None:
        self.root = root
        self.prefix = prefix
        self.store = PrefixStore(prefix, root)
        self.rank = rank
        self.members = frozenset(members)
        self.window = window
        self.expected = None if expected is None else frozenset(expected)
        self.liveness = liveness
        self.made_key = made_key
        self.generation = generation
        self.started = time.monotonic()
        self.deadline = self.started + window.total_seconds()
        self._count = -1
        self._unread = False  # the count moved since the lists were last read
        self._judged = False  # deaths were judged once (then again only when the count moves)
        self._answers = -1  # the loss report's answers at the last look, and since when
        self._answers_at = self.started
        self._confirmed: frozenset[int] = frozenset()  # dead by a host-local peer's look
        self._joined: frozenset[int] = frozenset()
        self._read_at = float("-inf")  # when the decider last read the lists
        self._absent_alive: list[int] = []
        self._pushed = threading.Event()  # set by the listener's thread with the decision
        self._pushed_out: frozenset[int] = frozenset()
        self._push = liveness is not None and liveness.listening
        self._early: frozenset[int] | None = None

    def join(self) -> bool:
        """Check in (two requests; the first rank in reads the made-generation key too); True
        where this rank is the first in (the decider).

        Raises LeftOutError at once where a generation newer than ours was made already, or
        where this attempt was decided without this rank (closed or not), and AttemptClosed
        where this attempt was closed (its generation failed to be made) with this rank in."""
        self.started = self._answers_at = time.monotonic()
        self.deadline = self.started + self.window.total_seconds()
        if self._push:
            assert self.liveness is not None
            self.liveness.expect(self.prefix, self._heard)  # before joining: nothing is missed
        append_numbers(self.store, _JOINED, [self.rank])
        count = int(self.store.add(_COUNT, 1))
        if count >= CLOSED_MARK:  # decided, and its generation failed: the next one is open
            self._stop_listening()
            # Its survivors retry among themselves (the next attempt's members are theirs), so a
            # rank it decided out is out: sent on, it would take the next decision, made over
            # members without it, as one that left it in (a survivor set of its own: a split).
            # Two requests, only on this path; None where the keys were forgotten (the made
            # key tells then).
            decided = self._decided()
            if decided is not None:
                self.outcome(decided)  # LeftOutError where this rank is out
            raise AttemptClosed(self.prefix)
        if count >= DECIDED_MARK:  # decided before this rank listened: read, never pushed
            self._early = self._decided()
        elif count == 1:
            # First in: a live check-in, or one decided so long ago that its keys were forgotten
            # (forget_check_ins, a generation later) and this add made them anew. Only the
            # made-generation key tells; every later rank's add found a live, undecided
            # check-in (a newer generation needs this one decided), so only this rank reads it.
            # A rank that also came in after the forgetting, between this add and the delete
            # below, waits as a follower and reads the key as its window ends.
            try:
                self._left_out_by_made()
            except LeftOutError:
                self._stop_listening()
                for key in (_JOINED, _COUNT):  # made anew by this rank's append and add
                    with contextlib.suppress(RuntimeError):
                        self.store.delete_key(key)
                raise
        # Otherwise the decider's add of DECIDED_MARK comes after this rank's, and its event after
        # that: the listener, expecting since before the add, hears it.
        return count == 1

    def look(self, final: bool = False) -> frozenset[int] | None:
        """The decider's look: the ranks out if decided now (by this look or before), else None.

        ``final`` (or the window's end): decide by majority, or raise RebuildError."""
        # One clock reading per look: under load a look takes a while, and the window's end must
        # never be judged before the answers were (every live absent rank would then count as
        # alive and no majority would decide).
        now = time.monotonic()
        final = final or now >= self.deadline
        wanted = self.expected if self.expected is not None else self.members
        liveness = self.liveness if self.expected is None else None
        judge_deaths = confirmed_moved = False
        if liveness is not None:
            # A rank whose process a peer on its host saw gone is dead now, not after
            # dead_after_s (one read per look, by the decider only).
            confirmed = frozenset(liveness.confirmed_dead(self.generation)) & wanted
            confirmed_moved, self._confirmed = confirmed != self._confirmed, confirmed
            # Absent ranks count as dead once dead_after_s passed and the answers stopped
            # arriving for a tenth of it: at 65,536 ranks the store takes seconds to take them
            # all (100,000 a second here: no gap of 0.1 s while they stream), and a live rank
            # whose answer is still queued must not be counted dead. Half of it cost 8 ranks
            # 0.3 s of every rebuild on loaded cores, where answers trickle in.
            answers = liveness.answers(self.generation)
            if answers != self._answers:
                self._answers, self._answers_at = answers, now
            judge_deaths = final or (now - self.started >= liveness.dead_after_s
                                     and now - self._answers_at >= liveness.dead_after_s / 10)
        count = int(self.store.add(_COUNT, 0)) % DECIDED_MARK
        # Moved since the lists were last read, not since the last look: a join seen on a look
        # that may not read (catching up) is acted on at the next look that may. Taken as seen
        # on every look, the last live rank's join could be used up there, and with a dead rank
        # nobody confirmed, no later look read the lists before the window's end (6 s against
        # 0.24 s in a one-process check-in whose answers outnumbered the live ranks).
        self._unread = self._unread or count != self._count
        moved, self._count = self._unread, count
        # The lists are read only when they can decide something: a count below what is wanted
        # decides nothing until deaths are judged (at 65,536 ranks a list is 400 kB). Judging
        # deaths, nothing is decided while more ranks answered than checked in (an alive rank
        # is missing: answers lead check-ins while they stream in, for seconds at 65,536
        # ranks), so the lists are read then at most every _REREAD_S, not at every look: 300
        # reads of 400 kB in one 65,536-rank check-in before.
        catching_up = (self._answers > count + len(self._confirmed)
                       and now - self._read_at < _REREAD_S)
        due = final or ((moved or confirmed_moved)
                        and count >= len(wanted) - len(self._confirmed)) or (
            judge_deaths and (moved or not self._judged) and not catching_up)
        if not due:
            return self._decided()
        self._read_at, self._unread = now, False
        self._judged = self._judged or judge_deaths
        self._joined = self._read_joined()
        missing = wanted - self._joined
        dead = set(missing & self._confirmed)
        if missing - dead and liveness is not None and judge_deaths:
            dead |= set(missing) - liveness.answered(self.generation, missing)
        if not missing or missing <= dead:
            return self._decide(self._joined)
        if not final:
            return self._decided()
        # Listed ranks are alive by the caller's word; others, if they answered. Without a
        # listener or a list (heartbeats off) nothing says an absent member is dead: each may be
        # alive, so the ranks in decide only as a majority of every member (a lone rebuild() on
        # one rank would else decide a world of its own: a split).
        self._absent_alive = (sorted(r for r in missing if r not in dead)
                              if self.liveness is not None or self.expected is not None
                              else sorted(missing))
        if len(self._joined) <= len(self._absent_alive):
            decided = self._decided()  # another rank may have decided meanwhile
            if decided is not None:
                return decided
            raise RebuildError(
                f"rank {self.rank}: ranks {_short(self._absent_alive)} are alive but did not call "
                f"rebuild() within {self.window.total_seconds():g}s, and the {len(self._joined)} "
                "in are no majority; nothing was decided. fix: call rebuild() on every rank")
        return self._decide(self._joined)

    def await_decision(self) -> frozenset[int]:
        """A follower's wait for the decision (:meth:`join` read it once, for a decision made
        before this rank listened): pushed through the listener, else read every
        :data:`_POLL_FOLLOWER_S`. Where this rank's window ends first, it takes the last look
        itself (the decider may be dead)."""
        try:
            out = self._early
            while out is None:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self._left_out_by_made()
                    out = self.look(final=True)
                    assert out is not None  # a final look decides or raises
                elif self._push:
                    # Never a store wait here: it would hold the job's shared connection (the
                    # beat's and the flight recorder's) for as long as it waits.
                    if self._pushed.wait(remaining):
                        out = self._pushed_out
                else:
                    time.sleep(min(remaining, _POLL_FOLLOWER_S))
                    out = self._decided()
            return out
        finally:
            self._stop_listening()

    def _heard(self, event: dict[str, Any]) -> None:
        """The listener's thread: the decision arrived."""
        self._pushed_out = frozenset(int(rank) for rank in event.get("out", ()))
        self._pushed.set()

    def _stop_listening(self) -> None:
        if self._push and self.liveness is not None:
            self.liveness.expect(self.prefix, None)

    def outcome(self, out: frozenset[int]) -> tuple[int, ...]:
        """The survivors, ascending; LeftOutError where this rank is out."""
        if self.rank in out:
            survivors = len(self.members) - len(out)
            raise LeftOutError(
                f"rank {self.rank}: checked in to rebuild() after the {survivors} survivors were "
                "decided without it; this rank is out of the job. fix: exit, or give rebuild() a "
                "longer timeout= (its check-in window)")
        return tuple(sorted(self.members - out))

    def _read_joined(self) -> frozenset[int]:
        return frozenset(parse_numbers(bytes(self.store.get(_JOINED)).decode())) & self.members

    def _decide(self, joined: frozenset[int]) -> frozenset[int]:
        """Propose the members not in ``joined`` as out; returns what holds (ours, or older)."""
        out = sorted(self.members - joined)
        proposal = json.dumps({"out": out})
        held = bytes(self.store.compare_set(_DECIDED, "", proposal)).decode()
        if held == proposal:
            # Ours holds: a rank that checks in from now on learns it from its own add (join),
            # before the event, so every follower either hears the event or reads the decision.
            self.store.add(_COUNT, DECIDED_MARK)
            if self.liveness is not None:
                # Push it to every follower (one event: two requests), and say which event it
                # was (forget_check_ins deletes it a generation later).
                number = self.liveness.emit({"k": "decided", "p": self.prefix, "out": out})
                self.store.set(_EVENT, str(number))
        return frozenset(json.loads(held)["out"])

    def _decided(self) -> frozenset[int] | None:
        # check first: a compare_set read of the missing key would wake every follower. Then a
        # read that never waits, not get(): forget_check_ins may delete the key between the two.
        if not self.store.check([_DECIDED]):
            return None
        decided = read_if_present(self.store, _DECIDED)
        return None if decided is None else frozenset(json.loads(decided)["out"])

    def _left_out_by_made(self) -> None:
        """A generation newer than ours was made: this check-in was decided long ago and its keys
        may be gone; this rank is out (were it in that generation, it would be at it)."""
        if self.made_key is None:
            return
        value = read_if_present(self.root, self.made_key)
        if value is None:
            return
        made = json.loads(value)
        if made["generation"] > self.generation:
            raise LeftOutError(
                f"rank {self.rank}: generation {made['generation']} was made by {made['size']} "
                f"ranks without it while this rank was at generation {self.generation}; this rank "
                "is out of the job. fix: exit, or give rebuild() a longer timeout= (its check-in "
                "window)")


def check_in(
    root: Store,
    prefix: str,
    rank: int,
    members: Sequence[int],
    window: timedelta,
    expected: Sequence[int] | None = None,
    liveness: Answers | None = None,
    made_key: str | None = None,
    generation: int = 0,
) -> tuple[int, ...]:
    """Check ``rank`` in under ``prefix`` and return the decided survivors (global ranks, ascending).

    Args:
        root: the job's store (the default group's); it must outlive the lost ranks (host it outside
            the training ranks: torchrun's agent or a dedicated process).
        prefix: a namespace every survivor of this rebuild attempt uses, and no other attempt.
        rank: this rank's global rank.
        members: the old generation's global ranks (the only ranks that may check in).
        window: how long this rank waits, from its own check-in, for the others (the backstop).
        expected: ranks known to be alive; the set is decided as soon as all of them are in.
        liveness: who answered the loss report (the ranks' listening threads): without
            ``expected``, the set is decided as soon as every member is in or left generation
            ``generation``'s loss report unanswered for its ``dead_after_s``; at the window's end
            only a majority of the live members decides.
        made_key: where the survivors record the last generation they made (:func:`record_made`);
            one newer than ``generation`` (this rank's) means this check-in was decided long ago
            and its keys may be gone: this rank is out.
        generation: the number of the generation this rank is rebuilding from.

    Raises:
        LeftOutError: this rank checked in after the set was decided without it.
        AttemptClosed: this attempt was decided and then closed (:func:`close_check_in_attempt`):
            check in again at the open one.
        RebuildError: the window ended with the ranks in a minority of the live members (nothing
            decided).
        StoreUnreachableError: the store stopped answering (its host died).
    """
    attempt = CheckIn(root, prefix, rank, members, window, expected, liveness, made_key,
                      generation)
    with store_calls(root, rank, time.monotonic(), "registry.rebuild()'s check-in"):
        if attempt.join():
            try:
                out = attempt.look()
                while out is None:
                    time.sleep(_POLL_S)
                    out = attempt.look()
            finally:
                attempt._stop_listening()
        else:
            out = attempt.await_decision()
    return attempt.outcome(out)


def open_check_in_attempt(root: Store, prefix: str) -> int:
    """The check-in attempt under ``prefix`` that is open now (0 until one failed; one request).
    The attempt's keys are under ``prefix + f"{attempt}/"``.

    Every rank that checks in toward a generation uses the store's open attempt, whatever failed
    where before (a count kept per rank drifted apart under load, and two attempts decided two
    worlds: a split). A rank that closed none toward it need not read it: it checks in to attempt
    0, and its own add there says whether that was closed (:class:`AttemptClosed`), as
    :func:`check_in_at_open_attempt` does."""
    return int(root.add(f"{prefix}open", 0))


def close_check_in_attempt(root: Store, prefix: str, attempt: int) -> None:
    """After attempt ``attempt`` under ``prefix`` was decided and then failed here: mark it closed
    (:data:`CLOSED_MARK` on its counter: a rank that checks in to it later is sent on), then open
    the next one, for every rank (once, whoever moves it first; a store that died is left
    alone). In that order: a rank sent on never finds the open attempt behind the mark for
    longer than the two requests between."""
    with contextlib.suppress(RuntimeError):
        PrefixStore(f"{prefix}{attempt}/", root).add(_COUNT, CLOSED_MARK)  # as CheckIn's keys
        root.add(f"{prefix}open", 0)  # compare_set moves a key that exists, never a missing one
        root.compare_set(f"{prefix}open", str(attempt), str(attempt + 1))


def check_in_at_open_attempt(root: Store, prefix: str, first: int, rank: int,
                             check: Callable[[str], tuple[int, ...]],
                             ) -> tuple[tuple[int, ...], int]:
    """``check`` (:func:`check_in` with every argument but its prefix bound) under
    ``prefix + f"{attempt}/"`` for the open attempt, starting at ``first`` (0 where this rank
    closed no attempt toward this generation: no read, one request a rank fewer; else
    :func:`open_check_in_attempt`'s), sent on by :class:`AttemptClosed` to the one open now;
    returns the survivors and the attempt that decided them. ``rank``: this rank, for errors."""
    attempt = first
    for _ in range(_MAX_CLOSED_ATTEMPTS):
        try:
            return check(f"{prefix}{attempt}/"), attempt
        except AttemptClosed:
            opened = open_check_in_attempt(root, prefix)
            if opened <= attempt:
                # Marked closed, not moved on: its closer is between its two requests, or died
                # there. Move it on as the closer would (a compare-and-set: once, by anyone).
                close_check_in_attempt(root, prefix, attempt)
                opened = open_check_in_attempt(root, prefix)
            attempt = max(opened, attempt + 1)
    raise RebuildError(
        f"rank {rank}: {_MAX_CLOSED_ATTEMPTS} check-in attempts toward this "
        "generation were closed (each decided, then its generation failed to be made); fix: see "
        "the errors the other ranks raised, and call rebuild() again")


def record_made(root: Store, made_key: str, generation: int, size: int) -> None:
    """Record that generation ``generation`` was made on ``size`` ranks (one key of constant size,
    overwritten by each rebuild): a rank of an older generation that checks in later learns it is
    out."""
    root.set(made_key, json.dumps({"generation": generation, "size": size}))


def forget_check_ins(root: Store, prefix: str, attempts: int) -> list[int]:
    """Delete the keys of the check-ins ``prefix + "0/" .. prefix + f"{attempts - 1}/"`` and
    their open-attempt counter; call on one rank, a generation later (a rank that late reads
    :func:`record_made`'s key instead). Returns the numbers of the listener events that pushed
    their decisions, for the caller to delete too (``Liveness.forget``)."""
    with contextlib.suppress(RuntimeError):
        root.delete_key(f"{prefix}open")
    events = []
    with contextlib.suppress(RuntimeError, ValueError):  # the host died; not numbers
        events += read_numbers(root, f"{prefix}{AGREED}")
        root.delete_key(f"{prefix}{AGREED}")
    for attempt in range(attempts):
        store = PrefixStore(f"{prefix}{attempt}/", root)  # as check_in() wrote them
        with contextlib.suppress(RuntimeError, ValueError):  # the host died; not a number
            event = read_if_present(store, _EVENT)
            if event is not None:  # written where the decision was pushed
                events.append(int(event))
        for key in (_JOINED, _COUNT, _DECIDED, _EVENT):
            with contextlib.suppress(RuntimeError):  # never written (that rank was not first)
                store.delete_key(key)
    return events


def check_in_window(timeout: float | timedelta | None, layout: Layout,
                    overrides: Mapping[str, timedelta], create_timeout_s: float) -> timedelta:
    """The check-in window: ``timeout`` (validated), else the longest role timeout the job set
    (a ``timeout_s`` or ``set_timeout()``) plus :func:`window_slack_s`, else ``create_timeout_s``.

    With heartbeats the window only bounds the wait for a rank that is alive but slow to call
    ``rebuild()``: one step, which a role timeout bounds. A rank whose collective could not be
    interrupted (no socket to sever; torch 2.10's gloo sometimes leaves a local send waiting)
    reaches ``rebuild()`` one role timeout after it issued that collective, about when the first
    reporter's window of the same length ends: the slack lets it in. Never torch's 30-minute
    default.

    Example: roles of 3 s and 600 s -> a 900 s window; roles of 3 s only -> 5 s.
    """
    if timeout is not None:
        return timedelta(seconds=limits.check_timeout(timeout, "timeout"))
    given = [role.timeout_s for role in layout.roles if role.timeout_s is not None]
    given += [value.total_seconds() for value in overrides.values()]
    if not given:
        return timedelta(seconds=create_timeout_s)
    longest = max(given)
    return timedelta(seconds=longest + window_slack_s(longest))


def window_slack_s(role_timeout_s: float) -> float:
    """What the default check-in window adds to the longest role timeout: half of it, at least 2 s
    (a rank that waited out that timeout still has to unwind and reach the store, on a loaded
    machine)."""
    return max(2.0, role_timeout_s / 2)


def _short(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"
