"""Run a test function on a real multi-process gloo world and collect every rank's result.

A thin layer over :func:`commgroups.util.local_world.run_local_world` (forkserver ranks, parent-owned
TCPStore, a deadline): a hang becomes a test failure naming the ranks that did not finish.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from commgroups import GroupRegistry, torch_internals
from commgroups.creation.agreement import store_barrier
from commgroups.util.local_world import Post, run_local_world


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each rank's traceback."""

    def __init__(self, message: str, errors: dict[int, BaseException | None]) -> None:
        super().__init__(message)
        self.errors = errors


def _without_post(fn: Callable[..., Any], env: dict[str, str], timeout: float, rank: int,
                  world_size: int, post: Post, *args: Any) -> Any:
    os.environ.update(env)  # as a launcher would set it for the rank (tests only)
    # A rank still running just before the world's deadline prints every thread's stack to the
    # test's captured stderr before it is killed: a rare hang (the torch 2.15 leg's "rank 2 did
    # not finish" in test_rebuild.py, twice in CI) then says where it waited.
    faulthandler.dump_traceback_later(max(0.9 * timeout - 5.0, 1.0), exit=False)
    try:
        return fn(rank, world_size, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_world(
    fn: Callable[..., Any],
    world_size: int = 4,
    *args: Any,
    timeout: float = 120.0,
    expect_errors: bool = False,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    With ``expect_errors`` (fault tests) every rank gets until the deadline to report, and exceptions
    (or a TimeoutError for a rank that never reported) are returned in place of results. ``env``
    is set in each rank's environment before ``fn`` runs.
    """
    reports = run_local_world(
        functools.partial(_without_post, fn, env or {}, timeout), world_size, *args,
        timeout_s=timeout, preload=("torch", "torch.distributed", "commgroups", "tests.worlds"),
        grace_s=None if expect_errors else 5.0,
    )
    if expect_errors:
        return [_outcome(reports[r]) if r in reports else TimeoutError(f"rank {r} did not finish")
                for r in range(world_size)]
    failures = {r: report for r, report in reports.items() if not report.ok}
    if failures:
        message = "\n".join(f"--- rank {r} ---\n{rep.traceback}" for r, rep in sorted(failures.items()))
        raise RankFailed(message, {r: rep.value for r, rep in failures.items()})
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        raise AssertionError(
            f"ranks {missing} reported nothing within {timeout:g}s (hang, or crash before reporting)"
        )
    return [reports[r].value for r in range(world_size)]


def _outcome(report: Any) -> Any:
    """A rank's return value, or what it raised with the rank's traceback as a note (an exception
    crosses processes without its traceback): :func:`explain` shows it."""
    if report.ok:
        return report.value
    if isinstance(report.value, BaseException):
        report.value.add_note(f"--- the rank's traceback ---\n{report.traceback}")
        return report.value
    return RuntimeError(report.traceback)


def explain(results: list[Any]) -> str:
    """Every rank's result of an ``expect_errors`` world, exceptions with their tracebacks: the
    message of an assertion about them, so a failure in CI says where each rank was."""
    return "\n".join(
        f"--- rank {rank}: " + ("".join(traceback.format_exception(result))
                                if isinstance(result, BaseException) else repr(result))
        for rank, result in enumerate(results))


def connected_barrier(registry: GroupRegistry, rank: int, world_size: int,
                      victim: int | None = None) -> None:
    """A checkpoint-metadata barrier that every rank has left before this returns on any rank;
    with ``victim``, that rank exits for good (``os._exit``) and the others return once its
    process is gone.

    Call it before a test kills a rank. A gloo barrier returns on a rank once that rank has what it
    needs, while a slower peer may still be reading the rank's last message; a rank that exits at
    that moment fails its peer's barrier (CI saw this: the survivor raised before its rebuild). The
    store barrier after it lets the victim exit only once every peer's barrier has returned. The
    survivors then wait for the victim's process to end: on loaded cores its listener thread
    could otherwise still answer their loss report (alive, by its word) before the process went.
    """
    store = torch_internals.default_store()
    generation = registry.generation
    store.set(f"tests/pid/{generation}/{rank}", str(os.getpid()))
    # Lined up in the store first (60 s): a test's role timeout is seconds, and under the
    # suite's load ranks reach this point further apart than that (the 2.15 leg's
    # test_a_second_loss_during_rebuild...: a RoleHangError out of this barrier at 3 s).
    store_barrier(store, f"tests/arrived/{generation}", rank, world_size,
                  timedelta(seconds=60), "tests: every rank reached the barrier")
    registry.collectives("checkpoint-metadata").barrier()
    store_barrier(store, f"tests/left-barrier/{generation}", rank, world_size,
                  timedelta(seconds=60), "tests: every rank left the barrier")
    if victim is None:
        return
    if rank == victim:
        os._exit(0)  # lost for good: no report, no cleanup
    pid = int(store.get(f"tests/pid/{generation}/{victim}"))
    deadline = time.monotonic() + 60
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # the read of one reaped after the open: ESRCH
        return True


def relay_rank(registry: GroupRegistry, rank: int, world: int) -> int:
    """Which rank relays for this host (every rank of the world is on it), once every rank
    hears events through it."""
    live = registry._recovery.liveness
    assert live is not None
    deadline = time.monotonic() + 10.0
    while not live.relayed:
        assert time.monotonic() < deadline, f"rank {rank} never reached its host's relay"
        time.sleep(0.02)
    store = torch_internals.default_store()
    if live._relay is not None:
        store.set("tests/relay", str(rank))
    store_barrier(store, "tests/relayed", rank, world, timedelta(seconds=30), "relayed")
    return int(store.get("tests/relay"))
