"""Run a function on every rank of a local multi-process world, with a deadline: nothing hangs.

The demo, the benchmarks and the tests all start small worlds of CPU processes on this machine. Ranks
are forked from a forkserver that imported torch once (a world starts in about a second instead of
paying torch's import per rank), the parent owns the TCPStore server (no port races), relays messages
the ranks post (progress, log lines) and enforces a deadline: a rank that fails, dies or hangs ends the
run with a report, never a hung parent.

Rendezvous is the fragile part on a loaded machine (gloo's connect gives up after a few refused
attempts: "Gloo connectFullMesh failed"). Every rank therefore finishes ``init_process_group`` and
meets the others in the store before any of them runs the function; if a rank fails to join, no
rank has run anything yet, and the whole world is started again on a fresh store, a bounded number
of times (``init_attempts``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.errors import WorldInitError  # defined there; importable from here as before

__all__ = ["Post", "RankReport", "WorldInitError", "run_local_world"]

_INIT_ALL = "commgroups/local_world/init/all"
_INIT_JOINED = "commgroups/local_world/init/joined"
_INIT_FAILED = "commgroups/local_world/init/failed"

logger = logging.getLogger(__name__)

Post = Callable[[Any], None]
"""How a rank sends a picklable message to the parent's ``on_message``."""


@dataclass(frozen=True)
class RankReport:
    """What one rank sent back: its return value, or the traceback of what it raised."""

    rank: int
    ok: bool
    value: Any
    traceback: str | None
    init_failed: bool = False
    """The rank (or a peer) failed before the function ran: joining the world failed."""


def _join_world(store: Any, rank: int, world_size: int, backend: str,
                timeout: timedelta) -> None:
    """init_process_group, then wait until every rank has, or one has failed (then raise)."""
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except BaseException:
        store.set(_INIT_FAILED, str(rank))
        store.set(_INIT_ALL, "1")
        raise
    if store.add(_INIT_JOINED, 1) == world_size:
        store.set(_INIT_ALL, "1")
    store.wait([_INIT_ALL], timeout)
    if store.check([_INIT_FAILED]):
        raise WorldInitError(f"rank {store.get(_INIT_FAILED).decode()} failed to join the world")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    init_timeout_s: float,
    args: tuple[Any, ...],
    results: Any,
    messages: Any,
) -> None:
    def post(message: Any) -> None:
        messages.put(message)

    joined = backend is None
    try:
        if backend is None:
            value = fn(rank, world_size, post, *args)  # the function sets up its own world
        else:
            timeout = timedelta(seconds=init_timeout_s)
            store = TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
            _join_world(store, rank, world_size, backend, timeout)
            joined = True
            try:
                value = fn(rank, world_size, post, *args)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put(RankReport(rank, True, value, None))
    except BaseException as error:  # report everything, SystemExit included, to the parent
        text = traceback.format_exc()
        try:
            results.put(RankReport(rank, False, error, text, init_failed=not joined))
        except Exception:  # the exception itself may not pickle
            results.put(RankReport(rank, False, None, text, init_failed=not joined))


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout_s: float = 600.0,
    init_timeout_s: float = 120.0,
    preload: Sequence[str] = ("torch", "torch.distributed", "commgroups"),
    on_message: Callable[[Any], None] | None = None,
    grace_s: float | None = 5.0,
    init_attempts: int = 3,
) -> dict[int, RankReport]:
    """Run ``fn(rank, world_size, post, *args)`` on ``world_size`` processes; reports by rank.

    Args:
        fn: a module-level function (it is pickled by reference); ``post(message)`` relays a
            picklable message to ``on_message`` in this process.
        backend: the default group each rank initializes; None: ranks initialize nothing.
        timeout_s: the deadline for the whole world; ranks still running then are killed.
        init_timeout_s: the store and default-group timeout of each rank.
        preload: modules the forkserver imports once, before forking ranks.
        grace_s: after one rank fails or dies, how long the others get to report before they are
            stopped (they would otherwise wait for the lost rank until their collective timeout);
            None waits for every rank until the deadline (fault tests, where survivors must time
            out on their own).
        init_attempts: how many times a world whose ranks failed to join (rendezvous) is started
            afresh; the function has run on no rank then. The last attempt's reports are returned.

    Ranks missing from the result did not report (they died, hung or were stopped).
    """
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, max(1, init_attempts) + 1):
        reports = _run_once(fn, world_size, args, backend, deadline - time.monotonic(),
                            init_timeout_s, preload, on_message, grace_s)
        failed = sorted(r for r, rep in reports.items() if rep.init_failed)
        if not failed or attempt >= init_attempts or time.monotonic() >= deadline:
            return reports
        logger.warning("local world of %d: ranks %s failed to join (attempt %d of %d); starting "
                       "the world again", world_size, failed, attempt, init_attempts)
    return reports


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    backend: str | None,
    timeout_s: float,
    init_timeout_s: float,
    preload: Sequence[str],
    on_message: Callable[[Any], None] | None,
    grace_s: float | None,
) -> dict[int, RankReport]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    server = None
    port = 0
    if backend is not None:
        server = TCPStore("127.0.0.1", 0, world_size, is_master=True,
                          timeout=timedelta(seconds=init_timeout_s), wait_for_workers=False)
        port = server.port
    results = ctx.Queue()
    messages = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, daemon=True,
                    args=(fn, rank, world_size, port, backend, init_timeout_s, args, results,
                          messages))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, RankReport] = {}
    deadline = time.monotonic() + timeout_s

    def relay() -> None:
        while True:
            try:
                message = messages.get_nowait()
            except queue.Empty:
                return
            if on_message is not None:
                on_message(message)

    try:
        while len(reports) < world_size and time.monotonic() < deadline:
            relay()
            try:
                report: RankReport = results.get(timeout=0.2)
            except queue.Empty:
                lost = any(p.exitcode not in (None, 0) for p in procs)
                if all(not p.is_alive() for p in procs) or (lost and grace_s is not None):
                    time.sleep(0.3)  # let the queue deliver what exited processes sent
                    if results.empty() and all(not p.is_alive() for p in procs):
                        break
                    if grace_s is not None:
                        deadline = min(deadline, time.monotonic() + grace_s)
                continue
            reports[report.rank] = report
            if report.init_failed:
                # Nothing ran anywhere: peers still in rendezvous would only wait for the lost rank.
                deadline = min(deadline, time.monotonic() + (grace_s or 5.0))
            elif not report.ok and grace_s is not None:
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(reports) == world_size else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        del server
    # After the joins: a rank's queue feeder flushes when the process exits, so a message posted
    # just before its result cannot arrive after the last relay (it did, under load).
    relay()
    return reports
