"""The starter thread sends generation 0's note that a rank is done creating: close() right after
create() waits for it, never for the create timeout (real gloo ranks)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import commgroups as cg
from commgroups.creation import store_keys
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
