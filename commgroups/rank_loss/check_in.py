"""The survivors' check-in after a rank loss: every survivor learns the same set of live ranks.

Each survivor appends its global rank to one store key and looks for the decision. The set is
decided exactly once, by one compare-and-set on the key ``decided``, by the first rank that sees:

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
  answered the loss report, is alive). A minority decides nothing and raises: a lone ``rebuild()``
  never splits the job.

Every survivor reads the one decided set, so all get the same answer. A rank that checks in after the
decision is not in it and raises :class:`~commgroups.errors.RebuildError` (the others rebuilt without
it); it never forms a world of its own. Only the store is used (no process group: the old groups hold
a dead rank): per look (every 20 ms) one read of the list and, after ``dead_after_s``, one ``check``
per absent member.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # re-exported

from commgroups.creation.agreement import store_calls
from commgroups.errors import LeftOutError, RebuildError
from commgroups.layout import limits
from commgroups.layout.specs import Layout
from commgroups.rank_loss.liveness import Liveness

__all__ = ["check_in", "check_in_window", "forget_check_ins", "record_made", "window_slack_s"]

_JOINED = "joined"
_DECIDED = "decided"
_POLL_S = 0.02  # between looks at the check-in: the decision waits at most this much longer


def _joined(store: Store) -> list[int]:
    text = bytes(store.get(_JOINED)).decode()
    return sorted({int(part) for part in text.split(",") if part})


def _decide(store: Store, ranks: Sequence[int]) -> tuple[int, ...]:
    """Propose ``ranks``; returns the set that holds (ours, or one decided before)."""
    held = bytes(store.compare_set(_DECIDED, "", json.dumps(sorted(ranks)))).decode()
    return tuple(json.loads(held))


def check_in(
    root: Store,
    prefix: str,
    rank: int,
    members: Sequence[int],
    window: timedelta,
    expected: Sequence[int] | None = None,
    liveness: Liveness | None = None,
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
        liveness: the ranks' listening threads: without ``expected``, the set is decided as
            soon as every member is in or left generation ``generation``'s loss report
            unanswered for its ``dead_after_s``; at the window's end only a majority of the
            live members decides.
        made_key: where the survivors record the last generation they made (:func:`record_made`);
            one newer than ``generation`` (this rank's) means this check-in was decided long ago
            and its keys may be gone: this rank is out (were it in that generation, it would be
            at it).
        generation: the number of the generation this rank is rebuilding from.

    Raises:
        LeftOutError: this rank checked in after the set was decided without it.
        RebuildError: the window ended with the ranks in a minority of the live members (nothing
            decided).
        StoreUnreachableError: the store stopped answering (its host died).
    """
    store = PrefixStore(prefix, root)
    wanted = set(expected if expected is not None else members)
    member_set = set(members)
    started = time.monotonic()
    deadline = started + window.total_seconds()
    joined: list[int] = []
    absent_alive: list[int] = []
    with store_calls(root, rank, started, "registry.rebuild()'s check-in"):
        # Store.append: at runtime on 2.10-2.15, missing from some releases' stubs.
        store.append(_JOINED, f"{rank},")  # type: ignore[attr-defined,unused-ignore]
        decided: tuple[int, ...] | None = None
        while decided is None:
            if made_key is not None and root.check([made_key]):
                made = json.loads(bytes(root.get(made_key)).decode())
                if made["generation"] > generation:  # made from ours, or later: we are out
                    decided = tuple(made["members"])
                    break
            if store.check([_DECIDED]):
                decided = tuple(json.loads(bytes(store.get(_DECIDED)).decode()))
                break
            joined = [r for r in _joined(store) if r in member_set]
            missing = sorted(wanted - set(joined))
            # One clock reading per look: under load a look takes a while, and the window's end
            # must never be judged before the answers were (every live absent rank would then
            # count as alive and no majority would decide).
            now = time.monotonic()
            dead: set[int] = set()
            if (missing and liveness is not None and expected is None
                    and (now - started >= liveness.dead_after_s or now >= deadline)):
                dead = set(missing) - liveness.answered(generation, missing)
            if not missing or set(missing) <= dead:
                decided = _decide(store, joined)
            elif now >= deadline:
                # Listed ranks are alive by the caller's word; others, if they answered.
                absent_alive = ([r for r in missing if r not in dead]
                                if liveness is not None or expected is not None else [])
                if len(joined) <= len(absent_alive):
                    break  # no majority of the live members: deciding would split the job
                decided = _decide(store, joined)
            else:
                time.sleep(_POLL_S)
    if decided is None:
        raise RebuildError(
            f"rank {rank}: ranks {_short(absent_alive)} are alive but did not call rebuild() "
            f"within {window.total_seconds():g}s, and the {len(joined)} in are no majority; "
            "nothing was decided. fix: call rebuild() on every rank")
    if rank not in decided:
        raise LeftOutError(
            f"rank {rank}: checked in to rebuild() after the survivors were decided without it "
            f"({len(decided)} ranks: {_short(decided)}); this rank is out of the job. fix: exit, "
            "or give rebuild() a longer timeout= (its check-in window)"
        )
    return decided


def record_made(root: Store, made_key: str, generation: int, members: Sequence[int]) -> None:
    """Record that generation ``generation`` was made on ``members`` (one key, overwritten by
    each rebuild): a rank of an older generation that checks in later learns it is out."""
    root.set(made_key, json.dumps({"generation": generation, "members": list(members)}))


def forget_check_ins(root: Store, prefix: str, attempts: int) -> None:
    """Delete the keys of the check-ins ``prefix + "0/" .. prefix + f"{attempts - 1}/"`` and
    their open-attempt counter; call on one rank, a generation later (a rank that late reads
    :func:`record_made`'s key instead)."""
    with contextlib.suppress(RuntimeError):
        root.delete_key(f"{prefix}open")
    for attempt in range(attempts):
        store = PrefixStore(f"{prefix}{attempt}/", root)  # as check_in() wrote them
        for key in (_JOINED, _DECIDED):
            with contextlib.suppress(RuntimeError):  # never written (that rank was not first)
                store.delete_key(key)


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
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        return timedelta(seconds=limits.check_timeout(seconds, "timeout"))
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
