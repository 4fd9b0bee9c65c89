"""A store barrier that a rank-loss report ends: every rank waits for the others, and a rank
lost before it arrived never will.

torchtitan's timeout switch waits for every rank through the job's store (no collective on any
role's group, see :meth:`~commgroups.GroupRegistry.store_barrier`). A plain store barrier waits
out its whole timeout (300 s by default) when a rank died before it arrived; this one ends on
every waiting rank within milliseconds of the loss report that the rank's listener hears.

The protocol: a waiting rank lists the barrier as pending, looks whether a report of its
generation was heard already, and waits on a connection of its own (the job's shared connection
stays free for the beat, and for the wake), from a thread of its own. The listener's thread, on a
report of that generation, writes the barrier's ``all`` key as :data:`LOST` through the shared
connection; the wait returns, reads it and raises
:class:`~commgroups.errors.LossInterruptedError`. A report heard before the barrier was listed
is caught by the look; one heard after finds it listed.

Nobody is in a collective while it waits, so no socket of a group sees a peer die; the dead
rank's host relay reports it (:mod:`~commgroups.rank_loss.host_relay`), and the heartbeat's
backstop a rank alone on its host after ten ``dead_after_s`` without a beat (10-30 s at the
defaults). Besides, the waiting rank looks, every :data:`LOCAL_LOOK_S`, whether a member on its
own host has died
(``/proc``, against the host's key: no store request) and reports it: a loss on a waiting
rank's host ends the barrier within a look. No store request while no rank is lost (a thread
for the wait, and reads of ``/proc``); a report and one request per waiting rank when one is.
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

LOCAL_LOOK_S = 0.2
"""How often a waiting rank looks for a member dead on its host (``/proc`` reads only)."""


@dataclass
class LossBarriers:
    """The store barriers one rank waits in, by name, with the generation each waits in; the
    main thread lists them (:meth:`wait`), the listener's thread wakes them (:meth:`wake`)."""

    pending: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, store: Store, name: str, position: int, members: Sequence[int],
             timeout: timedelta, what: str, generation: int,
             heard: Callable[[int], bool],
             local_deaths: Callable[[], Sequence[int]] = lambda: (),
             report: Callable[[Sequence[int]], object] = lambda dead: None) -> None:
        """Wait until every rank of ``members`` reached ``name`` (``position``: this rank's
        index there), or until a loss report of ``generation`` (``heard``: whether this rank
        heard one already) ends the wait with :class:`~commgroups.errors.LossInterruptedError`.
        Meanwhile, every :data:`LOCAL_LOOK_S`, ``local_deaths()`` (members dead on this host)
        are reported (``report``). Errors otherwise as
        :func:`~commgroups.creation.agreement.store_barrier`'s."""
        waiter = own_connection(store, timeout)
        if waiter is None:  # not a TCPStore: no listener hears reports either
            store_barrier(store, name, position, len(members), timeout, what, members=members)
            return
        with self.lock:
            self.pending[name] = generation
        try:
            if heard(generation):
                raise _interrupted(members[position], what, generation)
            self._wait_looking(waiter, name, position, members, timeout, what, local_deaths,
                               report)
            passed = bytes(waiter.get(f"{name}/all")).decode() != LOST
            with contextlib.suppress(RuntimeError):  # only a timeout's naming reads it
                waiter.delete_key(f"{name}/{position}")
            if not passed:
                raise _interrupted(members[position], what, generation)
        finally:
            with self.lock:
                del self.pending[name]

    @staticmethod
    def _wait_looking(waiter: Store, name: str, position: int, members: Sequence[int],
                      timeout: timedelta, what: str,
                      local_deaths: Callable[[], Sequence[int]],
                      report: Callable[[Sequence[int]], object]) -> None:
        """The store barrier on ``waiter``, from a thread of its own, while this one looks for
        deaths on this host (a report of one wakes the barrier: :meth:`wake`)."""
        done = threading.Event()
        failed: list[BaseException] = []

        def arrive_and_wait() -> None:
            try:
                store_barrier(waiter, name, position, len(members), timeout, what,
                              members=members)
            except BaseException as error:  # raised on the caller's thread below
                failed.append(error)
            finally:
                done.set()

        threading.Thread(target=arrive_and_wait, name="commgroups-store-barrier",
                         daemon=True).start()
        reported: set[int] = set()
        while not done.wait(LOCAL_LOOK_S):
            dead = [rank for rank in local_deaths() if rank not in reported]
            if dead:
                logger.info("store barrier %s: ranks %s on this host are gone: reporting them",
                            name, dead)
                reported.update(dead)
                with contextlib.suppress(RuntimeError):  # the store went: the wait says so
                    report(dead)
        if failed:
            raise failed[0]

    def wake(self, store: Store, generation: int, rank: int) -> None:
        """On the listener's thread, for a loss report of ``generation``: end every barrier
        listed in it, through ``store`` (the shared connection: no waiter holds it)."""
        with self.lock:
            names = [name for name, waits_in in self.pending.items() if waits_in == generation]
        for name in names:
            logger.debug("rank %d: a loss report ends store barrier %s", rank, name)
            with contextlib.suppress(RuntimeError):  # the store went: the waiter hears that too
                # Only where every rank has not arrived yet: one outcome for every rank. A set
                # after the last arrival's made ranks that had read "passed" go on while ranks
                # reading after it raised (a false report: a rank slow on loaded cores).
                store.compare_set(f"{name}/all", "", LOST)


def _interrupted(rank: int, what: str, generation: int) -> LossInterruptedError:
    return LossInterruptedError(
        f"rank {rank}: a rank-loss report in generation {generation} ended the wait for "
        f"every rank at {what} (a rank lost before it arrived never will); fix: rebuild() "
        "the registry in place, or let the launcher restart the job")
