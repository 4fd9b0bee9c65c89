"""commgroups.rank_loss.liveness: a rank loss recovered without waiting out the role timeouts, without
being told who died, without a split job, and without leaking a generation.

Real gloo worlds (the launcher hosts the store). Every role times out after 600 s, a production
value: a survivor that waited out a collective would take minutes, so "rebuilt in under a minute"
is a functional bound here, not a speed assertion (benchmarks/ and ``commgroups bench`` time it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups import GroupRegistry, torch_internals
from commgroups.creation.agreement import store_barrier
from commgroups.errors import (
    AgreementTimeoutError,
    LeftOutError,
    LossInterruptedError,
    RebuildError,
)
from tests.test_generation import _group_count
from tests.test_rebuild import hsdp_layout
from tests.worlds import connected_barrier, explain, run_world

pytestmark = pytest.mark.world

PRODUCTION_TIMEOUT_S = 600.0
WELL_UNDER_THE_TIMEOUT_S = 60.0  # a survivor that waited out a 600 s collective is far past it


def _train_until_killed(rank: int, world: int, victim: int, kill_step: int) -> dict[str, Any]:
    """Steps of collectives on three roles; the victim SIGKILLs itself mid-step. Survivors
    rebuild without alive= and carry on for one more step on the new groups."""
    layout = hsdp_layout({"dp_replicate": world // 2, "dp_shard": 2},
                         timeout_s=PRODUCTION_TIMEOUT_S)
    registry = GroupRegistry(layout, create_timeout_s=60).create()
    for step in range(kill_step + 3):
        try:
            registry.collectives("dp_shard").all_reduce(torch.ones(1 << 12))
            if rank == victim and step == kill_step:
                killed_at = time.time()
                print(f"KILLED_AT {killed_at}", flush=True)
                with open(os.environ["KILL_FILE"], "w") as out:
                    out.write(repr(killed_at))
                os.kill(os.getpid(), signal.SIGKILL)
            # Ranks whose replica group lacks the victim block here on live peers who left.
            registry.collectives("dp_replicate").all_reduce(torch.ones(1 << 12))
            registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))
        except Exception as error:  # any failure of a step means: rebuild
            failed_at = time.time()
            report = registry.rebuild()  # no alive=: nobody says who died
            rebuilt_at = time.time()
            if report.place != "member":
                registry.close()
                return {"place": report.place, "rebuilt_at": rebuilt_at}
            total = torch.ones(1)
            registry.collectives("checkpoint-metadata").all_reduce(total)
            registry.close()
            return {"place": "member", "failed_at": failed_at, "rebuilt_at": rebuilt_at,
                    "lost": report.lost, "members": report.members, "sum": float(total.item()),
                    "error": type(error).__name__, "seconds": report.seconds}
    registry.close()
    return {"place": "no loss"}


@pytest.mark.parametrize("victim", [5, 0], ids=["rank5", "rank0"])
def test_a_killed_rank_is_replaced_in_seconds_with_production_timeouts(
        victim: int, tmp_path: Any) -> None:
    kill_file = tmp_path / "killed_at"
    results = run_world(_train_until_killed, 8, victim, 1, timeout=240, expect_errors=True,
                        env={"KILL_FILE": str(kill_file)})
    killed_at = float(kill_file.read_text())
    survivors = {r: results[r] for r in range(8) if r != victim}
    for rank, result in survivors.items():
        assert isinstance(result, dict), (rank, result)
    members = {r for r, result in survivors.items() if result["place"] == "member"}
    partner = victim ^ 1  # its replica (dp_shard pair) goes with it: HSDP's elastic dim
    assert members == set(range(8)) - {victim, partner}
    assert survivors[partner]["place"] == "dropped"
    for rank in members:
        result = survivors[rank]
        assert result["lost"] == (victim,)
        assert result["members"] == tuple(sorted(members))
        assert result["sum"] == float(len(members))  # the new checkpoint group works
        assert result["rebuilt_at"] - killed_at < WELL_UNDER_THE_TIMEOUT_S, (rank, result)


def _store_barrier_after_a_loss(rank: int, world: int) -> dict[str, Any]:
    # Nobody is in a collective when rank 3 goes: no socket sees it, and the beat's backstop
    # would report it 10-30 s later at these defaults. Its host's ranks see it in /proc.
    registry = GroupRegistry(hsdp_layout(timeout_s=PRODUCTION_TIMEOUT_S),
                             create_timeout_s=PRODUCTION_TIMEOUT_S).create()
    missing = ""
    if rank != 1:  # rank 1 never calls this one: the others name it when their second is up
        try:
            registry.store_barrier("without-1", timeout=1)
        except AgreementTimeoutError as error:
            missing = str(error)
    registry.store_barrier("before")  # every rank arrives: it returns
    connected_barrier(registry, rank, world, victim=3)  # rank 3's process is gone after it
    started = time.monotonic()
    try:
        registry.store_barrier("after")  # rank 3 never arrives; its 600 s are never waited
    except LossInterruptedError as error:
        outcome = str(error)
    else:
        outcome = "passed"
    waited_s = time.monotonic() - started
    report = registry.rebuild()
    if report.place == "member":  # the rebuilt generation counts its barriers afresh
        registry.store_barrier("after", timeout=60)
    registry.close()
    return {"outcome": outcome, "waited_s": waited_s, "place": report.place, "missing": missing}


BARRIER_ENDS_WITHIN_S = 5.0


def test_a_store_barrier_ends_on_the_loss_report_not_its_timeout() -> None:
    """torchtitan's timeout switch waits in this barrier: a rank lost before it arrived made the
    others wait out the 300 s of create_timeout_s (the restart test's torchtitan job took 341 s
    instead of 45 s). Every rank here shares the host: the dead one is seen in /proc."""
    results = run_world(_store_barrier_after_a_loss, 4, timeout=180, expect_errors=True)
    survivors = results[:3]
    assert all(isinstance(result, dict) for result in survivors), explain(results)
    for rank, result in enumerate(survivors):
        assert result["outcome"].startswith(
            f"rank {rank}: a rank-loss report in generation 0 ended the wait for every rank at "
            "store_barrier('after')"), result
        # A look every 0.2 s, then the report's round trip: well under the backstop's 10 s.
        assert result["waited_s"] < BARRIER_ENDS_WITHIN_S, result
        assert result["missing"] == "" if rank == 1 else result["missing"].startswith(
            f"rank {rank}: not every rank reached store_barrier('without-1') within 1s; ranks "
            "that never arrived: [1]"), result
    assert [result["place"] for result in survivors] == ["member", "member", "dropped"]


LONG_DEAD_AFTER_S = 60.0  # an unanswered report alone would count as death only after this
WINDOW_S = 30.0  # and the check-in's window would end it after this


def _killed_and_confirmed_on_its_host(rank: int, world: int,
                                      heartbeat_s: float | None) -> dict[str, Any]:
    registry = GroupRegistry(hsdp_layout(), create_timeout_s=30, dead_after_s=LONG_DEAD_AFTER_S,
                             **({} if heartbeat_s is None else {"heartbeat_s": heartbeat_s})
                             ).create()
    if heartbeat_s is not None:  # past the first periodic beat: each rank learned its host
        time.sleep(3 * heartbeat_s)
    connected_barrier(registry, rank, world, victim=3)  # rank 3's process is gone after it
    report = registry.rebuild(timeout=WINDOW_S)  # no alive=: nobody says who died
    total = torch.ones(1)
    if report.place == "member":  # rank 2, rank 3's replica partner, is dropped by HSDP's rules
        registry.collectives("checkpoint-metadata").all_reduce(total)
    registry.close()
    return {"lost": report.lost, "members": report.members, "sum": float(total.item()),
            "place": report.place, "check_in_s": report.seconds["check_in"]}


@pytest.mark.parametrize("heartbeat_s", [None, 0.5], ids=["at-once", "host-learned"])
def test_a_dead_process_is_confirmed_by_its_host_not_waited_for(
        heartbeat_s: float | None) -> None:
    # Every rank shares this host: a survivor's listener finds rank 3's process gone from /proc
    # when it answers the loss report, so the check-in decides long before dead_after_s or its
    # window could end it (either would take 30 s or more). Killed right after create(), or
    # once every rank learned its host's ranks (Liveness.learn_host): rank 3 is among them, so
    # the survivors still read the host's key.
    results = run_world(_killed_and_confirmed_on_its_host, 4, heartbeat_s, timeout=120,
                        expect_errors=True)
    assert [result["place"] for result in results[:3]] == ["member", "member", "dropped"]
    for result in results[:3]:
        assert result["lost"] == (3,) and result["members"] == (0, 1), result
        assert result["check_in_s"] < WINDOW_S / 3, result
    assert results[0]["sum"] == results[1]["sum"] == 2.0


def _lone_rebuild(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 rebuilds after a local error; the others are training and alive."""
    registry = GroupRegistry(hsdp_layout(timeout_s=PRODUCTION_TIMEOUT_S),
                             create_timeout_s=60).create()
    mesh = registry.device_mesh(["dp_replicate", "fsdp"])
    old_groups = {"group": registry.group("checkpoint-metadata"), "mesh": mesh.get_group(1)}
    if rank == 0:
        report = registry.rebuild()  # e.g. `except Exception: registry.rebuild()` on a local bug
    else:
        report = None
        for _ in range(200):
            try:
                registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))
                time.sleep(0.05)
            except Exception:  # interrupted: rank 0 reported a loss
                report = registry.rebuild()
                break
    assert report is not None
    total = torch.ones(1)
    registry.collectives("checkpoint-metadata").all_reduce(total)
    stale = {}
    for name, group in old_groups.items():  # generation 0's groups fail loudly, never silently
        try:
            dist.all_reduce(torch.ones(1), group=group)
            stale[name] = "ran"
        except (RuntimeError, ValueError) as error:
            stale[name] = f"{type(error).__name__}: {str(error).split('>', 1)[-1][:200]}"
    # A call the interruption did not end within a second (a loaded host) was abandoned: its
    # generation stays, groups severed, until the call ends.
    kept = bool(registry._recovery.retired)
    registry.close()
    return {"generation": report.generation, "members": report.members, "lost": report.lost,
            "sum": float(total.item()), "stale": stale, "kept": kept}


def test_a_lone_rebuild_brings_every_live_rank_into_the_same_generation() -> None:
    results = run_world(_lone_rebuild, 4, timeout=120)
    for result in results:
        stale, kept = result.pop("stale"), result.pop("kept")
        assert result == {"generation": 1, "members": (0, 1, 2, 3), "lost": (), "sum": 4.0}
        # released: torch no longer knows the groups (and their sockets were shut down before);
        # kept for an abandoned call: severed, so they fail at once all the same
        assert set(stale) == {"group", "mesh"} and all(
            text.startswith("ValueError") and "not initialized in the world group map" in text
            if not kept else text.startswith("RuntimeError") and "Connection" in text
            for text in stale.values()
        ), (stale, kept)


def _lone_rebuild_nobody_answers(rank: int, world: int) -> str:
    registry = GroupRegistry(hsdp_layout(timeout_s=PRODUCTION_TIMEOUT_S),
                             create_timeout_s=60).create()
    # Every rank out of create() first: rank 0's report interrupts (severs) its own groups at
    # once, and a peer still connecting to the last one failed its create() on "Connection
    # closed by peer" (the 2.15 leg, once). Not what this test is about.
    store_barrier(torch_internals.default_store(), "test/lone-created", rank, world,
                  timedelta(seconds=60), "create()")
    if rank == 0:
        try:
            registry.rebuild(timeout=2)  # the others are alive and never reach a collective
        except RebuildError as error:
            outcome = f"refused: {error}"
        else:
            outcome = "rebuilt alone"
    else:
        time.sleep(4)
        outcome = "waited"
    store_barrier(torch_internals.default_store(), "test/lone-done", rank, world,
                  timedelta(seconds=60), "the test's end")
    registry.close()
    return outcome


def test_a_lone_rebuild_that_nobody_joins_fails_on_that_rank_and_splits_nothing() -> None:
    results = run_world(_lone_rebuild_nobody_answers, 4, timeout=120)
    assert results[0].startswith("refused") and "majority" in results[0], results[0]
    assert results[1:] == ["waited"] * 3


def _late_and_retrying(rank: int, world: int) -> dict[str, Any]:
    registry = GroupRegistry(hsdp_layout(), create_timeout_s=30).create()
    connected_barrier(registry, rank, world, victim=3)
    if rank == 2:
        time.sleep(4)  # left out: the majority decided without it after its 1.5 s window
    outcomes = []
    for _ in range(2):  # a left-out rank that retries gets the same answer, never its own world
        try:
            report = registry.rebuild(timeout=1.5)
            outcomes.append(f"{report.place} {report.members}")
            break
        except LeftOutError:
            outcomes.append("left out")
        except RebuildError as error:
            outcomes.append(f"refused: {error}")
    return {"outcomes": outcomes, "state": registry.state.value}


def test_a_left_out_rank_stays_out_when_it_retries() -> None:
    results = run_world(_late_and_retrying, 4, timeout=90, expect_errors=True)
    assert results[0]["outcomes"] == results[1]["outcomes"] == ["member (0, 1)"]
    late = results[2]
    assert late["outcomes"][0] == "left out"
    assert late["outcomes"][1].startswith("refused") and "dropped" in late["outcomes"][1]
    assert late["state"] == "dropped"


def _far_behind(rank: int, world: int) -> str:
    """Rank 2 reaches rebuild() two generations late, after the check-in it missed was deleted."""
    registry = GroupRegistry(hsdp_layout(), create_timeout_s=30).create()
    store = torch_internals.default_store()
    connected_barrier(registry, rank, world, victim=3)
    if rank == 2:
        store.wait(["test/far-behind-go"], timedelta(seconds=60))
        try:
            registry.rebuild(timeout=1.5)
        except LeftOutError:
            return "left out"
        finally:
            store.set("test/far-behind-done", "1")
        return "rebuilt alone"
    registry.rebuild(timeout=1.5)  # generation 1 on [0, 1]
    registry.rebuild()  # generation 2: generation 1's check-in keys are deleted now
    store.set("test/far-behind-go", "1")
    # close() deletes the record rank 2 reads: under load rank 2 read it after that (seen once)
    store.wait(["test/far-behind-done"], timedelta(seconds=60))
    registry.close()
    return f"generation {registry.generation}"


def test_a_rank_generations_behind_is_left_out_too() -> None:
    results = run_world(_far_behind, 4, timeout=90, expect_errors=True)
    assert results[:3] == ["generation 2", "generation 2", "left out"], results


def _resources() -> dict[str, int]:
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "groups": _group_count(),
            "keys": int(torch_internals.default_store().num_keys())}


def _settled_resources(still_s: float = 1.5, deadline_s: float = 30.0) -> dict[str, int]:
    """:func:`_resources` once they have not changed for ``still_s`` (or at the deadline)."""
    deadline = time.monotonic() + deadline_s
    last, since = _resources(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _resources()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s:
            break
    return last


def _quiet_count() -> dict[str, int]:
    """:func:`_settled_resources` taken by every rank at once: a default-group barrier before (so
    no rank measures while another still works) and after (so none starts working while another
    still measures). The default group's timeout is the world's (minutes), not a role's: one
    rank may settle seconds after another on loaded cores."""
    dist.barrier()
    resources = _settled_resources()
    dist.barrier()
    return resources


def _keys_one_generation_leaves(rank: int) -> int:
    """The store keys that creating and closing one registry of the same layout leaves behind:
    torch's own rendezvous keys of each new group (their names are torch's, never ours to
    delete), measured here. The first registry of a world also leaves a few keys once (the
    prefixes' epoch counters), so the second one is counted."""
    counts = []
    for _ in range(2):
        before = _quiet_count()["keys"]
        GroupRegistry(hsdp_layout(timeout_s=60), create_timeout_s=60).create().close()
        counts.append(_quiet_count()["keys"] - before)
    return counts[-1]


FSDP_TIMEOUT_S = 3.0
"""The cycles' fsdp timeout: how long an abandoned all_reduce keeps its generation."""


def _rebuild_cycles(rank: int, world: int, cycles: int) -> list[dict[str, int]]:
    torch_keys = _keys_one_generation_leaves(rank)
    # 60 s role timeouts: the barriers below wait for the slowest rank's settling. fsdp's is
    # short: see the wait before each count.
    layout = hsdp_layout(timeout_s=60)
    layout = type(layout).model_validate({**layout.model_dump(), "roles": [
        {**role.model_dump(), "timeout_s": FSDP_TIMEOUT_S if role.name == "fsdp" else 60}
        for role in layout.roles]})
    registry = GroupRegistry(layout, create_timeout_s=60).create()
    registry.device_mesh(["dp_replicate", "fsdp"])
    seen = []
    for cycle in range(cycles):
        with contextlib.suppress(RuntimeError):  # a faster rank's rebuild() interrupts it
            registry.collectives("fsdp").all_reduce(torch.ones(4))
        registry.rebuild()  # every rank: nobody lost, a new generation each time
        if cycle in (0, 1, cycles - 1):
            # An all_reduce the rebuild's interruption did not end (gloo left it to its timeout,
            # about one rebuild in 20 here) was abandoned: its generation stays until the call
            # ends, and the next rebuild() releases it. Wait that out, then rebuild once more
            # with nothing in flight, so each count sees only what a rebuild leaves for good.
            dist.barrier()
            time.sleep(FSDP_TIMEOUT_S + 0.5)
            registry.rebuild()
        # The counts the assertions read (cycles 0, 1 and the last) are taken once they settle:
        # every rank's flight publisher writes its new status within its 1 s interval, and gloo
        # closes a destroyed group's sockets from its own threads. On 2 loaded cores both lagged
        # a fixed 1.5 s wait (one key short in the first count, 16 descriptors not yet closed in
        # the last: 2 of 3 runs under xdist failed), so each rank waits until its counts hold
        # still for longer than the publisher's interval; a real leak never settles back.
        if cycle in (0, 1, cycles - 1):
            resources = _quiet_count()
            # Which of ours are there, to name a leak (the count alone said "2 keys too many").
            keys = torch_internals.default_store().list_keys()
            resources["ours"] = sorted(key for key in keys if "commgroups/" in key)
        else:
            dist.barrier(group=registry.group("checkpoint-metadata"))
            time.sleep(0.3)
            resources = _resources()
            dist.barrier(group=registry.group("checkpoint-metadata"))
        seen.append({**resources, "torch_keys": torch_keys, "generation": registry.generation})
    registry.close()
    return seen


# Run alone after the parallel suite (with the loads_cores test): under the whole suite's load its
# key counts were off by one to three keys in 3 of 6 runs (listeners lagging at release time).
# Later runs found two real leaks behind such counts, both listener events kept until close():
# the loss reports of the ranks that called rebuild() before they heard the first, and the
# flight recorder's asks (each now named by shape in the message, and deleted).
ANOMALY_COUNTERS = re.compile(r"commgroups/agree/\d+//(mismatch|counter/split|ballot/split|ballot/veto)$")
"""The counters an agreement creates only where its vote saw a difference (a veto: torch would
reuse a destroyed group's name), kept with the generation until it retires."""


EVENT = re.compile(r"/event/\d+$")
"""A listener event's key (``event/count`` is not one)."""


CYCLES_WORLD = 4
"""The ranks of :func:`test_rebuilds_leak_nothing_over_ten_cycles`."""


def _shape(key: str) -> str:
    """A key with its numbers (epochs, generations, attempts) left out: the same key of the next
    generation has the same shape."""
    return re.sub(r"\d+", "N", key)


@pytest.mark.loads_cores
def test_rebuilds_leak_nothing_over_ten_cycles() -> None:
    results = run_world(_rebuild_cycles, CYCLES_WORLD, 10, timeout=240)
    for rank, seen in enumerate(results):
        named = [counts.pop("ours", ()) for counts in seen]
        first, settled, last = seen[0], seen[1], seen[-1]
        # Which of ours the last count has beyond the second, by shape (a leak names itself).
        added = sorted((Counter(map(_shape, named[-1])) - Counter(map(_shape, named[1]))).elements())
        text = f"rank {rank}: ours added {added}; counts {seen}"
        assert last["groups"] == first["groups"], text
        # From the second rebuild on (a descriptor or two may open once, after the first): flat.
        assert last["fds"] <= settled["fds"] + 2 and last["fds"] <= first["fds"] + 4, text
        assert last["threads"] <= settled["threads"] + 2, text
        # Ours stay flat; torch's rendezvous keys of each new group stay behind (theirs). The
        # live generation keeps its agreement's four anomaly counters where its vote saw a
        # difference (a veto: torch would reuse a destroyed group's name): at most one
        # generation's, they retire with it.
        anomalies = [sum(1 for key in keys if ANOMALY_COUNTERS.search(key)) for keys in named]
        assert max(anomalies) <= 4, text
        # Listener events are deleted once every listener is past them: a rebuild or two after
        # they were sent. What a count finds is a bounded backlog, never growing: the last
        # check-in's decision, a release's loss reports (one per rank that called rebuild()
        # before it heard the first) and the asks of one diagnosed call (its generation
        # released a rebuild late: an abandoned all_reduce). The later reports and the asks
        # stayed until close() before: 4 keys over 9 rebuilds on loaded cores, 148 of 146.
        events = [sum(1 for key in keys if EVENT.search(key)) for keys in named]
        assert max(events) <= 2 * CYCLES_WORLD + 2, text
        torch_keys = first["torch_keys"]
        rebuilds = settled["generation"] - first["generation"]
        # Besides: a release's two counters (``closed``) where a rank lists the keys before
        # the last rank released.
        grown = (settled["keys"] - events[1]) - (first["keys"] - events[0])
        assert grown <= rebuilds * torch_keys + 2 + max(0, anomalies[1] - anomalies[0]), text
        rebuilds = last["generation"] - settled["generation"]
        grown = (last["keys"] - events[-1]) - (settled["keys"] - events[1])
        assert grown <= rebuilds * torch_keys + 2 + max(0, anomalies[-1] - anomalies[1]), text


def _audited_rebuild(rank: int, world: int) -> list[tuple[str, ...]]:
    import commgroups as cg

    registry = GroupRegistry(hsdp_layout({"dp_replicate": 2, "dp_shard": 1}),
                             create_timeout_s=60).create()
    with cg.audit.record(registry) as recorder:
        registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))
        registry.rebuild()  # both ranks: a new generation, new groups under the same roles
        registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))
    registry.close()
    return [record.roles for record in recorder.records]


def test_the_audit_names_a_rebuilt_generations_groups_by_role() -> None:
    for roles in run_world(_audited_rebuild, 2, timeout=120):
        assert roles[0] == roles[-1] == ("checkpoint-metadata",), roles
