"""AsyncWaitDist and the async_and_wait_scope() scope: what they patch, restore and issue.

In-process checks use a real 1-rank gloo world; spmd_types' raw blocking paths are checked on a real
4-rank gloo world, observed at the c10d op level through the audit recorder.

Its tests that start processes are in ``tests/test_async_wait_world.py`` (marked ``world``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commgroups as cg
from commgroups.collectives.async_wait import (
    ASYNC_OP_FUNCTIONS,
    issue_and_wait_on,
    wrap_async_wait,
)
from commgroups.flight_recorder import index as flight_index
from commgroups.flight_recorder.entries import FlightEntry
from commgroups.flight_recorder.recorder import RoleRecorder

ENTRY_POINTS = (*ASYNC_OP_FUNCTIONS, "send", "recv")


def _snapshot() -> dict[tuple[str, str], Any]:
    return {(m.__name__, n): getattr(m, n, None) for m in (dist, c10d) for n in ENTRY_POINTS}


UNPATCHED_ALL_REDUCE = dist.all_reduce  # read at import, before any scope opens


def async_and_wait_active() -> bool:
    """Whether a scope's patch is in place (torch.distributed.all_reduce is not torch's own)."""
    return dist.all_reduce is not UNPATCHED_ALL_REDUCE


def _async_flags(rec: cg.audit.Recorder) -> list[tuple[str, bool | None]]:
    return [(r.op, r.async_op) for r in rec.records]


# ------------------------------------------------------------------------ the scope: patch/restore
def test_scope_patches_every_entry_point_and_restores_them() -> None:
    before = _snapshot()
    assert not async_and_wait_active()
    with cg.async_and_wait_scope():
        assert async_and_wait_active()
        inside = _snapshot()
        for key, original in before.items():
            if original is not None:
                assert inside[key] is not original, key
                assert getattr(inside[key], "__wrapped__", None) is original, key
        # one wrapper per function: torch.distributed and distributed_c10d agree
        assert dist.all_reduce is c10d.all_reduce
    assert _snapshot() == before
    assert not async_and_wait_active()


def test_scope_restores_on_exception() -> None:
    before = _snapshot()
    with pytest.raises(KeyError, match="boom"), cg.async_and_wait_scope():
        raise KeyError("boom")
    assert _snapshot() == before


def test_nested_scopes_restore_only_at_the_outermost_exit() -> None:
    before = _snapshot()
    with cg.async_and_wait_scope():
        patched = _snapshot()
        with cg.async_and_wait_scope():
            assert _snapshot() == patched  # nothing wrapped twice
        assert _snapshot() == patched  # the inner exit kept the outer scope's patch
    assert _snapshot() == before


def test_overlapping_scopes_across_threads() -> None:
    before = _snapshot()
    entered, release_a, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def thread_a() -> None:
        with cg.async_and_wait_scope():
            entered.set()
            release_a.wait(10)
        a_done.set()

    worker = threading.Thread(target=thread_a)
    worker.start()
    assert entered.wait(10)
    with cg.async_and_wait_scope():
        release_a.set()
        assert a_done.wait(10)
        seen["still_patched_after_a_left"] = async_and_wait_active()
    worker.join(10)
    assert seen["still_patched_after_a_left"]
    assert _snapshot() == before


def test_replacement_inside_scope_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    before = _snapshot()

    def theirs(*args: Any, **kwargs: Any) -> None:
        """someone else's patch"""

    with cg.async_and_wait_scope():
        dist.barrier = theirs
    try:
        assert dist.barrier is theirs
        assert "replaced inside the scope" in caplog.text
    finally:
        dist.barrier = before[("torch.distributed", "barrier")]
    assert _snapshot() == before


def test_wrap_needs_async_op() -> None:
    with pytest.raises(TypeError, match="no async_op parameter"):
        wrap_async_wait(dist.all_gather_object)
    wrapped = wrap_async_wait(dist.all_reduce)
    assert wrap_async_wait(wrapped) is wrapped


# ------------------------------------------------------------------ what reaches c10d (1 rank)
def test_scope_issues_async_whatever_the_caller_passed(one_rank: dist.ProcessGroup) -> None:
    t = torch.ones(3)
    with cg.audit.record() as rec:
        dist.all_reduce(t, group=one_rank)  # raw, outside the scope: blocking
        with cg.async_and_wait_scope():
            assert dist.all_reduce(t, group=one_rank) is None
            assert dist.all_reduce(t, dist.ReduceOp.SUM, one_rank, False) is None  # positional
            work = dist.all_reduce(t, dist.ReduceOp.SUM, one_rank, True)
            assert type(work).__name__ == "Work"  # the caller asked async: unwaited Work
            work.wait()
            objects: list[Any] = [None]
            dist.all_gather_object(objects, {"x": 1}, group=one_rank)  # torch's inner calls
            dist.barrier(group=one_rank)
    flags = _async_flags(rec)
    assert flags[0][1] is False  # the raw all_reduce
    assert all(async_op is True for _, async_op in flags[1:]), flags
    assert len(flags) >= 1 + 3 + 2 + 1, flags  # all_gather_object: sizes, then the payload
    assert objects == [{"x": 1}]
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_async_wait_dist_forwards_and_wraps(one_rank: dist.ProcessGroup) -> None:
    fake_dist = cg.AsyncWaitDist()
    assert fake_dist.ReduceOp is dist.ReduceOp
    assert fake_dist.get_rank(one_rank) == 0
    assert fake_dist.ProcessGroup is dist.ProcessGroup
    assert "all_reduce" in dir(fake_dist) and "AsyncWaitDist" in repr(fake_dist)
    assert fake_dist.all_gather_object is dist.all_gather_object  # object collectives pass through
    t = torch.ones(2)
    out = torch.empty(2)
    with cg.audit.record() as rec:
        fake_dist.all_reduce(t, op=fake_dist.ReduceOp.SUM, group=one_rank)
        fake_dist.all_gather_into_tensor(out, t, group=one_rank)
        fake_dist.reduce_scatter_tensor(out, t, group=one_rank)
        fake_dist.broadcast(t, src=0, group=one_rank)
        work = fake_dist.all_reduce(t, group=one_rank, async_op=True)
        work.wait()
    flags = _async_flags(rec)
    assert len(flags) == 5 and all(async_op is True for _, async_op in flags), flags
    assert not async_and_wait_active()  # AsyncWaitDist changes nothing process-wide


# ------------------------------------------------------------------- failures inside the scope
def test_a_timeout_inside_the_scope_is_diagnosed_once(
        one_rank: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the scope dist.all_reduce is the scope's wrapper, which records and diagnoses a
    failure itself: registry.collectives' call and FSDP2's comms (which call the wrapper) must
    not diagnose it a second time (a second ask to the group, nested messages)."""
    recorder = RoleRecorder("cp", one_rank)
    diagnosed: list[FlightEntry | None] = []

    def diagnose(failure: cg.errors.RoleCollectiveError,
                 entry: FlightEntry | None) -> cg.errors.RoleCollectiveError:
        diagnosed.append(entry)
        return failure

    recorder.diagnose = diagnose
    handle = cg.RoleCollectives(one_rank, role="cp", async_and_wait=True, flight=recorder)

    @functools.wraps(c10d.all_reduce)
    def timing_out(*args: Any, **kwargs: Any) -> None:  # NCCL refusing work after its watchdog
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error: Connection timed out")

    def fsdp_comm(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
        # FSDP2's DefaultAllGather looks dist's collective up at call time: the scope's wrapper.
        return dist.all_reduce(tensor, group=group, async_op=async_op)

    for module in (dist, c10d):
        monkeypatch.setattr(module, "all_reduce", timing_out)
    flight_index.register([recorder])
    try:
        with cg.async_and_wait_scope(), pytest.raises(cg.errors.RoleTimeoutError) as raised:
            handle.all_reduce(torch.ones(1))
        text = str(raised.value)
        assert len(diagnosed) == 1 and text.count("fix:") == 1, text
        assert text.startswith("role 'cp': all_reduce #1 on group") and "#2" not in text, text
        assert [(e.op, e.seq, e.state) for e in recorder.entries] == [("all_reduce", 1, "failed")]
        with cg.async_and_wait_scope(), pytest.raises(cg.errors.RoleTimeoutError) as nested:
            issue_and_wait_on(one_rank, fsdp_comm, torch.ones(1), one_rank,
                              flight_op="fsdp.all_gather")
    finally:
        flight_index.unregister([recorder])
    text = str(nested.value)
    assert len(diagnosed) == 2 and text.count("fix:") == 1, text
    assert [(e.op, e.state) for e in list(recorder.entries)[1:]] == [
        ("fsdp.all_gather", "failed"), ("all_reduce", "failed")]
