"""The store namespaces of agreement attempts: a fresh one per attempt, and no keys left behind.

Ranks meet in the default group's store before any group exists (:mod:`commgroups.creation.agreement`). Each
``create()`` (and each mesh-dim creation) is an *attempt* in its own namespace,
``commgroups/agree/<epoch>/``, where ``epoch`` is one shared counter: it moves on exactly once per
attempt, when the attempt completes or is given up. So after a rank skipped a ``create()`` (the
others timed out and gave it up), the next ``create()`` on every rank opens the same new namespace:
nobody reads the failed attempt's stale keys, and the job can try again.

An :class:`AttemptStore` remembers the keys it wrote; :meth:`AttemptStore.release` (the registry's
``close()``) deletes them without any rank waiting for another: each rank deletes its own per-rank
keys at once, and the last rank to release deletes the shared ones, which no rank reads any more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # re-exported at runtime

__all__ = ["AttemptStore", "open_attempt"]

logger = logging.getLogger(__name__)

# Shared keys of an attempt that some ranks write and others only read or wait for (agreement's
# outcome, reference and counters, the end of creation); the last rank to release deletes
# them whether or not it wrote them.
_SHARED_KEYS = ("all", "ref", "mismatch", "ballot/split", "ballot/veto", "counter/split",
                "created/all", "closed")


class AttemptStore(Store):  # type: ignore[misc]  # torch's stubs re-export Store loosely
    """One attempt's namespace of ``root``; remembers every key written through it.

    Only the operations commgroups' agreement, barrier and local-creation check use are provided.

    Args:
        root: the default group's store.
        prefix: commgroups' key prefix in it.
        epoch: the attempt's number, from :func:`open_attempt`.
    """

    def __init__(self, root: Store, prefix: str, epoch: int) -> None:
        super().__init__()
        self.namespace = f"{prefix}/agree/{epoch}/"
        """The attempt's key prefix in ``root``."""
        self.underlying_store = PrefixStore(self.namespace, root)
        self.epoch = epoch
        self._root = root
        self._epoch_key = f"{prefix}/epoch"
        self.written: set[str] = set()
        self._peers_created_by: float | None = None  # see note_created
        self._unannounced: int | None = None  # the world size while this rank's note is unsent
        self._announcing = threading.Lock()

    def note_created(self, world_size: int, deadline: float, announce: bool = True) -> None:
        """This rank finished creating the attempt's groups; no wait (the last one says so for all).

        On backends that connect on creation (gloo) a rank can return from ``new_group`` while a
        peer is still connecting to it, and destroying the group then would break the peer's
        connection. Rather than every rank meeting at the end of creation, each notes its end
        here and :meth:`wait_created` meets only before groups are destroyed. ``deadline``
        (``time.monotonic()``): when the peers' creation would have timed out anyway.
        ``announce=False``: the store request is left to :meth:`announce_created`, from another
        thread (``create()``'s starter); :meth:`wait_created` sends it first if it is still due.
        """
        self._peers_created_by = deadline
        self._unannounced = world_size
        if announce:
            self.announce_created()

    def announce_created(self) -> None:
        """Send this rank's note of :meth:`note_created` if it is still due (once, any thread).

        Returns once the note is in the store, whoever sent it: a caller that goes on to wait
        for every rank's note (:meth:`wait_created`, on the connection the sender needs) must
        not start that wait while its own note is still being sent."""
        with self._announcing:
            world_size, self._unannounced = self._unannounced, None
            if world_size is not None and self.add("created/count", 1) == world_size:
                self.set("created/all", "1")

    def wait_created(self) -> None:
        """Before destroying the attempt's groups: wait until every rank noted the end of creating
        them, at most until the deadline given to :meth:`note_created` (a peer still creating then
        has failed, and nothing is left to protect). A failed store is left alone."""
        if self._peers_created_by is None:
            return
        left = self._peers_created_by - time.monotonic()
        self._peers_created_by = None
        with contextlib.suppress(RuntimeError):  # the store failed: nobody is left to wait for
            self.announce_created()
        if left <= 0:
            return
        try:
            if not self.underlying_store.check(["created/count"]):
                return  # the others released the attempt (after a rebuild without this rank)
            self.underlying_store.wait(["created/all"], timedelta(seconds=left))
        except (RuntimeError, TimeoutError) as error:  # a peer never finished; the store died
            logger.debug("not every rank finished creating before close: %s", error)

    def set(self, key: str, value: Any) -> None:
        self.written.add(key)
        self.underlying_store.set(key, value)

    def get(self, key: str) -> bytes:
        value: bytes = self.underlying_store.get(key)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values: list[bytes] = self.underlying_store.multi_get(keys)
        return values

    def add(self, key: str, amount: int) -> int:
        self.written.add(key)
        total: int = self.underlying_store.add(key, amount)
        return total

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.written.add(key)
        value: bytes = self.underlying_store.compare_set(key, expected, desired)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.underlying_store.wait(keys)
        else:
            self.underlying_store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.underlying_store.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.underlying_store.delete_key(key))

    def finish(self) -> None:
        """End this attempt: the next :func:`open_attempt` on any rank gets the next epoch.

        Idempotent (a compare-and-set from this epoch to the next), so every rank that gives the
        attempt up may call it.
        """
        self._root.compare_set(self._epoch_key, str(self.epoch), str(self.epoch + 1))

    def release(self, rank: int, world_size: int, lost: Sequence[int] = ()) -> None:
        """Delete this attempt's keys: this rank's own now, the shared ones by the last rank.

        Call once per rank, after the attempt succeeded and every wait of this rank in it returned.
        ``lost``: ranks (positions) that will never release theirs (they died): the last of the
        others deletes their per-rank keys too, named like this rank's (every rank writes the
        same keys). A store that already failed is left alone: there is nothing left to clean.
        """
        own = {key for key in self.written if key.endswith(f"/{rank}")}
        try:
            for key in own:
                self.underlying_store.delete_key(key)
            if self.underlying_store.add("closed", 1) == world_size - len(lost):
                theirs = {f"{key.rsplit('/', 1)[0]}/{other}" for key in own for other in lost}
                for key in (self.written - own) | set(_SHARED_KEYS) | theirs:
                    self.underlying_store.delete_key(key)
        except RuntimeError:  # DistNetworkError: the store's host is gone, and its keys with it
            pass
        self.written.clear()


def open_attempt(root: Store, prefix: str) -> AttemptStore:
    """The namespace of the next attempt: the same on every rank that opens it before it ends."""
    epoch = int(root.add(f"{prefix}/epoch", 0))
    return AttemptStore(root, prefix, epoch)
