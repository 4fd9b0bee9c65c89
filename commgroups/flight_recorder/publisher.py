"""A daemon thread that keeps this rank's status in the store, so other ranks can read it even
while this rank is stuck (in Python, or in a collective that holds no GIL).

Self-contained on purpose: a store, a key prefix, a rank and a ``snapshot`` callable. The
collective's path never touches the store: the thread publishes at ``interval_s``, only when the
snapshot changed or another rank asked. Asks arrive as events through the registry's listener
(:meth:`StatusPublisher.listen_through`: no store request while nobody asks); without one (no
TCPStore, heartbeats off) the thread reads the request counter a few times an interval.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

__all__ = ["DEFAULT_INTERVAL_S", "REQUEST_POLLS_PER_INTERVAL", "StatusPublisher", "read_status"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
"""Seconds between two looks at the snapshot."""

REQUEST_POLLS_PER_INTERVAL = 4
"""Looks at the request counter per interval: a rank asked after a peer's connection closed waits
for the others' answers while rank-loss handling waits for it, so they answer within a quarter
interval (one or two store reads each)."""


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
            when another rank asks (:meth:`ask`).

    Each published value is ``{"t": wall seconds, "answered": request number, "status": ...}``.
    A reader knows a rank is alive when its ``answered`` reaches the number it asked with.
    """

    def __init__(self, store: Store, prefix: str, rank: int, snapshot: Callable[[], Any],
                 interval_s: float = DEFAULT_INTERVAL_S,
                 on_request: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.interval_s = interval_s
        self._snapshot = snapshot
        self.on_request = on_request
        self._stop = threading.Event()
        self._lock = threading.Lock()  # publish_now from a failing call races the thread
        self._last: Any = None
        self._answered = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"commgroups-flight-{rank}")
        self._emit: Callable[[dict[str, Any]], object] | None = None
        self._subscribe: Callable[[str, Callable[[], None] | None], None] | None = None

    @property
    def poll_s(self) -> float:
        """Seconds between two looks at the request counter: how soon a live rank answers."""
        return self.interval_s / REQUEST_POLLS_PER_INTERVAL

    @property
    def key(self) -> str:
        """This rank's status key."""
        return f"{self.prefix}{self.rank}"

    def start(self) -> StatusPublisher:
        """Publish once, then start the thread."""
        self.publish_now()
        self._thread.start()
        return self

    def publish_now(self, force: bool = False) -> None:
        """Publish the snapshot if it changed (or ``force``); safe from any thread."""
        with self._lock:
            status = self._snapshot()
            if not force and status == self._last:
                return
            self._last = status
            value = {"t": time.time(), "answered": self._answered, "status": status}
            self.store.set(self.key, json.dumps(value, default=str))

    def listen_through(self, emit: Callable[[dict[str, Any]], object],
                       subscribe: Callable[[str, Callable[[], None] | None], None]) -> None:
        """Hear asks as events (``subscribe(prefix, handler)``, called back from the listener's
        thread) and send them with ``emit``, instead of polling the request counter: every
        publisher of the prefix must do it alike (they do: the registry attaches each)."""
        self._emit, self._subscribe = emit, subscribe
        subscribe(self.prefix, self._heard)
        self._heard()  # an ask made before this publisher listened

    def _heard(self) -> None:
        try:
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

    def _poll(self) -> None:
        # The counter, not the request key, says how many asks there were: two ranks asking at
        # once may leave the key at the older number, and the newer asker must see an answer.
        # Read, never add(0): a poll must not re-create a key the last rank to close deleted.
        counter = f"{self.prefix}requests"
        number = int(self.store.get(counter)) if self.store.check([counter]) else 0
        if number <= self._answered:
            return
        self._answered = number
        key = f"{self.prefix}request"
        request = json.loads(self.store.get(key)) if self.store.check([key]) else {}
        if self.on_request is not None:
            try:
                self.on_request(request)
            except Exception:  # a failed dump must not end the publisher
                logger.exception("flight recorder: handling request %s failed", request)
        self.publish_now(force=True)

    def _run(self) -> None:
        polls = 0
        while not self._stop.wait(self.interval_s if self._emit is not None else self.poll_s):
            try:
                if self._emit is not None:  # asks come as events: only publish a change
                    self.publish_now()
                    continue
                self._poll()
                polls += 1
                if polls % REQUEST_POLLS_PER_INTERVAL == 0:
                    self.publish_now()
            except Exception as error:  # the store went away (its host died): stop quietly
                logger.warning("flight recorder publisher stops: %r", error)
                return

    def stop(self, release: bool = True, members: int = 0) -> None:
        """Stop the thread; ``release``: :meth:`release` the keys (``close()``)."""
        self._stop.set()
        if self._subscribe is not None:
            self._subscribe(self.prefix, None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))
        if release:
            self.release(members)

    def release(self, members: int, lost: tuple[int, ...] = ()) -> None:
        """Delete this rank's key and, on the last of ``members`` ranks to release, the request
        keys they share and the keys of the ``lost`` ranks (dead: they never delete theirs).
        Every publisher of the prefix has stopped by then, so nothing writes them again."""
        try:
            self.store.delete_key(self.key)
            if members and int(self.store.add(f"{self.prefix}closed", 1)) >= members:
                # diagnosing, spoken: which ranks diagnosed a failed call, which printed it
                for name in ("request", "requests", "closed", "diagnosing", "spoken",
                             *map(str, lost)):
                    self.store.delete_key(f"{self.prefix}{name}")
        except Exception as error:  # the store may be gone with the job
            logger.debug("flight recorder: releasing %s: %s", self.key, error)


def read_status(store: Store, prefix: str, rank: int) -> dict[str, Any] | None:
    """What rank ``rank`` last published under ``prefix``, or None (never published, or gone)."""
    key = f"{prefix}{rank}"
    try:
        if not store.check([key]):
            return None
        value: dict[str, Any] = json.loads(store.get(key))
    except Exception as error:  # the store's host died: nothing to read
        logger.debug("flight recorder: reading %s: %s", key, error)
        return None
    return value
