"""commgroups.rank_loss.check_in: the check-in window's default, and the check-in's and the loss
answers' store protocol on a real TCPStore in this process (the world's check-ins are in
tests/test_check_in_world.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # re-exported

from commgroups.bench.control_plane import CountingStore
from commgroups.errors import LeftOutError, RebuildError
from commgroups.layout.specs import Layout, RoleSpec
from commgroups.rank_loss.check_in import (
    CLOSED_MARK,
    CheckIn,
    check_in,
    check_in_at_open_attempt,
    check_in_window,
    close_check_in_attempt,
    forget_check_ins,
    open_check_in_attempt,
    record_made,
    window_slack_s,
)
from commgroups.rank_loss.liveness import Liveness, answer
from tests.test_rebuild import hsdp_layout


def _layout(*timeouts: float | None) -> Layout:
    layout = hsdp_layout()
    roles = [RoleSpec(**{**role.model_dump(), "timeout_s": timeout})
             for role, timeout in zip(layout.roles, [*timeouts, *[None] * len(layout.roles)],
                                      strict=False)]
    return layout.model_copy(update={"roles": roles})


def test_the_default_window_outlasts_the_longest_role_timeout() -> None:
    # A rank whose collective could not be interrupted reaches rebuild() one role timeout after it
    # issued it: a window of exactly that length, started by an earlier reporter, ends first.
    assert check_in_window(None, _layout(3.0), {}, 60) == timedelta(seconds=5)
    assert check_in_window(None, _layout(3.0, 600.0), {}, 60) == timedelta(seconds=900)
    assert check_in_window(None, _layout(1.0), {"fsdp": timedelta(seconds=10)}, 60) == timedelta(
        seconds=15)
    for timeout in (0.5, 3.0, 10.0, 600.0):
        assert window_slack_s(timeout) >= max(2.0, timeout / 2)


def test_without_role_timeouts_the_window_is_create_timeout() -> None:
    assert check_in_window(None, _layout(), {}, 42) == timedelta(seconds=42)


def test_an_explicit_window_is_taken_as_given_and_validated() -> None:
    assert check_in_window(1.5, _layout(3.0), {}, 60) == timedelta(seconds=1.5)
    assert check_in_window(timedelta(seconds=7), _layout(3.0), {}, 60) == timedelta(seconds=7)
    with pytest.raises(ValueError, match="timeout"):
        check_in_window(-1, _layout(3.0), {}, 60)


# ------------------------------------------------------------------ the protocol on a real store
def _store() -> Any:
    """A real TCPStore served in this process (port chosen by the OS)."""
    return TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _liveness(store: Any, rank: int) -> Liveness:
    return Liveness(store, store, "ns/", rank, interval_s=10.0, dead_after_s=1.0,
                    on_loss=lambda generation, suspects: None)


def test_an_answer_is_listed_and_counted_in_two_requests() -> None:
    server = _store()
    reporter = _liveness(server, 0)
    assert reporter.report(0, "rank 3 stopped", {3})
    counted = CountingStore(PrefixStore("ns/", server))
    assert answer(counted, 0, [1])
    assert counted.requests == 2  # the append, the add: nothing read
    assert reporter.answers(0) == 1
    assert reporter.answered(0, [1, 2, 3]) == {1}
    # A second report (other suspects) after an answer is not the first.
    assert not _liveness(server, 2).report(0, "rank 4 stopped", {4})
    assert reporter.answers(0) == 1
    # A host's relay answers for its host's ranks in the same two requests.
    assert answer(counted, 0, [5, 6, 7])
    assert counted.requests == 4
    assert reporter.answers(0) == 4
    assert reporter.answered(0, range(8)) == {1, 5, 6, 7}


def test_answers_that_come_after_the_release_leave_no_key() -> None:
    server = _store()
    reporter = _liveness(server, 0)
    reporter.report(0, "rank 3 stopped", {3})
    assert answer(PrefixStore("ns/", server), 0, [1])
    reporter.release(0, survivors=[0, 1])
    # Two listeners that lagged hear the report only now.
    late = PrefixStore("ns/", server)
    assert not answer(late, 0, [2])
    assert not answer(late, 0, [4])
    assert not late.check(["lost/0"]) and not late.check(["lost/0/here"])


def test_a_rank_that_checks_in_after_the_decision_learns_it_from_its_own_add() -> None:
    server = _store()
    members, window = [0, 1, 2], timedelta(seconds=10)
    decider = CheckIn(server, "check/", 0, members, window, expected=[0, 1])
    assert decider.join()
    early = CountingStore(server)
    follower = CheckIn(early, "check/", 1, members, window, expected=[0, 1])
    assert not follower.join()
    assert early.requests == 2  # the append, the add: no read of the decision yet
    assert decider.look() == frozenset({2})
    late = CheckIn(server, "check/", 2, members, window, expected=[0, 1])
    assert not late.join()
    with pytest.raises(LeftOutError, match="rank 2: checked in to rebuild"):
        late.outcome(late.await_decision())  # read at once, at its join: no wait for a window
    assert follower.outcome(follower.await_decision()) == (0, 1)


class _Answers:
    """A loss report's answers as the decider reads them (Liveness's reading side): ``answered``
    ranks listed, ``count`` counted (more than the live ranks: a report answered twice)."""

    dead_after_s = 0.2
    listening = False

    def __init__(self, answered: set[int], count: int) -> None:
        self._answered, self._count = answered, count

    def answered(self, generation: int, ranks: Any) -> set[int]:
        return self._answered & set(ranks)

    def answers(self, generation: int) -> int:
        return self._count

    def confirmed_dead(self, generation: int) -> set[int]:
        return set()

    def emit(self, event: dict[str, Any]) -> int:  # the decision's push: nobody listens here
        return 0


def test_a_join_while_the_decider_catches_up_is_acted_on_at_its_next_read() -> None:
    """Rank 3 is dead and nobody confirmed it; the answers outnumber the live ranks. The last
    live rank joins right after the decider's read that judged deaths: the decider rereads the
    lists no sooner than _REREAD_S, and must then decide, not wait for its window's end (a join
    seen on a look that did not read used to be used up there: 6 s against 0.24 s)."""
    import time

    from commgroups.rank_loss import check_in as module

    server = _store()
    members, window = [0, 1, 2, 3], timedelta(seconds=6)
    answers = _Answers({0, 1, 2}, count=6)
    decider = CheckIn(server, "check/", 0, members, window, liveness=answers)  # type: ignore[arg-type]
    assert decider.join()
    assert not CheckIn(server, "check/", 1, members, window, liveness=answers).join()  # type: ignore[arg-type]
    started, out, last_in = time.monotonic(), None, False
    while out is None and time.monotonic() - started < 8:
        out = decider.look()
        if decider._judged and not last_in:
            assert not CheckIn(server, "check/", 2, members, window, liveness=answers).join()  # type: ignore[arg-type]
            last_in = True
        time.sleep(module._POLL_S)
    assert out == frozenset({3})
    assert time.monotonic() - started < 3.0  # dead_after_s and a reread or two, not the window


def test_only_the_first_rank_in_reads_the_made_key_and_a_rank_a_generation_late_is_out() -> None:
    server = _store()
    members, window = [0, 1, 2], timedelta(seconds=10)
    record_made(server, "made", 0, 3)  # generation 0 is the one being left
    first = CountingStore(server)
    decider = CheckIn(first, "gen1/0/", 0, members, window, expected=[0, 1], made_key="made")
    assert decider.join()
    assert first.requests == 3  # the append, the add, the made-generation read
    counted = CountingStore(server)
    follower = CheckIn(counted, "gen1/0/", 1, members, window, expected=[0, 1], made_key="made")
    assert not follower.join()
    assert counted.requests == 2  # a follower's add finds the check-in live: no read
    assert decider.look() == frozenset({2})
    assert follower.outcome(follower.await_decision()) == (0, 1)
    # Generation 1 was made by ranks 0 and 1, and a generation later its check-in's keys went.
    record_made(server, "made", 1, 2)
    forget_check_ins(server, "gen1/", 1)
    late = CheckIn(server, "gen1/0/", 2, members, window, expected=[0, 1], made_key="made",
                   generation=0)
    with pytest.raises(LeftOutError, match="generation 1 was made by 2 ranks without it"):
        late.join()  # at once, not after its window
    keys = PrefixStore("gen1/0/", server)
    assert not keys.check(["joined"]) and not keys.check(["count"])  # its own keys went too


def test_a_rank_decided_out_of_a_closed_attempt_is_out_not_sent_on() -> None:
    """Attempt 0 toward generation 1 decided without rank 2, then making the generation failed
    and its survivors closed it. They retry among themselves (``Recovery`` checks in with the
    members the closed attempt chose), so rank 2, late, is out: sent on to attempt 1 it took that
    decision, made over members without it, as one that left it in (it, and a dead rank, counted
    themselves survivors: a world of their own)."""
    server = _store()
    members, window = [0, 1, 2], timedelta(seconds=10)
    decider = CheckIn(server, "gen1/0/", 0, members, window, expected=[0, 1])
    assert decider.join()
    follower = CheckIn(server, "gen1/0/", 1, members, window, expected=[0, 1])
    assert not follower.join()
    assert decider.look() == frozenset({2})
    close_check_in_attempt(server, "gen1/", 0)
    close_check_in_attempt(server, "gen1/", 0)  # the second closer moves nothing further
    assert open_check_in_attempt(server, "gen1/") == 1
    results: dict[int, tuple[tuple[int, ...], int]] = {}

    def survivor(number: int) -> None:  # a retry: it reads the open attempt, over whom 0 chose
        store = server.clone()
        results[number] = check_in_at_open_attempt(
            store, "gen1/", open_check_in_attempt(store, "gen1/"), number,
            lambda keys: check_in(store, keys, number, [0, 1], window, expected=[0, 1]))

    threads = [threading.Thread(target=survivor, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {0: ((0, 1), 1), 1: ((0, 1), 1)}
    # Rank 2 closed nothing: it starts at attempt 0 unread, and learns there that it is out.
    with pytest.raises(LeftOutError, match="rank 2: checked in to rebuild"):
        check_in_at_open_attempt(
            server, "gen1/", 0, 2,
            lambda keys: check_in(server, keys, 2, members, window, expected=None))


def test_an_attempt_marked_closed_whose_closer_died_before_moving_on_is_moved_on() -> None:
    server = _store()
    members, window = [0, 1], timedelta(seconds=10)
    # The closer's mark landed; its move of the open attempt never did.
    PrefixStore("gen1/0/", server).add("count", CLOSED_MARK)
    assert check_in_at_open_attempt(
        server, "gen1/", 0, 0,
        lambda keys: check_in(server, keys, 0, members, window, expected=[0])) == ((0,), 1)
    assert open_check_in_attempt(server, "gen1/") == 1


def test_without_a_heartbeat_a_minority_decides_nothing() -> None:
    """Heartbeats off (no listener) and no alive= list: nothing says an absent member is dead,
    so the ranks in decide only as a majority of every member; a lone rebuild() on one rank of
    three raises at its window's end instead of deciding a world of its own (a split)."""
    server = _store()
    members, window = [0, 1, 2], timedelta(seconds=10)
    lone = CheckIn(server, "lone/", 0, members, window)
    assert lone.join()
    with pytest.raises(RebuildError, match="no majority"):
        lone.look(final=True)
    pair = CheckIn(server, "pair/", 0, members, window)
    assert pair.join()
    assert not CheckIn(server, "pair/", 1, members, window).join()
    assert pair.look(final=True) == frozenset({2})  # two of three: a majority decides
