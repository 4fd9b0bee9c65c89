"""The survivors' check-in after a rank loss: every survivor learns the same set of live ranks.

Each survivor appends its global rank to one store key and waits for the decision. The set is decided
exactly once, by one compare-and-set on the key ``decided``:

- as soon as every rank it expects (``expected``: the ranks the caller knows to be alive, else every
  member of the old generation) has checked in, by the rank that saw the list complete; or
- when a rank's window (counted from its own check-in) runs out, by that rank: the ranks that
  checked in by then are the survivors, the others count as dead.

Every survivor reads the one decided set, so all get the same answer. A rank that checks in after the
decision is not in it and raises :class:`~commgroups.errors.RebuildError` (the others rebuilt without
it); it never forms a world of its own. Only the store is used (no process group: the old groups hold
a dead rank), at O(1) store operations per rank plus one read of the list.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # re-exported

from commgroups.creation.agreement import store_calls
from commgroups.errors import RebuildError

__all__ = ["check_in"]

_JOINED = "joined"
_DECIDED = "decided"


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
) -> tuple[int, ...]:
    """Check ``rank`` in under ``prefix`` and return the decided survivors (global ranks, ascending).

    Args:
        root: the job's store (the default group's); it must outlive the lost ranks (host it outside
            the training ranks: torchrun's agent or a dedicated process).
        prefix: a namespace every survivor of this rebuild attempt uses, and no other attempt.
        rank: this rank's global rank.
        members: the old generation's global ranks (the only ranks that may check in).
        window: how long this rank waits, from its own check-in, for the others.
        expected: ranks known to be alive; the set is decided as soon as all of them are in.

    Raises:
        RebuildError: this rank checked in after the set was decided without it.
        StoreUnreachableError: the store stopped answering (its host died).
    """
    store = PrefixStore(prefix, root)
    wanted = set(expected if expected is not None else members)
    member_set = set(members)
    started = time.monotonic()
    with store_calls(root, rank, started, "registry.rebuild()'s check-in"):
        # Store.append: at runtime on 2.10-2.15, missing from some releases' stubs.
        store.append(_JOINED, f"{rank},")  # type: ignore[attr-defined,unused-ignore]
        decided: tuple[int, ...] | None = None
        if wanted <= set(_joined(store)):
            decided = _decide(store, [r for r in _joined(store) if r in member_set])
        else:
            try:
                store.wait([_DECIDED], window)
            except (RuntimeError, TimeoutError):
                if time.monotonic() - started < window.total_seconds() - 0.05:
                    raise  # the store failed, not the wait: store_calls names its host
                decided = _decide(store, [r for r in _joined(store) if r in member_set])
        if decided is None:
            decided = tuple(json.loads(bytes(store.get(_DECIDED)).decode()))
    if rank not in decided:
        raise RebuildError(
            f"rank {rank}: checked in to registry.rebuild() after the survivors were decided "
            f"without it ({len(decided)} ranks: {_short(decided)}); the others rebuilt without "
            "this rank. fix: give rebuild() a longer timeout (the check-in window must cover the "
            "time every survivor takes to notice the loss: the roles' collective timeouts), or "
            "pass alive= when the lost ranks are known"
        )
    return decided


def _short(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"
