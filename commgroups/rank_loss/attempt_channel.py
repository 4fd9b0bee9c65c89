"""How a rebuild's ranks wait for their agreement's outcome: through their listeners, not the store.

After the check-in decided the survivors, they agree on the next generation
(:func:`~commgroups.creation.agreement.agree`). A rank waiting there for the others held its
store connection in a blocking wait, the connection its background threads share (a TCPStore
connection serves one request at a time, a wait included): a survivor that died after the check-in
was then seen by its host's peers, but their report waited behind their own wait, and every
survivor waited ``create_timeout_s`` (300 s by default) before the rebuild failed
(``tests/test_rebuild.py``, a second loss during a rebuild: 40 s with a 40 s timeout). The last
rank in, or a rank that gives the attempt up, now announces the outcome as one listener event
(as the check-in's decision is pushed), and a waiting rank looks every :data:`LOOK_S` meanwhile
whether a member of the attempt on its host died (``/proc``, as the loss barrier does: no store
request); if one did, it gives the attempt up at once, for everyone, and adds the dead to the
previous generation's confirmed dead, so that the survivors' next check-in does not wait for them
(they answered that generation's loss report while alive: without it they were waited for until
the check-in's window ended).

Not seen this way: a member alone on its host, or a host gone whole, during the agreement (the
attempt then waits ``create_timeout_s``, as before); and a death once the agreement is over, while
the groups are made (torch's rendezvous waits on the store, up to ``create_timeout_s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.rank_loss.liveness import Liveness
from commgroups.util.store_reads import append_numbers

__all__ = ["LOOK_S", "AttemptChannel"]

LOOK_S = 0.2
"""How often a waiting rank looks for a member of the attempt dead on its host (``/proc`` only)."""


class AttemptChannel:
    """One rank's channel to one agreement attempt of a rebuild
    (:class:`~commgroups.creation.agreement.OutcomeChannel`).

    Args:
        liveness: this rank's listener (it hears the announcement, and knows its host's
            processes).
        prefix: the attempt's store namespace (names its announcement).
        members: the attempt's ranks, global, in the agreement's order.
        generation: the generation they are rebuilt from (whose confirmed dead a death seen
            here joins).
        events: where the number of an announcement this rank sends is listed, in the job's
            store (``root``), so that it is deleted a generation later, once every listener is
            past it (``forget_check_ins``).

    Example: ``channel = AttemptChannel(liveness, "commgroups/agree/7/", (0, 1, 2), 0, root,
    "commgroups/rebuild/x/1/agreed")`` before the rank counts itself in; ``channel.wait(30)``
    then returns True once announced, or ``[2]`` (a position) once rank 2's process is gone.
    """

    def __init__(self, liveness: Liveness, prefix: str, members: Sequence[int], generation: int,
                 root: Store, events: str) -> None:
        self._liveness = liveness
        self._prefix = prefix
        self._members = tuple(members)
        self._positions = {rank: position for position, rank in enumerate(members)}
        self._generation = generation
        self._root = root
        self._events = events
        self._announced = threading.Event()
        liveness.expect(prefix, self._heard)  # before this rank counts itself in: never missed

    def _heard(self, event: dict[str, Any]) -> None:
        self._announced.set()

    def wait(self, timeout_s: float) -> bool | list[int]:
        """True once announced; the positions of members dead on this host; False at the end
        of ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._announced.wait(max(0.0, min(LOOK_S, left))):
                return True
            dead = sorted(self._positions[rank] for rank in self._liveness.local_deaths()
                          if rank in self._positions)
            if dead:
                self._liveness.confirm_dead(self._generation, [self._members[p] for p in dead])
                return dead
            if left <= 0:
                return False

    def announce(self) -> None:
        """Send the announcement (two requests and one to list it), from the calling thread."""
        number = self._liveness.emit({"k": "decided", "p": self._prefix})
        append_numbers(self._root, self._events, [number])

    def close(self) -> None:
        """Stop hearing announcements for this attempt."""
        self._liveness.expect(self._prefix, None)
