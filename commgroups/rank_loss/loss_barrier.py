"""A store barrier that a rank-loss report ends: every rank waits for the others, and a rank
lost before it arrived never will.

torchtitan's timeout switch waits for every rank through the job's store (no collective on any
role's group, see :meth:`~commgroups.GroupRegistry.store_barrier`). A plain store barrier waits
out its whole timeout (300 s by default) when a rank died before it arrived; this one ends on
every waiting rank within milliseconds of the loss report that the rank's listener hears.

The protocol: a waiting rank lists the barrier as pending, looks whether a report of its
generation was heard already, and waits on a connection of its own (the job's shared connection
stays free for the beat, and for the wake). The listener's thread, on a report of that
generation, writes the barrier's ``all`` key as :data:`LOST` through the shared connection; the
wait returns, reads it and raises :class:`~commgroups.errors.LossInterruptedError`. A report
heard before the barrier was listed is caught by the look; one heard after finds it listed.
Costs nothing while no rank is lost; one request per waiting rank when one is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.creation.agreement import store_barrier
from commgroups.errors import LossInterruptedError
from commgroups.rank_loss.liveness import own_connection

__all__ = ["LOST", "LossBarriers"]

logger = logging.getLogger(__name__)

LOST = "lost"
"""The value of a barrier's ``all`` key that a loss report wrote (every rank arrived: ``1``)."""


@dataclass
class LossBarriers:
    """The store barriers one rank waits in, by name, with the generation each waits in; the
    main thread lists them (:meth:`wait`), the listener's thread wakes them (:meth:`wake`)."""

    pending: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, store: Store, name: str, position: int, members: Sequence[int],
             timeout: timedelta, what: str, generation: int,
             heard: Callable[[int], bool]) -> None:
        """Wait until every rank of ``members`` reached ``name`` (``position``: this rank's
        index there), or until a loss report of ``generation`` (``heard``: whether this rank
        heard one already) ends the wait with :class:`~commgroups.errors.LossInterruptedError`.
        Errors otherwise as :func:`~commgroups.creation.agreement.store_barrier`'s."""
        waiter = own_connection(store, timeout)
        if waiter is None:  # not a TCPStore: no listener hears reports either
            store_barrier(store, name, position, len(members), timeout, what, members=members)
            return
        with self.lock:
            self.pending[name] = generation
        try:
            if heard(generation):
                raise _interrupted(members[position], what, generation)
            store_barrier(waiter, name, position, len(members), timeout, what, members=members)
            if bytes(waiter.get(f"{name}/all")).decode() == LOST:
                raise _interrupted(members[position], what, generation)
        finally:
            with self.lock:
                del self.pending[name]

    def wake(self, store: Store, generation: int, rank: int) -> None:
        """On the listener's thread, for a loss report of ``generation``: end every barrier
        listed in it, through ``store`` (the shared connection: no waiter holds it)."""
        with self.lock:
            names = [name for name, waits_in in self.pending.items() if waits_in == generation]
        for name in names:
            logger.debug("rank %d: a loss report ends store barrier %s", rank, name)
            with contextlib.suppress(RuntimeError):  # the store went: the waiter hears that too
                store.set(f"{name}/all", LOST)


def _interrupted(rank: int, what: str, generation: int) -> LossInterruptedError:
    return LossInterruptedError(
        f"rank {rank}: a rank-loss report in generation {generation} ended the wait for "
        f"every rank at {what} (a rank lost before it arrived never will); fix: rebuild() "
        "the registry in place, or let the launcher restart the job")
