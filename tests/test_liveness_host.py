"""commgroups.rank_loss.liveness: a rank that learned which processes share its host
(``learn_host``) answers a loss without reading its host's key, and still confirms a death on its
own host at once. A real TCPStore in this process, its requests counted; the dead process is a
pid that no process has."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from commgroups.bench.control_plane import CountingStore
from commgroups.rank_loss.liveness import Liveness
from commgroups.rank_loss.local_peers import ProcessId, host_key, this_process

pytestmark = pytest.mark.skipif(this_process() is None, reason="no /proc: not Linux")

_NAMESPACE = "job/"
_NO_SUCH_PID = (1 << 22) + 7  # above Linux's largest pid_max: never a process


@pytest.fixture
def store() -> Iterator[CountingStore]:
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                      timeout=timedelta(seconds=5))
    yield CountingStore(TCPStore("127.0.0.1", int(server.port), 1, False,
                                 timeout=timedelta(seconds=5)))


def _listener(store: CountingStore, rank: int, process: ProcessId | None) -> Liveness:
    live = Liveness(store, store, _NAMESPACE, rank, interval_s=10.0, dead_after_s=1.0,
                    on_loss=lambda generation, suspects: None, process=process)
    live.anchor()
    return live


def _hosts(store: CountingStore) -> ProcessId:
    """Ranks 0 and 1 on this host (1's process is gone), ranks 2 and 3 on another."""
    here = this_process()
    assert here is not None
    elsewhere = ProcessId(host=here.host + "-elsewhere", pid=here.pid, start=here.start)
    dead = ProcessId(host=here.host, pid=_NO_SUCH_PID, start=1)
    for rank, process in ((0, here), (1, dead), (2, elsewhere), (3, elsewhere)):
        PrefixStore(_NAMESPACE, store).append(host_key(process.host), process.entry(rank))
    return here


def _heard(store: CountingStore, live: Liveness, reporter: Liveness, generation: int,
           suspect: int | None) -> tuple[int, str | None]:
    """``reporter`` reports a loss of ``suspect`` (None: nobody named) in ``generation``;
    ``live`` takes the event: the requests that cost it, and the confirmed dead."""
    for each in (live, reporter):
        each.watch(generation, [0, 1, 2, 3])
    reporter.report(generation, "test", None if suspect is None else {suspect})
    keys = PrefixStore(_NAMESPACE, store)  # the keys as every Liveness of the job names them
    number = int(keys.add("event/count", 0))
    before = store.requests
    live.take(number)
    spent = store.requests - before
    key = f"lost/{generation}/dead"
    return spent, bytes(keys.get(key)).decode() if keys.check([key]) else None


@pytest.mark.parametrize("suspect", [2, None], ids=["named", "nobody-named"])
def test_once_learned_a_loss_costs_no_read_of_the_hosts_key(store: CountingStore,
                                                            suspect: int | None) -> None:
    here = _hosts(store)
    live, reporter = _listener(store, 0, here), _listener(store, 3, None)
    live.learn_host()
    spent, dead = _heard(store, live, reporter, 0, suspect)
    # The event's read, the answer's append and add, and rank 1 (this host, its process gone)
    # confirmed dead from /proc against what learn_host read: one append.
    assert spent == 4
    assert dead == "1,"


def test_before_learning_the_hosts_key_is_read(store: CountingStore) -> None:
    here = _hosts(store)
    live, reporter = _listener(store, 0, here), _listener(store, 3, None)
    spent, dead = _heard(store, live, reporter, 0, None)
    assert spent == 5  # and the host's key read
    assert dead == "1,"


def test_a_rank_published_after_learning_is_left_to_its_other_peers(
        store: CountingStore) -> None:
    here = _hosts(store)
    live, reporter = _listener(store, 0, here), _listener(store, 3, None)
    live.learn_host()
    late = ProcessId(host=here.host, pid=_NO_SUCH_PID + 1, start=1)
    PrefixStore(_NAMESPACE, store).append(host_key(here.host), late.entry(4))
    spent, dead = _heard(store, live, reporter, 0, None)
    # Rank 4 is unknown to this rank: not confirmed here (a peer that read later does, or
    # dead_after_s judges it); rank 1 is.
    assert spent == 4
    assert dead == "1,"


def test_a_read_without_its_own_entry_is_not_kept(store: CountingStore) -> None:
    here = _hosts(store)
    live, reporter = _listener(store, 5, here), _listener(store, 3, None)  # rank 5: not published
    live.learn_host()
    spent, dead = _heard(store, live, reporter, 0, None)
    # Its own entry had not landed when it read: the loss reads the key as before learning.
    assert spent == 5
    assert dead == "1,"
