"""commgroups.rank_loss.host_relay in real processes: a relay whose process is stopped
(SIGSTOP) leaves its feeds within the silence, and a job whose host's relay is killed or stopped
rebuilds without it, every other rank answering the loss report through the store (real gloo
worlds, every rank on this host: one of them relays for all)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from commgroups import GroupRegistry, torch_internals
from commgroups.creation.agreement import store_barrier
from commgroups.rank_loss.host_relay import HELLO, SILENT_S, HostRelay, RelayFeed, relay_address
from commgroups.rank_loss.liveness import REPORT, Liveness
from commgroups.rank_loss.local_peers import host_key, this_process
from tests.polling import until
from tests.test_rebuild import hsdp_layout
from tests.worlds import connected_barrier, relay_rank, run_world

pytestmark = [pytest.mark.world,
              pytest.mark.skipif(this_process() is None, reason="no /proc: not Linux")]

_NAMESPACE = "job/"
WINDOW_S = 30.0  # the check-in's window: a rebuild that waited it out would take this long


@pytest.fixture
def port() -> Iterator[int]:
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    yield int(server.port)


def _relay_process(port: int, address: str, ready: Any) -> None:
    relay = HostRelay(address, PrefixStore(_NAMESPACE, TCPStore(
        "127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))), 1, lambda: False)
    relay.start()
    ready.set()
    time.sleep(60)


def test_a_feed_whose_relay_stopped_ends_within_the_silence(port: int) -> None:
    # A relay whose process is stopped (SIGSTOP; or one holding the GIL in C) keeps its socket
    # open and sends nothing: its feeds give up after SILENT_S, and their listeners go back to
    # the store, in time to answer a loss report within the check-in's dead_after_s (1 s).
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    address = relay_address(_NAMESPACE, "host", 0, os.getpid(), 1)
    process = context.Process(target=_relay_process, args=(port, address, ready), daemon=True)
    process.start()
    try:
        assert ready.wait(60)
        feed = RelayFeed.connect(address)
        assert feed is not None
        assert feed.receive(lambda: False) == (HELLO, b"1")
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert feed.receive(lambda: False) is None
        assert SILENT_S * 0.8 < time.monotonic() - started < SILENT_S + 0.5
    finally:
        process.kill()
        process.join(10)


def _relay_lost(rank: int, world: int, how: str) -> dict[str, Any]:
    layout = hsdp_layout({"dp_replicate": world // 2, "dp_shard": 2})
    registry = GroupRegistry(layout, create_timeout_s=30).create()
    relay = relay_rank(registry, rank, world)
    store = torch_internals.default_store()
    if how == "killed":
        connected_barrier(registry, rank, world, victim=relay)  # it exits; the rest go on
    else:
        store.set(f"tests/pid/{rank}", str(os.getpid()))
        store_barrier(store, "tests/before-stop", rank, world, timedelta(seconds=30),
                      "the stop")
        if rank == relay:
            os.kill(os.getpid(), signal.SIGSTOP)  # killed below by a survivor
        time.sleep(0.2)
    started = time.monotonic()
    report = registry.rebuild(timeout=WINDOW_S)  # no alive=: nobody says who died
    seconds = time.monotonic() - started
    live = registry._recovery.liveness  # None on a rank the rebuild left out
    relayed = live is not None and live.relayed
    total = torch.ones(1)
    if report.place == "member":
        registry.collectives("checkpoint-metadata").all_reduce(total)
        if how == "stopped" and rank == min(report.members):
            os.kill(int(store.get(f"tests/pid/{relay}")), signal.SIGKILL)
    registry.close()
    return {"relay": relay, "lost": report.lost, "members": report.members,
            "place": report.place, "sum": float(total.item()), "seconds": seconds,
            "relayed": relayed}


@pytest.mark.parametrize(("how", "world"), [("killed", 4), ("killed", 8), ("stopped", 4)])
def test_a_job_rebuilds_without_its_hosts_relay(how: str, world: int) -> None:
    # Killed: its feeds close at once. Stopped: they hear nothing for SILENT_S. Either way every
    # other rank answers the loss report through the store in time, so only the relay (and its
    # HSDP replica partner, by the layout's rules) is left out: nobody alive is counted dead.
    # (8 ranks: when every listener opened its store connection only as its relay died, some
    # stalled seconds and were decided out.)
    results = run_world(_relay_lost, world, how, timeout=120, expect_errors=True)
    relays = {result["relay"] for result in results if isinstance(result, dict)}
    assert len(relays) == 1, results
    relay = relays.pop()
    partner = relay ^ 1
    members = tuple(sorted(set(range(world)) - {relay, partner}))
    assert isinstance(results[partner], dict) and results[partner]["place"] == "dropped"
    for rank in members:
        result = results[rank]
        assert isinstance(result, dict), (rank, result)
        assert result["lost"] == (relay,) and result["members"] == members, result
        assert result["sum"] == float(len(members))
        assert result["seconds"] < WINDOW_S / 3, result  # decided, not waited out
        assert not result["relayed"]  # back on the store


def _relay_rank_zero(port: int, namespace: str, ready: Any) -> None:
    """Rank 0 of this host: publishes its process first, then relays for the host."""
    process = this_process()
    assert process is not None
    store = TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))
    PrefixStore(namespace, store).append(host_key(process.host), process.entry(0))
    relay = HostRelay(relay_address(namespace, process.host, 0, process.pid, process.start),
                      lambda: PrefixStore(namespace, TCPStore(
                          "127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))),
                      1, lambda: False)
    relay.start()
    ready.set()
    time.sleep(60)


def test_a_listener_goes_back_to_its_relay_once_it_answers_again(port: int) -> None:
    # Its relay's process stopped for a while (a loaded host): the listener went back to the
    # store, and after an event it tries the relay again (REJOIN_AFTER_S; none here).
    namespace = "rejoin/"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_relay_rank_zero, args=(port, namespace, ready),
                              daemon=True)
    process.start()
    heard: list[str] = []
    client = TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))
    events = PrefixStore(namespace, client)
    try:
        assert ready.wait(60)
        live = Liveness(lambda: TCPStore("127.0.0.1", port, 1, False,
                                         timeout=timedelta(seconds=30)),
                        client, namespace, 1, interval_s=10.0, dead_after_s=1.0,
                        on_loss=lambda generation, suspects: None, process=this_process(),
                        relay=True)
        live.rejoin_after_s = 0.0
        live.subscribe("p/", lambda event: heard.append(str(event["x"])))
        live.anchor()
        live.publish_process()
        live.start_listener()
        assert until(lambda: live.relayed)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
        assert until(lambda: not live.relayed)  # quiet for SILENT_S: on the store
        os.kill(process.pid, signal.SIGCONT)
        Liveness._emit(events, {"k": "ask", "p": "p/", "x": "on the store"})
        assert until(lambda: heard == ["on the store"] and live.relayed)
        Liveness._emit(events, {"k": "ask", "p": "p/", "x": "relayed again"})
        assert until(lambda: heard == ["on the store", "relayed again"])
        assert live.relayed
        live.close()
    finally:
        process.kill()
        process.join(10)


BACKSTOP_S = 10.0  # the beat's first report of a silent rank: ten dead_after_s (1 s) at least


def _idle_when_one_goes(rank: int, world: int, who: str, how: str) -> dict[str, Any]:
    """Every rank idle (no collective, no barrier) while ``who`` (the host's relay, or a rank
    it feeds) is SIGKILLed, or closes its registry and exits: when do the others hear a loss?"""
    registry = GroupRegistry(hsdp_layout({"dp_replicate": world // 2, "dp_shard": 2}),
                             create_timeout_s=30).create()
    relay = relay_rank(registry, rank, world)
    victim = relay if who == "relay" else max(set(range(world)) - {relay})
    store = torch_internals.default_store()
    store_barrier(store, "tests/idle", rank, world, timedelta(seconds=30), "idle")
    if rank == victim:
        store.set("tests/gone_at", repr(time.time()))
        if how == "returned":  # no close(): its process ends through multiprocessing's exit
            return {"victim": victim}
        if how == "closed":
            registry.close()  # its feed says goodbye (or its relay, left) as it closes
        os.kill(os.getpid(), signal.SIGKILL)  # the same end either way: no exit hook runs
    live = registry._recovery.liveness
    assert live is not None
    deadline = time.monotonic() + (2.0 if how != "killed" else BACKSTOP_S * 0.8)
    while not live.heard(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    heard_at = time.time()
    gone_at = float(store.get("tests/gone_at"))
    suspects = live._interrupted.get(0, set())
    answers = ""
    if live.heard(0):  # every survivor's answer in (the report's counter: REPORT and theirs)
        until(lambda: int(live._shared.add("lost/0", 0)) % REPORT >= world - 1)
        answers = bytes(live._shared.get("lost/0/here")).decode()
        count = int(live._shared.add("lost/0", 0)) % REPORT
    store_barrier(store, "tests/read", rank, world - 1, timedelta(seconds=30), "the reads")
    registry.close()
    return {"victim": victim, "heard": live.heard(0), "after_s": heard_at - gone_at,
            "suspects": None if suspects is None else sorted(suspects),
            "answers": answers, "count": count if answers else 0}


@pytest.mark.parametrize(("who", "how"), [(who, how) for how in ("killed", "closed", "returned")
                                          for who in ("fed", "relay")])
def test_a_death_on_the_host_is_reported_at_once_while_every_rank_is_idle(who: str,
                                                                          how: str) -> None:
    # Nobody reads a socket to the dead rank (no collective, no store barrier): before, only
    # the beat's backstop reported it, 10 s or more later. Now its host's relay hears its
    # feed close without a goodbye (or the feeds their relay's), and /proc confirms it. A rank
    # that closed its registry first said goodbye: its end is no loss; nor is the end of one
    # whose function returned without close(): its process ended through Python's exit.
    results = run_world(_idle_when_one_goes, 4, who, how, timeout=120, expect_errors=True)
    survivors = [result for result in results if isinstance(result, dict) and "heard" in result]
    assert len(survivors) == 3, results
    victim = survivors[0]["victim"]
    for result in survivors:
        assert result["victim"] == victim, results
        if how != "killed":
            assert not result["heard"], result
        else:
            assert result["heard"] and result["suspects"] == [victim], result
            assert result["after_s"] < BACKSTOP_S / 4, result
            # Each survivor answered the report once, whether the relay answered for it (its
            # listener heard from lately: one append for the host, tests/test_host_relay.py)
            # or it answered itself (its relay dead).
            answers = [int(r) for r in result["answers"].rstrip(",").split(",")]
            assert sorted(answers) == sorted(set(range(4)) - {victim}), result
            assert result["count"] == 3, result
