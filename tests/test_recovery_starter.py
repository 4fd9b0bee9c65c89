"""Recovery's starter thread (generation 0's heartbeat and flight publisher, started off
create()'s path): every verb waits for it, and never forever."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from commgroups.rank_loss import recovery as recovery_module
from commgroups.rank_loss.recovery import Recovery


def test_a_verb_waits_for_the_starter_then_never_again() -> None:
    recovery = Recovery(rank=0, registry_id=0)
    done = threading.Event()
    recovery.starter = done
    # The clock starts before the timer: a loaded machine may run the timer's thread before
    # this one reads the clock again (CI saw 39 ms measured after a 50 ms timer).
    start = time.monotonic()
    threading.Timer(0.05, done.set).start()
    recovery.wait_started()
    assert done.is_set() and time.monotonic() - start >= 0.04
    assert recovery.starter is None
    recovery.wait_started()  # nothing left to wait for


def test_a_starter_stuck_on_the_store_does_not_hang_the_verb(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(recovery_module, "STARTER_WAIT_S", 0.05)
    recovery = Recovery(rank=3, registry_id=0)
    recovery.starter = threading.Event()  # never set: its store request never returns
    with caplog.at_level(logging.WARNING, logger=recovery_module.__name__):
        recovery.close(0, first=False)
    assert "rank 3: the heartbeat's starter has not finished" in caplog.text
    assert recovery.starter is None
