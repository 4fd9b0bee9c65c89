"""commgroups.rank_loss.liveness: a generation's loss events are deleted once every listener is
past them, the later reports of the same loss included. A real TCPStore in this process."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from commgroups.rank_loss.liveness import Liveness

_NAMESPACE = "job/"
_MEMBERS = [0, 1, 2, 3]


@pytest.fixture
def store() -> Iterator[TCPStore]:
    yield TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=5))


def _live(store: TCPStore, rank: int) -> Liveness:
    live = Liveness(store, store, _NAMESPACE, rank, interval_s=10.0, dead_after_s=1.0,
                    on_loss=lambda generation, suspects: None)
    live.watch(0, _MEMBERS)
    return live


def _events(store: TCPStore) -> list[int]:
    keys = PrefixStore(_NAMESPACE, store)
    count = int(keys.add("event/count", 0))
    return [number for number in range(1, count + 1) if keys.check([f"event/{number}"])]


def test_every_report_of_a_loss_goes_by_the_next_release(store: TCPStore) -> None:
    """Each rank that calls rebuild() before it heard the first report sends its own (other
    suspects: itself); those events stayed until the registry closed (four keys over ten
    rebuilds of 4 loaded ranks)."""
    first, second = _live(store, 0), _live(store, 1)
    assert first.report(0, "test", {0})
    second.report(0, "test", {1})  # before it heard rank 0's: a second event
    assert _events(store) == [1, 2]
    first.release(0, _MEMBERS)  # nobody answered yet: nothing can go now
    assert _events(store) == [1, 2]
    keys = PrefixStore(_NAMESPACE, store)
    assert not keys.check(["lost/0"]) and not keys.check(["lost/0/events"])
    first.release(1, _MEMBERS)  # the next generation's release: every listener is past them
    assert _events(store) == []


def test_a_release_that_every_survivor_answered_deletes_the_first_report_at_once(
        store: TCPStore) -> None:
    lives = [_live(store, rank) for rank in _MEMBERS]
    lives[0].report(0, "test", {3})
    for live in lives[:3]:
        live.take(1)  # each listener answers as it handles the event
    lives[0].release(0, _MEMBERS[:3])
    assert _events(store) == []
