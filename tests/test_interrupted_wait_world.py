"""A role's call on a gloo group that its generation's interruption does not end is abandoned
a second after it, and the generation keeps the group until the call ends (real gloo, 2 ranks).

gloo leaves some calls to their own timeout after every socket of the group was severed (seen
in one rebuild of 20 to 50 where every rank rebuilds right after an all_reduce); here the peer
simply never joins, and a timer plays the liveness listener that interrupts the generation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups.collectives.async_wait import ABANDON_AFTER_S, WAIT_SLICE_S
from commgroups.collectives.role_collectives import RoleCollectives
from commgroups.errors import RoleCollectiveError
from tests.worlds import run_world

pytestmark = pytest.mark.world

CALL_TIMEOUT_S = 5.0
INTERRUPTED_AT_S = 0.5


class _Watch:
    """The generation's side of the protocol: interrupted by a timer, abandoned calls kept."""

    def __init__(self) -> None:
        self.interrupted = False
        self.abandoned: list[tuple[dist.ProcessGroup, Any]] = []

    def abandon(self, group: dist.ProcessGroup, work: Any) -> None:
        self.abandoned.append((group, work))


def _interrupted_while_waiting(watch: Any, call: Callable[[], object],
                               caught: type[Exception]) -> dict[str, Any]:
    """Interrupt ``watch`` at 0.5 s (the liveness listener's part, without the sever, which
    would end the call at once) and run ``call``, a collective the peer never joins: its error
    (of type ``caught``) and how long it waited."""
    start = time.monotonic()  # before the timer, which may run first on a loaded machine
    threading.Timer(INTERRUPTED_AT_S, lambda: setattr(watch, "interrupted", True)).start()
    out: dict[str, Any] = {}
    try:
        call()
    except caught as error:
        out["error"] = str(error)
    out["waited_s"] = time.monotonic() - start
    return out


def _assert_abandoned_in_time(result: dict[str, Any]) -> None:
    """Failed as interrupted a second after the interruption, well before the call's timeout."""
    assert "interrupted: a rank-loss report ended this generation" in result.get("error", ""), result
    earliest = INTERRUPTED_AT_S + ABANDON_AFTER_S
    assert earliest <= result["waited_s"] <= earliest + 3 * WAIT_SLICE_S, result


def _abandoned_call(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=CALL_TIMEOUT_S))
    dist.barrier(group=group)
    out: dict[str, Any] = {}
    if rank == 0:
        watch = _Watch()
        handle = RoleCollectives(group, role="fsdp", async_and_wait=True, watch=watch)
        handle.all_reduce(torch.ones(2))  # both ranks: slices that end with the work
        start = time.monotonic()
        # rank 1 never joins this one
        out = _interrupted_while_waiting(watch, lambda: handle.all_reduce(torch.ones(2)),
                                         RoleCollectiveError)
        out["abandoned"] = len(watch.abandoned)
        work = watch.abandoned[0][1] if watch.abandoned else None
        out["running_then"] = work is not None and not work.is_completed()
        deadline = time.monotonic() + CALL_TIMEOUT_S + 5
        while work is not None and not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["ended_by_itself_s"] = time.monotonic() - start
        out["ended"] = work is not None and work.is_completed()
    else:
        dist.all_reduce(torch.ones(2), group=group)  # the first call only
    dist.barrier()  # the default group: rank 1 waits here for rank 0's whole story
    if rank == 0 and out.get("ended"):
        dist.destroy_process_group(group)  # the call ended: destroying it does not block
    return out


def test_a_call_the_interruption_does_not_end_is_abandoned_a_second_later() -> None:
    result = run_world(_abandoned_call, 2, timeout=60)[0]
    _assert_abandoned_in_time(result)
    assert result["abandoned"] == 1 and result["running_then"], result
    # the call itself goes on to its own timeout: the group may be destroyed only then
    assert result["ended"] and result["ended_by_itself_s"] >= CALL_TIMEOUT_S - 0.5, result


def _abandoned_plain_call(rank: int, world: int) -> dict[str, Any]:
    import commgroups as cg
    from commgroups.collectives.async_wait import async_and_wait_scope

    layout = cg.Layout(dims={"cp": 2}, roles=[
        cg.RoleSpec(name="cp", dims=["cp"], timeout_s=CALL_TIMEOUT_S),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")])
    registry = cg.GroupRegistry(layout, heartbeat_s=None).create()
    group = registry.group("cp")
    out: dict[str, Any] = {}
    dist.all_reduce(torch.ones(2), group=group)
    if rank == 0:
        generation = registry._current
        assert generation is not None

        def plain_call() -> None:
            with async_and_wait_scope():  # a library's plain call on the registry's group
                dist.all_reduce(torch.ones(2), group=group)  # rank 1 never joins this one

        out = _interrupted_while_waiting(generation, plain_call, RuntimeError)
        out["abandoned"] = len(generation.abandoned)
        time.sleep(CALL_TIMEOUT_S)  # the call ends at its own timeout; then close() frees it
    dist.barrier()
    registry.close()
    return out


def test_a_plain_call_on_a_registry_gloo_group_is_abandoned_too() -> None:
    result = run_world(_abandoned_plain_call, 2, timeout=60)[0]
    _assert_abandoned_in_time(result)
    assert result["abandoned"] == 1, result
