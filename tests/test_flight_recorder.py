"""The flight recorder's parts in this process: settings, the ring buffer and its entries, the
call site, the status publisher on a HashStore, the diagnosis, dumps and their merge (the seed's
three-streams pattern with mocked CUDA streams). Real worlds: test_flight_recorder_world.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commgroups as cg
from commgroups import torch_internals
from commgroups.collectives.role_collectives import RoleCollectives
from commgroups.flight_recorder import entries as flight_entries
from commgroups.flight_recorder import index as flight_index
from commgroups.flight_recorder import publisher as publisher_module
from commgroups.flight_recorder import recorder as flight_recorder_module
from commgroups.flight_recorder.diagnosis import diagnose
from commgroups.flight_recorder.merge import FlightDumpError, merge, merge_dir
from commgroups.flight_recorder.publisher import StatusPublisher, read_status
from commgroups.flight_recorder.recorder import FlightRecorder, RoleRecorder
from commgroups.flight_recorder.session import FlightSession, _rewritten
from commgroups.flight_recorder.settings import ENV_VAR, flight_enabled
from commgroups.flight_recorder.signals import dump_on_signal
from commgroups.rank_loss.liveness import Liveness
from commgroups.torch_internals.version import torch_version
from tests import torch_private
from tests.polling import until
from tests.released_store import ReleasedAfterFirstRead

HERE = Path(__file__).name


# ------------------------------------------------------------------------------------ settings
def test_on_by_default_off_by_layout_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert flight_enabled(cg.Layout(dims={"cp": 2}))
    assert not flight_enabled(cg.Layout(dims={"cp": 2}, flight_recorder=False))
    for off in ("0", "off", "False"):
        monkeypatch.setenv(ENV_VAR, off)
        assert not flight_enabled(cg.Layout(dims={"cp": 2}))
    monkeypatch.setenv(ENV_VAR, "1")
    assert flight_enabled(cg.Layout(dims={"cp": 2}))


def test_the_layout_field_is_strict_and_only_off_changes_the_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(cg.errors.LayoutError, match="flight_recorder"):
        cg.Layout(dims={"cp": 2}, flight_recorder="no")
    on = cg.plan(cg.Layout(dims={"cp": 2}, flight_recorder=True)).fingerprint
    assert on == cg.plan(cg.Layout(dims={"cp": 2})).fingerprint
    assert on != cg.plan(cg.Layout(dims={"cp": 2}, flight_recorder=False)).fingerprint
    path = tmp_path / "layout.toml"
    path.write_text("flight_recorder = false\n[dims]\ncp = 2\n")
    assert cg.load_layout(path).flight_recorder is False


# ------------------------------------------------------------------------- recording a call
def test_each_call_is_recorded_with_its_caller_counts_shapes_and_stream(
        one_rank: dist.ProcessGroup) -> None:
    recorder = RoleRecorder("cp", one_rank, maxlen=4)
    handle = RoleCollectives(one_rank, role="cp", async_and_wait=True, flight=recorder)
    tensor = torch.ones(3, 2)
    start = recorder.group_seq()
    assert start is not None
    for _ in range(6):
        handle.all_reduce(tensor); line = sys._getframe().f_lineno  # noqa: E702  the call's line
    dist.all_reduce(tensor, group=one_rank)  # a plain call: counted by the group, not recorded
    assert len(recorder.entries) == 4 and recorder.seq == 6  # the ring keeps the newest 4
    last = recorder.entries[-1].to_dict()
    assert last["caller"].endswith(f"{HERE}:{line} in "
                                   "test_each_call_is_recorded_with_its_caller_counts_shapes_and_stream")
    assert (last["op"], last["seq"], last["group_seq"]) == ("all_reduce", 6, start + 6)
    assert last["shapes"] == [[3, 2]] and last["dtype"] == "float32"
    assert last["async_op"] is True and last["caller_async"] is False
    assert last["stream"] == f"group:{one_rank.group_name}" and last["state"] == "done"
    assert recorder.status()["group_seq"] == start + 7
    plain = RoleCollectives(one_rank, role="cp", async_and_wait=False, flight=recorder)
    plain.all_reduce(tensor)
    assert recorder.last is not None and recorder.last.stream == "cpu"  # blocking: caller's


def test_object_collectives_are_recorded_too(one_rank: dist.ProcessGroup) -> None:
    recorder = RoleRecorder("meta", one_rank)
    handle = RoleCollectives(one_rank, role="meta", async_and_wait=True, flight=recorder)
    out: list[Any] = [None]
    handle.all_gather_object(out, {"plan": 1})
    assert out == [{"plan": 1}]
    assert recorder.last is not None and recorder.last.op == "all_gather_object"
    assert HERE in recorder.last.caller


def test_a_failed_call_is_recorded_failed(one_rank: dist.ProcessGroup) -> None:
    recorder = RoleRecorder("cp", one_rank)
    handle = RoleCollectives(one_rank, role="cp", async_and_wait=True, flight=recorder)
    with pytest.raises(ValueError, match="not part of group"):
        handle.broadcast(torch.ones(2), src=5)  # no rank 5 in a 1-rank group
    assert recorder.last is not None and recorder.last.state == "failed"
    assert recorder.last.error


def test_an_object_collective_whose_inner_call_timed_out_is_recorded_failed(
        one_rank: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's inner all_gather goes through the scope's recorded wrapper, which raises the
    diagnosed RoleTimeoutError itself: the object collective's own entry ends failed as well,
    never left in flight for every later dump and status."""
    recorder = RoleRecorder("meta", one_rank)
    handle = RoleCollectives(one_rank, role="meta", async_and_wait=True, flight=recorder)

    def timing_out(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer: timed out after 30000 ms")

    # The inner gather torch uses: all_gather on 2.10-2.14, all_gather_single on 2.15.
    for name in ("all_gather", "all_gather_single", "all_gather_into_tensor"):
        original = getattr(c10d, name, None)
        if original is not None:
            for module in (dist, c10d):
                monkeypatch.setattr(module, name, functools.wraps(original)(timing_out),
                                    raising=False)
    flight_index.register([recorder])
    try:
        with pytest.raises(cg.errors.RoleTimeoutError):
            handle.all_gather_object([None], {"plan": 1})
    finally:
        flight_index.unregister([recorder])
    states = [(entry.op, entry.state) for entry in recorder.entries]
    assert states[0] == ("all_gather_object", "failed"), states
    assert all(state == "failed" for _, state in states), states  # the inner all_gather too
    assert recorder.entries[0].error and "timed out" in recorder.entries[0].error


def test_the_call_site_walk_skips_torch_and_commgroups() -> None:
    cache = flight_entries.SiteCache()
    code, offset = flight_entries.caller_of(sys._getframe(), cache)
    assert code is sys._getframe().f_code
    assert flight_entries.site_text(code, offset).startswith(__file__)
    assert flight_entries.caller_of(None, cache) == (None, -1)
    assert flight_entries.site_text(None, -1) == "<unknown>"


def test_a_registry_records_every_role_and_dumps_on_request(
        one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with cg.GroupRegistry(cg.Layout(dims={"cp": 1}, roles=[cg.RoleSpec(name="cp", dims=["cp"])])) as registry:
        registry.collectives("cp").all_reduce(torch.ones(2))
        session = registry.flight_recorder
        assert session is not None and session.publisher is not None
        path = Path(str(registry.dump_flight_recorder(tmp_path)))
        data = json.loads(path.read_text())
        assert data["rank"] == 0 and data["roles"]["cp"]["entries"][0]["op"] == "all_reduce"
        previous = dump_on_signal(registry, tmp_path / "signalled")
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert (tmp_path / "signalled" / path.name).exists()
        key = session.publisher.key
        # The first publication is the publisher thread's, at once (not create()'s).
        deadline = time.monotonic() + 10
        while (read_status(session.publisher.store, session.publisher.prefix, 0) is None
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert read_status(session.publisher.store, session.publisher.prefix, 0) is not None
    assert registry.flight_recorder is None
    assert not torch_internals.default_store().check([key])  # released at close
    monkeypatch.setenv(ENV_VAR, "0")
    with cg.GroupRegistry(cg.Layout(dims={"cp": 1}, roles=[cg.RoleSpec(name="cp", dims=["cp"])])) as registry:
        assert registry.flight_recorder is None and registry.collectives("cp").flight is None


def test_a_dump_never_puts_an_older_snapshot_over_a_newer_one(
        one_rank: dist.ProcessGroup, tmp_path: Path) -> None:
    """dump_soon's thread symbolizes for about a second after taking its snapshot; a dump the
    main thread takes after its next call must stay in the file (CI: a merge named a rank behind
    in the very call its last dump held)."""
    with cg.GroupRegistry(cg.Layout(dims={"cp": 1}, roles=[cg.RoleSpec(name="cp", dims=["cp"])])) as registry:
        session = registry.flight_recorder
        assert session is not None
        trace = session.recorder.torch_trace
        taken, release = threading.Event(), threading.Event()

        def slow_first(call_sites: bool = True) -> list[dict[str, Any]]:
            if threading.current_thread() is not threading.main_thread():
                taken.set()
                release.wait(10)  # symbolizing, while the main thread goes on
            return trace(call_sites)

        session.recorder.torch_trace = slow_first  # type: ignore[method-assign]
        older = threading.Thread(target=session.dump, args=(tmp_path,))
        older.start()
        assert taken.wait(10)
        registry.collectives("cp").all_reduce(torch.ones(2))
        path = Path(session.dump(tmp_path))
        release.set()
        older.join(10)
        entries = json.loads(path.read_text())["roles"]["cp"]["entries"]
        assert [entry["op"] for entry in entries] == ["all_reduce"]


def test_dump_soon_rewrites_its_own_snapshot_even_after_the_generation_ended(
        one_rank: dist.ProcessGroup, tmp_path: Path) -> None:
    """dump_soon's thread, adding torch's call sites, can start after the generation ended,
    whose groups keep no counts then: it rewrites the snapshot dump_soon took (CI: a rank's
    count of a role fell back to its own calls, one of which gloo refused uncounted, and the
    merge named it ahead of the others)."""
    recorder = FlightRecorder({"cp": one_rank}, rank=0, generation=0)
    session = FlightSession(recorder, None, epoch=0)
    role = recorder.roles["cp"]
    role.end(role.start("all_reduce", (torch.ones(2),), False, False, None))
    dist.all_reduce(torch.ones(2), group=one_rank)
    role.end(role.start("all_gather_into_tensor", (), False, False, None), ValueError("refused"))
    snapshot, trace, release = recorder.snapshot, recorder.torch_trace, threading.Event()

    def late_start() -> dict[str, Any]:
        if threading.current_thread() is not threading.main_thread():
            release.wait(10)  # the thread starts past the generation's end
        return snapshot()

    def late(call_sites: bool = True) -> list[dict[str, Any]]:
        if threading.current_thread() is not threading.main_thread():
            release.wait(10)  # the thread symbolizes past the generation's end
        return trace(call_sites)

    recorder.snapshot = late_start  # type: ignore[method-assign]
    recorder.torch_trace = late  # type: ignore[method-assign]
    path = Path(session.dump_soon(tmp_path))
    first = json.loads(path.read_text())["roles"]["cp"]
    threads = [t for t in threading.enumerate() if t.name == "commgroups-flight-dump"]
    session.close()
    release.set()
    for thread in threads:
        thread.join(10)
    rewritten = json.loads(path.read_text())["roles"]["cp"]
    assert first["seq"] == 2 and first["group_seq"] is not None and first["ranks"] == [0], first
    assert role.group is None and role.group_seq() == first["group_seq"]  # kept at the end
    assert {key: rewritten[key] for key in ("seq", "group_seq", "ranks")} == {
        key: first[key] for key in ("seq", "group_seq", "ranks")}


# ------------------------------------------------------------------------------- publisher
def test_the_publisher_writes_on_change_and_answers_requests() -> None:
    store = dist.HashStore()
    status = {"cp": {"seq": 1}}
    asked: list[dict[str, Any]] = []
    publisher = StatusPublisher(store, "t/", 3, lambda: dict(status), interval_s=0.05,
                                on_request=asked.append)
    publisher.publish_now()
    first = read_status(store, "t/", 3)
    assert first is not None and first["status"] == status and first["answered"] == 0
    publisher.publish_now()
    assert read_status(store, "t/", 3) == first  # unchanged: not written again
    number = publisher.ask({"dump": "/somewhere"})
    publisher._poll()
    after = read_status(store, "t/", 3)
    assert after is not None and after["answered"] == number and asked == [{"dump": "/somewhere"}]
    assert read_status(store, "t/", 4) is None
    publisher.stop(release=True, members=2)
    assert read_status(store, "t/", 3) is None and store.check(["t/request"])  # one rank left
    other = StatusPublisher(store, "t/", 4, dict, interval_s=0.05)
    other.stop(release=True, members=2)  # the last one to close deletes the shared keys
    assert not any(store.check([f"t/{key}"]) for key in ("request", "requests", "closed"))


def test_a_poll_read_or_release_never_waits_for_a_key_released_meanwhile() -> None:
    """The last member to release deletes the ask counter and the statuses; a rank reading them
    at that moment must not wait for them to come back. A check then a get waited out the
    store's timeout (120 s in the tests' worlds) on the job's shared connection, every thread's
    requests behind it. CI's case: survivors release a retired generation with different lost
    sets (a rank dropped at an earlier rebuild knew fewer), so two of them counted themselves
    last and released its asks at once; one waited, and never reached its next collective."""
    from datetime import timedelta

    inner = dist.HashStore()
    inner.set_timeout(timedelta(seconds=3))
    StatusPublisher(inner, "t/", 3, dict).ask({"dump": "/somewhere"})
    asked: list[dict[str, Any]] = []
    racing = ReleasedAfterFirstRead(inner, ("t/requests", "t/request"))
    publisher = StatusPublisher(racing, "t/", 4, dict, on_request=asked.append)
    started = time.monotonic()
    publisher._poll()  # answers what it read, without the released request's payload
    assert racing.released and time.monotonic() - started < 1.5 and asked == [{}]

    ask = StatusPublisher(inner, "t/", 3, dict).ask_group("cp", 0, "all_reduce#1",
                                                          members=[3, 6])
    racing = ReleasedAfterFirstRead(inner, (f"{ask.key}/joined/0",))
    started = time.monotonic()
    assert StatusPublisher(racing, "t/", 6, dict).joined(ask.key, 2) in ([0], [1])
    assert racing.released and time.monotonic() - started < 1.5

    racing = ReleasedAfterFirstRead(inner, ("t/requests",))
    started = time.monotonic()
    StatusPublisher(racing, "t/", 6, dict).release(members=1)  # the last, as another one is
    assert racing.released and time.monotonic() - started < 1.5

    inner.set("t/5", json.dumps({"t": 0, "answered": 0, "status": {}}))
    racing = ReleasedAfterFirstRead(inner, ("t/5",))
    started = time.monotonic()
    status = read_status(racing, "t/", 5)
    assert racing.released and time.monotonic() - started < 1.5
    assert status is None or status["answered"] == 0  # what was there, or nothing: never a wait


def test_a_status_that_keeps_changing_is_published_once_it_settles_or_grows_old(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A training rank's status changes at every look: publishing each change was one store
    request per rank per second. Published: the first look's, a change that stayed the same for
    a look, and a changing one once REFRESH_S passed since the last publication."""
    store = dist.HashStore()
    status = {"cp": {"seq": 1}}
    publisher = StatusPublisher(store, "t/", 3, lambda: copy.deepcopy(status))

    def published() -> Any:
        return (read_status(store, "t/", 3) or {}).get("status")

    publisher.publish_settled()
    assert published() == {"cp": {"seq": 1}}  # the first look
    for seq in (2, 3):  # moving: nothing written
        status["cp"] = {"seq": seq}
        publisher.publish_settled()
        assert published() == {"cp": {"seq": 1}}
    publisher.publish_settled()  # the same as at the look before: settled
    assert published() == {"cp": {"seq": 3}}
    monkeypatch.setattr(publisher_module, "REFRESH_S", 0.0)
    status["cp"] = {"seq": 4}
    publisher.publish_settled()  # still moving, but the last publication is old
    assert published() == {"cp": {"seq": 4}}


def test_a_publisher_heard_through_the_listener_looks_from_the_beats_thread() -> None:
    store = dist.HashStore()
    liveness = Liveness(store, store, "live/", 3, interval_s=60.0, dead_after_s=1.0,
                        on_loss=lambda generation, suspects: None)
    beat = threading.Thread(target=liveness.run_beats, daemon=True)
    beat.start()
    assert liveness.announced(10.0)
    status = {"cp": {"seq": 1}}
    publisher = StatusPublisher(store, "t/", 3, lambda: copy.deepcopy(status), interval_s=0.02)
    registered: list[tuple[str, bool]] = []

    def every(name: str, period_s: float, task: Any) -> None:
        registered.append((name, task is not None))
        liveness.every(name, period_s, task)

    publisher.listen_through(liveness.emit, liveness.subscribe, every)
    first = read_status(store, "t/", 3)  # published by the call itself
    assert first is not None and first["status"] == status and registered == [("t/", True)]
    assert not [t for t in threading.enumerate() if t.name.startswith("commgroups-flight")]
    # A change is published once it settles (two of the publisher's looks), though the beat is
    # a minute away.
    status["cp"] = {"seq": 2}
    assert until(lambda: (read_status(store, "t/", 3) or {}).get("status") == status)
    failures = []
    liveness.every("failing", 0.02, lambda: failures.append(1) / 0)  # logged, and kept
    assert until(lambda: len(failures) >= 3)
    publisher.stop(release=True, members=1)
    assert registered[-1] == ("t/", False) and read_status(store, "t/", 3) is None
    status["cp"] = {"seq": 3}
    time.sleep(0.1)
    assert read_status(store, "t/", 3) is None  # stopped looking: nothing re-created
    liveness.close()
    beat.join(timeout=5.0)  # at once, not after the minute's wait (plus a second's grace)
    assert not beat.is_alive()


# ------------------------------------------------------------------------------- diagnosis
def _published(count: int, op: str = "all_reduce", answered: int = 1, **extra: Any
               ) -> dict[str, Any]:
    return {"answered": answered, "status": {"cp": {"seq": count, "group_seq": count, "last": {
        "op": op, "seq": count, "group_seq": count, "caller": "/x/train.py:7 in step",
        "state": "done"}}, **extra}}


def test_diagnosis_sorts_ranks_behind_ahead_mismatched_and_silent() -> None:
    failed = {"op": "all_reduce", "seq": 5, "group_seq": 5, "caller": "/x/train.py:9 in step"}
    elsewhere = {"fsdp": {"last": {"op": "all_gather", "seq": 2, "group_seq": 2,
                                   "caller": "/x/model.py:40 in f", "state": "in flight"}}}
    found = diagnose("cp", 0, failed, {
        1: _published(4, **elsewhere), 2: _published(5, op="broadcast"), 3: _published(6),
        4: _published(4, answered=0), 5: None, 6: _published(5)}, asked=1)
    got = found.to_dict()
    assert (got["behind"], got["mismatch"], got["ahead"], got["silent"], got["left"],
            got["reached"]) == ([1], [2], [3], [4], [5], [6])
    text = found.text()
    assert "behind: rank 1 (last all_reduce #4 at train.py:7; now in fsdp all_gather #2 at " \
           "model.py:40)" in text
    assert "different op at this seq: rank 2 (last broadcast #5 at train.py:7)" in text
    error = _rewritten(cg.errors.RoleTimeoutError("t", role="cp", op="all_reduce", seq=5), found)
    assert isinstance(error, cg.errors.RoleHangError) and len(str(error)) <= 300
    assert error.flight is not None and error.flight["behind"] == [1]


def test_a_silent_ranks_old_status_says_its_age() -> None:
    """A rank publishes once its status settles (a moving one at most every REFRESH_S): one
    killed while training may have left an old status, and the text says how old."""
    failed = {"op": "all_reduce", "seq": 5, "group_seq": 5, "caller": "/x/train.py:9 in step"}
    found = diagnose("cp", 0, failed, {
        1: {**_published(2, answered=0), "t": 1000.0},
        2: {**_published(4, answered=0), "t": 1026.0}, 3: _published(5)}, asked=1, now=1027.0)
    text = found.text()
    assert "rank 1 (no fresh status: dead or frozen; its status 27 s old; last all_reduce #2" \
        in text, text
    assert "rank 2 (no fresh status: dead or frozen; last all_reduce #4" in text, text
    assert [state.age_s for state in found.ranks] == [27.0, 1.0, None]


def test_a_value_shared_by_many_ranks_is_judged_like_its_copies() -> None:
    """collect() hands every member that answered alike one shared value: diagnose judges each
    distinct value once, and the result is the one per-rank copies give."""
    failed = {"op": "all_reduce", "seq": 5, "group_seq": 5, "caller": "/x/train.py:9 in step"}
    reached, behind = _published(5), _published(4)
    shared = {**dict.fromkeys(range(1, 200), reached), 200: behind, 201: None,
              **dict.fromkeys(range(202, 300), behind)}
    copies = {rank: None if value is None else copy.deepcopy(value)
              for rank, value in shared.items()}
    one, other = diagnose("cp", 0, failed, shared, 1), diagnose("cp", 0, failed, copies, 1)
    assert one == other
    assert one.to_dict()["behind"] == [200, *range(202, 300)] and one.where("left")[0].rank == 201


# -------------------------------------------------------------------------------- dumps, merge
def _seed_dumps(one_rank: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Two ranks' dumps of the seed's pattern on role cp: FSDP's async calls on the group's
    stream, spmd_types' blocking calls on the caller's stream and on a side stream (mocked:
    CPU tensors reported as CUDA streams 7 and 9)."""
    streams = iter(["cuda:0/stream:7", "cuda:0/stream:9"] * 4)
    monkeypatch.setattr(flight_recorder_module, "caller_stream", lambda tensor: next(streams))
    dumps = []
    for rank in (0, 1):
        recorder = FlightRecorder({"cp": one_rank}, rank=rank, generation=0,
                                  backends={"cp": "nccl"})
        fsdp = RoleCollectives(one_rank, role="cp", async_and_wait=False,
                               flight=recorder.role("cp"))
        tensor = torch.ones(4)
        fsdp.all_reduce(tensor, async_op=True).wait()
        fsdp.all_reduce(tensor)  # blocking: stream 7
        fsdp.all_reduce(tensor)  # blocking: stream 9
        data = recorder.to_dict()
        data["roles"]["cp"]["ranks"] = [0, 1]
        dumps.append(data)
    return dumps


def test_mocked_nccl_streams_the_seeds_three_streams_are_a_hazard(
        one_rank: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    report = merge(_seed_dumps(one_rank, monkeypatch))
    streams = [h for h in report.hazards if h.kind == "mixed_streams"]
    assert len(streams) == 1 and streams[0].ranks == (0, 1)
    assert streams[0].message.startswith("[error] one communicator driven from 3 streams")
    assert [row["stream"] for row in report.rows["cp"]] == ["cuda:0/stream:9"] * 2


def test_merge_names_ranks_behind_missing_and_mismatched(
        one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dumps = _seed_dumps(one_rank, monkeypatch)
    for mine, theirs in zip(dumps[0]["roles"]["cp"]["entries"], dumps[1]["roles"]["cp"]["entries"]):
        theirs["group_seq"] = mine["group_seq"]  # one group in this process: align the counts
    dumps[1]["roles"]["cp"]["entries"][-1]["op"] = "broadcast"
    dumps[1]["roles"]["cp"]["ranks"] = [0, 1, 2]
    dumps[0]["roles"]["cp"]["group_seq"] = 99
    for data in dumps:
        (tmp_path / f"flight-g0-rank{data['rank']:05d}.json").write_text(json.dumps(data))
    report = merge_dir(tmp_path)
    kinds = {hazard.kind: hazard for hazard in report.hazards}
    assert kinds["missing"].ranks == (2,)
    assert kinds["behind"].ranks == (1,)
    assert "issued all_reduce" in kinds["mismatch"].message
    assert "issued broadcast" in kinds["mismatch"].message
    assert "role cp:" in report.render() and not report.ok
    with pytest.raises(FlightDumpError, match="no flight-g"):
        merge_dir(tmp_path / "empty")


def test_dump_holds_torchs_own_entries_for_the_groups(one_rank: dist.ProcessGroup) -> None:
    recorder = FlightRecorder({"cp": one_rank}, rank=0, generation=0)
    dist.all_reduce(torch.ones(1), group=one_rank)  # plain: only torch's recorder sees it
    trace = recorder.to_dict()["torch_trace"]
    if torch_version() >= (2, 13, 0):  # gloo records by default from 2.13 (older: may be empty)
        assert trace and {entry["role"] for entry in trace} == {"cp"}
        assert trace[-1]["op"].endswith("all_reduce")
        # one by one, with the call site from torch's frames: this test, not torch's plumbing
        assert HERE in trace[-1]["caller"], trace[-1]
        assert "test_dump_holds_torchs_own_entries" in trace[-1]["caller"]
        row = merge([recorder.to_dict()]).rows["cp"][0]
        assert row["op"].endswith("all_reduce") and row["caller"] == trace[-1]["caller"]


def test_calls_that_reach_commgroups_with_a_group_are_recorded_on_its_role(
        one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from commgroups.collectives.async_wait import issue_and_wait_on
    from commgroups.integrations import dcp

    monkeypatch.delenv(ENV_VAR, raising=False)
    layout = cg.Layout(dims={"cp": 1}, roles=[cg.RoleSpec(name="cp", dims=["cp"]),
                                              cg.RoleSpec(name="checkpoint-metadata", dims="world",
                                                          backend="gloo")])
    with cg.GroupRegistry(layout) as registry:
        session = registry.flight_recorder
        assert session is not None
        cp = session.recorder.roles["cp"]
        tensor = torch.ones(2)
        with cg.async_and_wait_scope():
            dist.all_reduce(tensor, group=registry.group("cp"))
        assert cp.last is not None and (cp.last.op, cp.last.seq) == ("all_reduce", 1)
        assert HERE in cp.last.caller
        cg.AsyncWaitDist().broadcast(tensor, src=0, group=registry.group("cp"))  # spmd_types' path
        assert cp.last.op == "broadcast" and cp.last.seq == 2
        issue_and_wait_on(registry.group("cp"), dist.all_reduce, tensor, group=registry.group("cp"),
                          flight_op="fsdp.reduce_scatter")  # FSDP2's comms' path
        assert cp.last.op == "fsdp.reduce_scatter" and cp.last.state == "done"
        with cg.async_and_wait_scope():
            dist.all_reduce(tensor, group=one_rank)  # not a registry group: not recorded
        assert cp.seq == 3
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ckpt"), registry=registry)
        meta = session.recorder.roles["checkpoint-metadata"]
        assert meta.last is not None and meta.last.op == "dcp.save" and meta.last.state == "done"
        assert HERE in meta.last.caller
        cp_group = registry.group("cp")
        assert flight_index.lookup(cp_group) is cp
    assert flight_index.lookup(cp_group) is None  # the closed registry's groups left the index


def test_the_error_text_stays_short_with_a_long_dump_path() -> None:
    failed = {"op": "all_gather_into_tensor", "seq": 12345, "group_seq": 12345,
              "caller": "/very/long/path/to/a/training/script/train_with_a_long_name.py:1234 in f"}
    published = {rank: _published(12000 + rank) for rank in range(1, 40)}
    found = diagnose("cp", 0, failed, published, asked=1)
    found = dataclasses.replace(found, dump="/" + "d" * 200 + "/flight-g0-rank00000.json")
    error = _rewritten(cg.errors.RoleTimeoutError("t", role="cp",
                                                  op="all_gather_into_tensor", seq=12345), found)
    assert len(str(error)) <= 300 and "behind: rank 1 (" in str(error)
    assert error.flight is not None and len(error.flight["behind"]) == 39


def test_a_rewritten_failure_keeps_the_backends_words() -> None:
    failed = {"op": "all_reduce", "seq": 3, "group_seq": 3, "caller": "/x/train.py:9 in step"}
    found = diagnose("cp", 0, failed, {1: _published(2), 2: _published(3)}, asked=1)
    cause = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
             "by peer [127.0.0.1]:4242 " + "x" * 400)  # gloo's source line is left out
    error = _rewritten(cg.errors.RoleCollectiveError("t", role="cp", op="all_reduce", seq=3,
                                                     cause=cause), found)
    text = str(error)
    assert text.startswith("role 'cp': all_reduce #3 at train.py:9 failed: Connection closed by "
                           "peer [127.0.0.1]:4242 x"), text
    assert "behind: rank 1 (" in text and len(text) <= 300 and error.cause == cause
    assert type(error) is cg.errors.RoleCollectiveError
    # The ranks apart come first: a long diagnosis shortens the backend's words, never itself.
    elsewhere = {"fsdp": {"last": {"op": "barrier", "seq": 3, "group_seq": 3,
                                   "caller": "/x/a_long_module_name_for_a_model.py:400 in f",
                                   "state": "in flight"}}}
    found = diagnose("cp", 0, failed, {1: _published(2, **elsewhere), 2: _published(3)}, asked=1)
    found = dataclasses.replace(found, dump="/tmp/pytest-of-root/pytest-215/popen-gw0/flight0/x")
    text = str(_rewritten(cg.errors.RoleCollectiveError("t", role="cp", op="all_reduce", seq=3,
                                                        cause=cause), found))
    assert found.text() in text and len(text) <= 300, text  # the words cut short to fit


def test_at_exit_an_open_registry_whose_last_call_failed_dumps(
        one_rank: dist.ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("COMMGROUPS_FLIGHT_DIR", str(tmp_path))
    with cg.GroupRegistry(cg.Layout(dims={"cp": 1}, roles=[cg.RoleSpec(name="cp", dims=["cp"])])
                          ) as registry:
        session = registry.flight_recorder
        assert session is not None
        registry.collectives("cp").all_reduce(torch.ones(1))
        session._at_exit()  # every last call returned: nothing to keep
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(ValueError):
            registry.collectives("cp").broadcast(torch.ones(1), src=7)
        session._at_exit()  # what atexit runs when the process ends here
        assert [p.name for p in tmp_path.iterdir()] == ["flight-g0-rank00000.json"]


# ------------------------------------------------------------------------ torch's own dumps
def _torch_dump(group_name: str) -> dict[str, Any]:
    """torch's recorder as NCCL's watchdog writes it: the real one from this process where gloo
    records into it (2.13 on), else a dict with the keys and types it has there.

    torch's recorder outlives a world: after an earlier test's world in this process, its entries
    can name ``group_name`` (c10d names restart at "1") while its status and config, keyed by
    the live groups, do not; the dict stands in then too."""
    import pickle

    raw = torch_private.flight_recorder_dump()
    data = pickle.loads(raw) if raw is not None else None  # torch's own bytes, made here
    if not data or not any(e["process_group"][0] == group_name for e in data["entries"]) or (
            group_name not in data.get("pg_status", {})
            or group_name not in data.get("pg_config", {})):
        data = {"version": "2.10", "pg_config": {group_name: {"name": group_name, "desc": "",
                                                               "ranks": "[0]"}},
                "pg_status": {group_name: {"last_enqueued_collective": 1,
                                           "last_started_collective": -1,
                                           "last_completed_collective": 1}},
                "entries": [{"process_group": (group_name, "undefined"), "collective_seq_id": 1,
                             "profiling_name": "gloo:all_reduce", "state": "scheduled"}]}
    return data


def test_torchs_own_dumps_are_named_by_role_and_its_counts_name_who_is_behind(
        one_rank: dist.ProcessGroup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NCCL's watchdog writes torch's recorder per rank (``nccl_trace_rank_<r>``) on a timeout:
    the merge puts each c10d name's role and ranks beside torch's counts, and names the ranks
    whose enqueued count is lower (two ranks: rank 1's copy enqueued one call fewer)."""
    import pickle

    recorder = FlightRecorder({"cp": one_rank}, rank=0, generation=0)
    dist.all_reduce(torch.ones(1), group=one_rank)  # plain: only torch's recorder sees it
    ours = recorder.to_dict()
    name = one_rank.group_name
    for rank in (0, 1):
        (tmp_path / f"flight-g0-rank{rank:05d}.json").write_text(json.dumps({**ours, "rank": rank}))
        theirs = _torch_dump(name)
        if rank == 1:
            status = theirs["pg_status"][name]
            status["last_enqueued_collective"] -= 1
        (tmp_path / "torch").mkdir(exist_ok=True)
        (tmp_path / "torch" / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(theirs))
    report = merge_dir(tmp_path, torch_dumps=tmp_path / "torch")
    mine = [row for row in report.torch_rows if row["group"] == name]
    assert [(row["rank"], row["role"]) for row in mine] == [(0, "cp"), (1, "cp")]
    assert mine[0]["last"].endswith("(scheduled)") and "all_reduce #" in mine[0]["last"]
    behind = [h for h in report.hazards if h.kind == "torch_behind"]
    assert [(h.role, h.ranks) for h in behind] == [("cp", (1,))]
    assert "torch's own dumps" in report.render()
    from commgroups.cli import main

    assert main(["flight", "merge", str(tmp_path), "--torch-dumps",
                 str(tmp_path / "torch")]) == 1
    assert "torch_behind (cp)" in capsys.readouterr().out
    # Without torch's files: the same report, no torch rows.
    assert merge_dir(tmp_path).torch_rows == []


def test_a_torch_dump_that_holds_a_class_is_refused(tmp_path: Path) -> None:
    import pickle

    from commgroups.flight_recorder.torch_dumps import load_torch_dumps

    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps({"entries": [Path("x")]}))
    with pytest.raises(FlightDumpError, match="refusing pathlib"):
        load_torch_dumps(tmp_path)
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps({"pg_status": {}}))
    with pytest.raises(FlightDumpError, match="no entries"):
        load_torch_dumps(tmp_path)
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps(
        {"entries": [], "pg_config": {"0": {"name": "0", "ranks": "[0, 1]"}}}))
    assert load_torch_dumps(tmp_path)[0].ranks == {"0": [0, 1]}


def test_a_large_groups_join_counters_released_meanwhile_never_hold_the_shared_connection(
) -> None:
    """Beyond 93 members the counters are read in one multi_get, which waits for a missing key:
    released between the check and it, it waited out the store's timeout on the job's shared
    connection. On a real TCPStore: the read ends within its own short wait, as counters gone."""
    from datetime import timedelta

    from commgroups.flight_recorder import publisher as publisher_module

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20))
    members = list(range(100))  # 4 counters
    ask = StatusPublisher(server, "t/", 0, dict).ask_group("cp", 0, "all_reduce#1",
                                                           members=members)
    reader = StatusPublisher(server, "t/", 1, dict)
    assert len(reader.joined(ask.key, len(members))) == 4  # every counter there: one multi_get
    original_check = server.check

    class Releasing:  # the check answers, then the last member's release lands
        def __getattr__(self, name: str) -> Any:
            return getattr(server, name)

        def check(self, keys: list[str]) -> bool:
            found = bool(original_check(keys))
            for key in keys:
                server.delete_key(key)
            return found

    reader._reader = None
    reader.store = Releasing()  # type: ignore[assignment]
    started = time.monotonic()
    assert reader.joined(ask.key, len(members)) == [0, 0, 0, 0]
    waited = time.monotonic() - started
    assert waited < publisher_module.JOINED_WAIT_S + 1.5, waited  # not the store's 20 s
    assert server.check(["t/requests"])  # the shared connection still answers at once
