"""The starter thread sends generation 0's note that a rank is done creating: close() right after
create() waits for it, never for the create timeout (real gloo ranks)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import commgroups as cg
from commgroups import torch_internals
from commgroups.creation import store_keys
from commgroups.rank_loss.liveness import own_connection
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


def _store_used_right_after_create(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's starter sends its note only once rank 0's main thread has used the job's store
    after create() (as a ``new_group``'s rendezvous does, waiting for its peers' addresses)."""
    add = store_keys.AttemptStore.add

    def note_after_rank_0_used_the_store(self: store_keys.AttemptStore, key: str,
                                         amount: int) -> int:
        if (rank == 1 and key == "created/count"
                and threading.current_thread() is not threading.main_thread()):
            # On a connection of its own: this rank's shared one is not what is tested.
            own = own_connection(torch_internals.default_store(), timedelta(seconds=30))
            assert own is not None
            own.wait(["after-create/0"], timedelta(seconds=3 * CREATE_TIMEOUT_S))
        return add(self, key, amount)

    store_keys.AttemptStore.add = note_after_rank_0_used_the_store  # type: ignore[method-assign]
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": world_size}),
                                create_timeout_s=CREATE_TIMEOUT_S).create()
    time.sleep(0.2)  # rank 0's starter would be waiting for rank 1's note by now
    torch_internals.default_store().set(f"after-create/{rank}", "1")
    liveness = registry._recovery.liveness
    beating = liveness is not None and liveness.announced(10.0)
    registry.close()
    return {"beating": beating}


def test_the_starter_leaves_the_jobs_store_connection_free(capfd: pytest.CaptureFixture[str],
                                                           ) -> None:
    """Before the fix each rank's starter waited for every rank's note (at most 1 s) on the
    job's shared connection, so the main thread's next store request waited with it: on 8 gloo
    ranks a ``new_group`` right after ``create()`` took 1.02 s in 6 of 6 worlds, and the ranks
    printed torch's "waitForInput ... timed out" warnings. Here rank 1's note needs rank 0's
    request, so rank 0's wait ran out, with the warnings."""
    results = run_world(_store_used_right_after_create, 2, timeout=3 * CREATE_TIMEOUT_S)
    assert all(result["beating"] for result in results), results
    printed = capfd.readouterr().err
    assert "timed out" not in printed, printed
