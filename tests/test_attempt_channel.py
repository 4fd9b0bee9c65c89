"""A rebuild's agreement hears its outcome through the listeners, and a member that dies while the
others wait ends the attempt at once (``commgroups/rank_loss/attempt_channel.py``).

Threads over one ``HashStore`` stand for the ranks; the listener is a stand-in that delivers the
``decided`` events in this process (the world test is ``test_rebuild.py``'s second loss during a
rebuild).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import HashStore, PrefixStore  # type: ignore[attr-defined]

from commgroups.creation.agreement import agree
from commgroups.errors import AgreementTimeoutError, SurvivorLostError
from commgroups.rank_loss.attempt_channel import AttemptChannel
from commgroups.util.store_reads import read_numbers


class _Listeners:
    """Every rank's listener in one: ``emit`` calls each rank's handler for the prefix."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[int, str], Callable[[dict[str, Any]], None]] = {}
        self.emitted: list[dict[str, Any]] = []
        self.dead: list[int] = []  # processes gone on the host
        self.confirmed: list[tuple[int, list[int]]] = []

    def of(self, rank: int) -> _Listener:
        return _Listener(self, rank)


class _Listener:
    def __init__(self, shared: _Listeners, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def expect(self, prefix: str, handler: Callable[[dict[str, Any]], None] | None) -> None:
        if handler is None:
            self.shared.handlers.pop((self.rank, prefix), None)
        else:
            self.shared.handlers[(self.rank, prefix)] = handler

    def emit(self, event: dict[str, Any]) -> int:
        self.shared.emitted.append(event)
        for (_rank, prefix), handler in list(self.shared.handlers.items()):
            if prefix == event["p"]:
                handler(event)
        return len(self.shared.emitted)

    def local_deaths(self) -> list[int]:
        return list(self.shared.dead)

    def confirm_dead(self, generation: int, ranks: Collection[int]) -> None:
        self.shared.confirmed.append((generation, sorted(ranks)))


def _agree_all(positions: list[int], members: tuple[int, ...], listeners: _Listeners,
               root: Any, timeout_s: float) -> dict[int, Any]:
    """Run ``agree`` for each position in ``positions`` on a thread of its own; what each
    returned or raised."""
    store = PrefixStore("agree/0/", root)
    results: dict[int, Any] = {}

    def run(position: int) -> None:
        channel = AttemptChannel(listeners.of(members[position]), "agree/0/",  # type: ignore[arg-type]
                                 members, 4, root, "rebuild/5/agreed")
        try:
            results[position] = agree(store, position, len(members), {"layout": "same"},
                                      timedelta(seconds=timeout_s), members=members,
                                      channel=channel)
        except Exception as error:  # the outcome under test
            results[position] = error
        finally:
            channel.close()

    threads = [threading.Thread(target=run, args=(p,)) for p in positions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_the_outcome_is_announced_once_and_heard_by_every_waiting_rank() -> None:
    root, listeners = HashStore(), _Listeners()
    results = _agree_all([0, 1, 2], (3, 7, 9), listeners, root, timeout_s=30)
    assert all(not isinstance(result, Exception) for result in results.values()), results
    assert [event["k"] for event in listeners.emitted] == ["decided"]  # the last rank in's
    assert read_numbers(root, "rebuild/5/agreed") == [1], "listed, to be deleted later"
    assert listeners.handlers == {}, "every channel closed"


def test_a_member_dead_on_the_host_ends_the_attempt_for_everyone() -> None:
    """Global rank 9 never arrives: its process is gone. Before, the others waited out the
    attempt's timeout (``create_timeout_s``, 300 s by default)."""
    root, listeners = HashStore(), _Listeners()
    listeners.dead = [9, 11]  # 11: no member of the attempt (lost before), left alone
    results = _agree_all([0, 1], (3, 7, 9), listeners, root, timeout_s=120)
    for position in (0, 1):
        error = results[position]
        assert isinstance(error, SurvivorLostError) and error.lost == (9,), results
        assert "rank(s) [9] died after the survivors were decided" in str(error)
        assert f"rank {(3, 7)[position]}: rebuild() stopped" in str(error)
    assert [event["k"] for event in listeners.emitted] == ["decided"]  # the one that gave up
    assert (4, [9]) in listeners.confirmed, "the next check-in counts it dead at once"


def test_a_waiting_rank_with_nothing_heard_gives_up_at_its_timeout() -> None:
    root, listeners = HashStore(), _Listeners()
    channel = AttemptChannel(listeners.of(0), "p/", (0, 1), 0, root, "e")  # type: ignore[arg-type]
    assert channel.wait(0.3) is False
    listeners.of(1).emit({"k": "decided", "p": "p/"})
    assert channel.wait(30) is True
    channel.close()


@pytest.mark.parametrize("dead", [[1], [0, 1]])
def test_a_death_is_told_by_position(dead: list[int]) -> None:
    root, listeners = HashStore(), _Listeners()
    listeners.dead = [5 + rank for rank in dead]
    channel = AttemptChannel(listeners.of(4), "p/", (4, 5, 6), 2, root, "e")  # type: ignore[arg-type]
    assert channel.wait(30) == [position + 1 for position in dead]
    channel.close()


def test_a_rebuilds_agreement_that_times_out_names_rebuild() -> None:
    """The rank whose own wait ran out first said ``GroupRegistry.create()`` and told the caller
    to make every rank call it, in the middle of a rebuild."""
    store = PrefixStore("agree/0/", HashStore())
    with pytest.raises(AgreementTimeoutError) as raised:
        agree(store, 0, 2, {"layout": "same"}, timedelta(seconds=0.3), members=(4, 6))
    said = str(raised.value)
    assert "rank 4: rebuild() timed out" in said and "create()" not in said, said
    assert "ranks that never arrived: [6]" in said, said
