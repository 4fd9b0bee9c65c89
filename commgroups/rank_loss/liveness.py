"""Who is alive, learned through the store: a heartbeat per rank, and a loss reported to every rank.

One daemon thread per registry (:class:`Liveness`), on its own connection to the job's TCPStore
(a wait on the shared connection would hold its lock and stop the beats), every ``interval_s``:

1. **beats**: adds 1 to ``beat/<rank>``;
2. **listens**: reads ``lost/<g>`` for the live generation ``g``; once a rank has reported a loss
   there, it calls ``on_loss(g)`` (the registry interrupts ``g``'s groups, so no rank of the job waits
   out a collective timeout on them);
3. **watches** the next member of ``g`` (in a ring, so each rank is watched by one other): a beat
   that has not moved for ``report_after_s`` (ten times ``dead_after_s``) is reported as a loss of
   that rank. A backstop: a dead rank's peers see their collective fail within milliseconds and
   report first; a watcher that reported a rank holding the GIL for a second would stop the job.

Each step is one non-blocking ``add`` (O(1) store operations per rank per interval). A rank that is
only slow (its process alive, in Python or in a collective) goes on beating from this thread and is
never reported; a rank whose process holds the GIL in C for longer than ``dead_after_s`` would be.
:meth:`Liveness.dead` is the check-in's use of the beats: which of some ranks have not beaten for
``dead_after_s`` while it looked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # re-exported

__all__ = ["Liveness", "own_connection"]

logger = logging.getLogger(__name__)


def own_connection(store: Store, timeout: timedelta) -> Store | None:
    """A new client connection to the TCPStore under ``store`` (through PrefixStores), or None
    when the job's store is not a TCPStore (a FileStore or HashStore: no heartbeats then)."""
    inner = store
    for _ in range(8):
        if not hasattr(inner, "underlying_store"):
            break
        inner = inner.underlying_store
    if not isinstance(inner, TCPStore):
        return None
    return TCPStore(inner.host, inner.port, is_master=False, timeout=timeout,
                         wait_for_workers=False)


class Liveness:
    """The heartbeat thread of one registry on one rank; see the module docstring.

    Args:
        client: this thread's own store connection (:func:`own_connection`).
        namespace: a key prefix the same on every rank of the registry, and no other registry's.
        rank: this rank's global rank.
        interval_s: seconds between beats.
        dead_after_s: a beat unchanged this long means its rank is dead.
        on_loss: called from the thread with a generation number when a loss in it is reported.
    """

    def __init__(self, client: Store, namespace: str, rank: int, *, interval_s: float,
                 dead_after_s: float, on_loss: Callable[[int], None]) -> None:
        self._store = PrefixStore(namespace, client)
        self._client = client
        self.rank = rank
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.report_after_s = 10 * dead_after_s
        self._on_loss = on_loss
        self._lock = threading.Lock()  # one operation at a time on the one connection
        self._watched: tuple[int, int | None] | None = None  # generation, the member watched
        self._handled: set[int] = set()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last beat, when it last moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"commgroups-liveness-{rank}",
                                        daemon=True)

    def start(self) -> None:
        """Beat once (so peers see this rank at once), then start the thread."""
        self._add(f"beat/{self.rank}", 1)
        self._thread.start()

    def watch(self, generation: int | None, members: Sequence[int] = ()) -> None:
        """Listen for losses in ``generation`` and watch its next member; None: beat only."""
        ring = list(members)
        successor = (ring[(ring.index(self.rank) + 1) % len(ring)]
                     if self.rank in ring and len(ring) > 1 else None)
        with self._lock:
            self._watched = None if generation is None else (generation, successor)
            self._seen.clear()

    def report(self, generation: int, reason: str, suspect: int | None = None) -> bool:
        """Report a loss in ``generation`` to every rank; False if one was reported already.
        The reason (and the rank suspected, if any) goes to this rank's log."""
        with self._lock:
            first = int(self._store.add(f"lost/{generation}", 1)) == 1
        if first:
            logger.info("rank %d: reported a loss in generation %d (%s%s)", self.rank, generation,
                        reason, "" if suspect is None else f"; suspect: rank {suspect}")
        return first

    def dead(self, ranks: Sequence[int], since: float) -> set[int]:
        """Which of ``ranks`` have not beaten for ``dead_after_s``, watched from ``since``
        (``time.monotonic()``) at the latest. Call repeatedly; each call reads every beat once."""
        now = time.monotonic()
        with self._lock:
            # ``add(key, 0)`` would create the key of a rank that closed (and deleted it): look first.
            beats = [int(self._store.add(f"beat/{r}", 0)) if self._store.check([f"beat/{r}"])
                     else 0 for r in ranks]
            return {r for r, beat in zip(ranks, beats, strict=True)
                    if now - self._moved(r, beat, since) >= self.dead_after_s}

    def _moved(self, rank: int, beat: int, since: float) -> float:
        """When ``rank``'s beat last moved (as far as this rank saw); call under the lock."""
        last = self._seen.get(rank)
        if last is None or last[0] != beat:
            moved = since if last is None else time.monotonic()
            self._seen[rank] = (beat, moved)
            return moved
        return last[1]

    def close(self) -> None:
        """Stop the thread (within one interval) and delete this rank's beat. Local."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))
        with contextlib.suppress(RuntimeError):  # the store's host is gone
            self._store.delete_key(f"beat/{self.rank}")

    def release(self, generation: int) -> None:
        """Delete ``generation``'s loss report (call once per generation, after every survivor
        read it: when the next generation exists)."""
        with self._lock, contextlib.suppress(RuntimeError):  # the store's host is gone
            self._store.delete_key(f"lost/{generation}")

    # ------------------------------------------------------------------------------ the thread
    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._store.add(key, amount))

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            try:
                self._step()
                failures = 0
            except Exception as error:  # a store hiccup must not kill the heartbeat
                failures += 1
                logger.debug("rank %d: liveness step failed (%d): %s", self.rank, failures, error)
                if failures >= 50:  # the store's host is gone: nothing left to beat to
                    logger.warning("rank %d: liveness stopped, the store is unreachable: %s",
                                   self.rank, error)
                    return

    def _step(self) -> None:
        self._add(f"beat/{self.rank}", 1)
        watched = self._watched
        if watched is None:
            return
        generation, successor = watched
        if generation in self._handled:
            return
        if self._add(f"lost/{generation}", 0) > 0:
            self._handled.add(generation)
            self._on_loss(generation)
            return
        # Only a rank seen beating (its registry running) can be reported as stopped: one that
        # never beat is still finishing create(), or died in it (create() fails then).
        if successor is None:
            return
        now = time.monotonic()
        self.dead([successor], now)  # notes when its beat last moved
        beat, moved = self._seen.get(successor, (0, now))
        if beat > 0 and now - moved >= self.report_after_s:
            self.report(generation, f"rank {successor} stopped beating for "
                        f"{self.report_after_s:g}s", suspect=successor)
