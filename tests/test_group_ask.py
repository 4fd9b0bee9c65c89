"""A group ask on a real TCPStore, in one process: the members that reached the failed call answer
by joining (one add each), the first asks, collects and names the silent member, and every other
member takes the asker's diagnosis instead of collecting its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from commgroups.bench.control_plane import CountingStore
from commgroups.flight_recorder.diagnosis import Diagnosis, diagnose
from commgroups.flight_recorder.publisher import (
    BLOCK_MEMBERS,
    StatusPublisher,
    answer_waits,
    collect,
)

ROLE = "dp"
FAILED = {"op": "all_reduce", "seq": 4, "group_seq": 4, "caller": "train.py:9 in step"}
CALL = "4-4-all_reduce"
MEMBERS = list(range(2 * BLOCK_MEMBERS + 8))  # three join counters
SILENT = 40


def _status(count: int) -> dict[str, Any]:
    return {ROLE: {"seq": count, "group_seq": count,
                   "last": {"op": "all_reduce", "seq": count, "group_seq": count,
                            "caller": "train.py:9 in step", "state": "failed"}}}


@pytest.fixture
def store() -> Iterator[CountingStore]:
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    yield CountingStore(server)


class _Events:
    """What a listener would deliver: every emitted event, numbered; known() calls noted."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.known: dict[int, list[int]] = {}

    def emit(self, event: dict[str, Any]) -> int:
        self.events.append(event)
        return len(self.events)

    def publisher(self, store: CountingStore, rank: int) -> StatusPublisher:
        status = _status(4)
        publisher = StatusPublisher(store, "f/", rank, lambda: status,
                                    answer=lambda role, asker: {"status": status})
        publisher.listen_through(self.emit, lambda prefix, handler: None,
                                 known=lambda number: self.known.setdefault(rank, []).append(
                                     number))
        return publisher


def test_members_at_the_call_answer_by_joining_and_the_asker_names_the_silent_one(
        store: CountingStore) -> None:
    events = _Events()
    publishers = {rank: events.publisher(store, rank) for rank in MEMBERS}
    StatusPublisher(store, "f/", SILENT, lambda: _status(3)).publish_now()  # then it hung

    asker = publishers[0].ask_group(ROLE, 0, CALL, {}, FAILED, MEMBERS)
    assert asker.first and len(events.events) == 1
    assert events.events[0]["m"] == len(MEMBERS)
    costs = {}
    for rank in MEMBERS[1:]:
        if rank == SILENT:
            continue
        before = store.requests
        ask = publishers[rank].ask_group(ROLE, 0, CALL, {}, FAILED, MEMBERS)
        assert not ask.first and ask.key == asker.key
        costs[rank] = store.requests - before
    # One add each, which is also the answer; each learned the ask's event number from it
    # (the asker marked every counter), so its listener will not read that event.
    assert set(costs.values()) == {1}, costs
    assert all(events.known[rank] == [1] for rank in costs), events.known
    assert not store.check([f"{asker.key}/answers"])  # nobody appended: every one joined

    published = collect(publishers[0], asker.key, MEMBERS, ROLE, FAILED, wait_s=2.0,
                        shortest_s=0.3)
    found = diagnose(ROLE, 0, FAILED, published, 1)
    assert [state.rank for state in found.where("silent")] == [SILENT]
    assert len(found.where("reached")) == len(MEMBERS) - 2

    # Every other member takes the asker's diagnosis: same text, its own rank, the asker reached.
    publishers[0].share(asker.key, found.share())
    shared = events.events[-1]
    assert shared["q"] == asker.key and "d" in shared
    publishers[7]._heard(shared)
    taken = publishers[7].shared(asker.key, 1.0)
    assert taken is not None
    mine = Diagnosis.from_share(taken, ROLE, 7, FAILED, MEMBERS)
    assert mine.text() == found.text() and mine.asker == 0 and mine.rank == 7
    assert 0 in [state.rank for state in mine.where("reached")]
    assert 7 not in [state.rank for state in mine.ranks]
    assert mine.to_dict()["silent"] == [SILENT]


def test_a_member_whose_listener_answered_joins_with_no_request(store: CountingStore) -> None:
    events = _Events()
    asker, late = events.publisher(store, 0), events.publisher(store, 1)
    ask = asker.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    late._heard(events.events[0])  # its listener heard the ask first and answered it
    lines = store.get(f"{ask.key}/answers").decode().splitlines()
    assert lines == ["1"]  # at the asked call: its rank alone
    before = store.requests
    assert late.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1]) == (ask.key, False)
    assert store.requests == before


def test_a_member_elsewhere_answers_with_its_status(store: CountingStore) -> None:
    events = _Events()
    asker = events.publisher(store, 0)
    behind = StatusPublisher(store, "f/", 1, dict,
                             answer=lambda role, who: {"status": _status(3)})
    behind.listen_through(events.emit, lambda prefix, handler: None)
    ask = asker.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    assert not behind.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1]).first
    (line,) = store.get(f"{ask.key}/answers").decode().splitlines()
    assert json.loads(line)["r"] == 1
    published = collect(asker, ask.key, [0, 1], ROLE, FAILED, wait_s=1.0, shortest_s=0.1)
    assert [state.rank for state in diagnose(ROLE, 0, FAILED, published, 1).where("behind")] \
        == [1]


def test_a_member_reads_the_diagnosis_once_where_the_event_never_came(
        store: CountingStore) -> None:
    events = _Events()
    asker, member = events.publisher(store, 0), events.publisher(store, 1)
    ask = asker.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    member.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    assert member.shared(ask.key, 0.1) is None  # nothing shared yet: the asker died, say
    asker.share(ask.key, {"asker": 0, "more": {}, "ranks": []})
    before = store.requests
    assert member.shared(ask.key, 0.1) == {"asker": 0, "more": {}, "ranks": []}
    assert store.requests - before == 1  # its listener missed the event: one read at the end


def test_one_member_takes_over_from_an_asker_that_died_and_the_others_take_its_diagnosis(
        store: CountingStore) -> None:
    # Every member whose wait for the asker's diagnosis ran out asks to take over: one add each.
    # The first collects (one read of the answers) and shares; the others take that, where
    # each reading the answers was O(N) each.
    events = _Events()
    asker, *members = [events.publisher(store, rank) for rank in range(4)]
    ask = asker.ask_group(ROLE, 0, CALL, {}, FAILED, range(4))
    for member in members:
        member.ask_group(ROLE, 0, CALL, {}, FAILED, range(4))
    before = store.requests
    takers = [member.take_over(ask.key) for member in members]
    assert takers == [True, False, False] and store.requests - before == 3
    taker = members[0]
    published = collect(taker, ask.key, range(4), ROLE, FAILED, wait_s=0.0, shortest_s=0.0)
    found = diagnose(ROLE, taker.rank, FAILED, published, 1)
    taker.share(ask.key, {**found.share(), "timed_out": True})
    for member in members[1:]:
        member._take_share(ask.key, events.events[-1]["d"])  # as each listener would
        assert member.shared(ask.key, 1.0) == {**found.share(), "timed_out": True}


def test_a_member_passes_over_a_diagnosis_it_does_not_accept(store: CountingStore) -> None:
    events = _Events()
    asker, member = events.publisher(store, 0), events.publisher(store, 1)
    ask = asker.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    member.ask_group(ROLE, 0, CALL, {}, FAILED, [0, 1])
    loss_wait = {"asker": 0, "more": {}, "ranks": [], "timed_out": False}
    asker.share(ask.key, loss_wait)
    member._take_share(ask.key, loss_wait)
    timed_out = lambda share: share.get("timed_out", True)  # noqa: E731
    assert member.shared(ask.key, 0.2, accept=timed_out) is None  # the event, then the key
    asker.share(ask.key, {**loss_wait, "timed_out": True})  # a taker's, waited as for a timeout
    assert member.shared(ask.key, 0.2, accept=timed_out) == {**loss_wait, "timed_out": True}


def test_a_shared_diagnosis_lists_a_bounded_number_of_ranks_and_counts_the_rest() -> None:
    published = {rank: None if rank % 2 else {"answered": 1, "status": _status(4)}
                 for rank in range(1, 301)}
    found = diagnose(ROLE, 0, FAILED, published, 1)
    share = found.share()
    assert len(share["ranks"]) == 64 and share["more"] == {"left": 150 - 64}
    mine = Diagnosis.from_share(share, ROLE, 2, FAILED, range(301))
    assert mine.text() == found.text()  # "+147 more" either way
    assert mine.to_dict()["more"] == {"left": 86} and mine.where("reached") == []


def test_the_asker_waits_longer_for_a_larger_group_and_stops_early_where_answers_stop() -> None:
    small, _ = answer_waits(1.0, 0.25, 8, timed_out=True, pushed=True)
    large, shortest = answer_waits(1.0, 0.25, 65536, timed_out=True, pushed=True)
    assert small == pytest.approx(2.8, abs=0.01) and large > small + 3
    assert shortest == pytest.approx(1.3)
    _, after_loss = answer_waits(1.0, 0.25, 65536, timed_out=False, pushed=True)
    assert after_loss == pytest.approx(0.15)


def test_the_last_member_to_release_deletes_the_ask_and_its_counters(
        store: CountingStore) -> None:
    events = _Events()
    publishers = [events.publisher(store, rank) for rank in MEMBERS]
    ask = publishers[0].ask_group(ROLE, 0, CALL, {}, FAILED, MEMBERS)
    publishers[0].share(ask.key, {"asker": 0, "more": {}, "ranks": []})
    counters = [f"{ask.key}/joined/{block}" for block in range(3)]
    assert store.check(counters)
    handed = [publisher.release(len(MEMBERS)) for publisher in publishers]
    leftover = [key for key in (*counters, f"{ask.key}/asks", f"{ask.key}/diagnosis",
                                "f/asked/1", "f/requests", "f/events") if store.check([key])]
    assert leftover == []
    # The listener events the ask and its diagnosis sent: handed to the caller by the last
    # member to release, to delete once every listener is past them (they stayed until close).
    assert handed[:-1] == [[]] * (len(MEMBERS) - 1) and handed[-1] == [1, 2]
