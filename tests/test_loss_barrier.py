"""LossBarriers in one process, on a real TCPStore: the barrier a loss report ends, its look for
deaths on this host, and its errors raised on the caller's thread. The 4-rank world is in
tests/test_liveness.py (``test_a_store_barrier_ends_on_the_loss_report_not_its_timeout``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import pytest
import torch.distributed as dist

from commgroups.errors import AgreementTimeoutError, LossInterruptedError
from commgroups.rank_loss.loss_barrier import LOCAL_LOOK_S, LossBarriers


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))


def test_a_death_seen_on_this_host_is_reported_and_ends_the_wait() -> None:
    """Rank 1 of 2 never arrives; from 0.3 s its process is gone. The report (here: the wake the
    listener's thread would make on hearing it) ends the wait within a look, not at 30 s."""
    store, barriers = _store(), LossBarriers()
    gone_at = time.monotonic() + 0.3
    reports: list[list[int]] = []

    def local_deaths() -> Sequence[int]:
        return [1] if time.monotonic() >= gone_at else []

    def report(dead: Sequence[int]) -> None:
        reports.append(list(dead))
        barriers.wake(store, 7, rank=0)  # what the listener does on hearing it

    started = time.monotonic()
    with pytest.raises(LossInterruptedError, match=r"rank 0: a rank-loss report in generation 7 "
                       r"ended the wait for every rank at the switch"):
        barriers.wait(store, "b", 0, (0, 1), timedelta(seconds=30), "the switch", 7,
                      lambda generation: False, local_deaths, report)
    assert 0.3 <= time.monotonic() - started < 0.3 + LOCAL_LOOK_S + 2.0
    assert reports == [[1]]  # once, not at every look
    assert barriers.pending == {}


def test_a_report_heard_before_the_wait_ends_it_at_once() -> None:
    barriers = LossBarriers()
    with pytest.raises(LossInterruptedError):
        barriers.wait(_store(), "b", 0, (0, 1), timedelta(seconds=30), "the switch", 3,
                      lambda generation: generation == 3)
    assert barriers.pending == {}


def test_a_rank_that_never_comes_is_named_on_the_callers_thread() -> None:
    barriers = LossBarriers()
    with pytest.raises(AgreementTimeoutError, match=r"ranks that never arrived: \[5\]"):
        barriers.wait(_store(), "b", 0, (4, 5), timedelta(seconds=1), "the switch", 0,
                      lambda generation: False)


def test_everyone_arrived_returns() -> None:
    barriers = LossBarriers()
    reports: list[Sequence[int]] = []
    store = _store()
    barriers.wait(store, "b", 0, (0,), timedelta(seconds=5), "the switch", 0,
                  lambda generation: False, lambda: [], reports.append)
    assert reports == [] and barriers.pending == {}
    # Its arrival goes once through (only a timeout's naming reads it); the count and the
    # verdict stay: two keys per call, whatever the world's size.
    assert not store.check(["b/0"]) and store.check(["b/count", "b/all"])


def test_a_barrier_has_one_outcome_for_every_rank_whoever_wrote_it_first() -> None:
    """A loss report's wake and the last arrival both write the barrier's outcome; the first
    write stands for every rank (a false report: a rank slow on loaded cores). Before, a write
    after the other made ranks that had read "passed" go on while the rest raised."""
    from commgroups.creation.agreement import store_barrier
    from commgroups.rank_loss.loss_barrier import LOST

    store, barriers = _store(), LossBarriers()
    # The report came first: the last rank to arrive reads it too, and raises like the others.
    barriers.pending["early"] = 3
    barriers.wake(store, 3, rank=0)
    store_barrier(store, "early", 0, 1, timedelta(seconds=5), "the switch")
    assert bytes(store.get("early/all")).decode() == LOST
    # Every rank arrived first: a report heard after that changes nothing.
    store_barrier(store, "late", 0, 1, timedelta(seconds=5), "the switch")
    barriers.pending["late"] = 3
    barriers.wake(store, 3, rank=0)
    assert bytes(store.get("late/all")).decode() == "1"
