"""The starter thread sends generation 0's note that a rank is done creating: close() right after
create() waits for it, never for the create timeout (real gloo ranks)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import commgroups as cg
from commgroups.creation import store_keys
from commgroups.generation.state import Generation
from commgroups.rank_loss.recovery import CREATED_WAIT_S
from tests.worlds import run_world

pytestmark = pytest.mark.world

CREATE_TIMEOUT_S = 30.0


def _close_at_once(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's starter is slow to send its note (0.5 s before the request); every rank closes
    while it is sending."""
    add = store_keys.AttemptStore.add

    def slow_note(self: store_keys.AttemptStore, key: str, amount: int) -> int:
        if (rank == 1 and key == "created/count"
                and threading.current_thread() is not threading.main_thread()):
            time.sleep(0.5)
        return add(self, key, amount)

    store_keys.AttemptStore.add = slow_note  # type: ignore[method-assign]
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": world_size}),
                                create_timeout_s=CREATE_TIMEOUT_S).create()
    time.sleep(0.2)  # rank 1's starter is inside its slow note now
    started = time.monotonic()
    registry.close()
    return {"close_s": time.monotonic() - started}


def test_close_right_after_create_waits_for_the_starters_note_not_the_timeout() -> None:
    """Before the fix, rank 1's close() began waiting for every rank's note on the connection
    its own starter needed to send that note: both ranks waited out create_timeout_s."""
    results = run_world(_close_at_once, 2, timeout=3 * CREATE_TIMEOUT_S)
    for result in results:
        assert result["close_s"] < 10, results


def _starter_waits(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank's starter waits for every rank's note before it starts the heartbeat: first
    with rank 2's note 3 s late (the others go on after CREATED_WAIT_S), then on time."""
    waits: list[tuple[bool, float]] = []
    await_created = Generation.await_created

    def timed(self: Generation, timeout_s: float) -> bool:
        started = time.monotonic()
        done = await_created(self, timeout_s)
        waits.append((done, time.monotonic() - started))
        return done

    Generation.await_created = timed  # type: ignore[method-assign]
    add = store_keys.AttemptStore.add
    late = threading.Event()

    def late_note(self: store_keys.AttemptStore, key: str, amount: int) -> int:
        if (rank == 2 and key == "created/count" and not late.is_set()
                and threading.current_thread() is not threading.main_thread()):
            late.set()
            time.sleep(3.0)
        return add(self, key, amount)

    store_keys.AttemptStore.add = late_note  # type: ignore[method-assign]
    results = {}
    for name in ("late", "on time"):
        registry = cg.GroupRegistry(cg.Layout(dims={"cp": world_size}),
                                    create_timeout_s=CREATE_TIMEOUT_S).create()
        liveness = registry._recovery.liveness
        assert liveness is not None and liveness.announced(10.0), "no heartbeat"
        registry.close()
        results[name] = waits[-1]
    return results


def test_the_starter_waits_for_every_note_at_most_created_wait_s() -> None:
    results = run_world(_starter_waits, 3, timeout=120)
    for rank in (0, 1):  # rank 2's note came 3 s late: they went on after 1 s
        done, waited = results[rank]["late"]
        assert not done and 0.9 * CREATED_WAIT_S <= waited < 2.5, results
    done, waited = results[2]["late"]
    assert done and waited < 3.0 + 1.5, results  # its own late note (3 s) was the last one
    for result in results:  # everyone's note on time: the wait ends at the last one
        assert result["on time"][0], results
