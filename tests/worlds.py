"""Run a function on a real multi-process gloo world and collect every rank's result.

Ranks are forked from a forkserver that imported torch once, so a 4-rank world starts in a fraction
of a second instead of paying torch's import per process. The parent owns the TCPStore server (no port
races) and enforces a deadline: a hang becomes a test failure naming the ranks that did not finish.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_PRELOAD = ["torch", "torch.distributed", "commgroups"]


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each rank's traceback."""

    def __init__(self, message: str, errors: dict[int, BaseException | None]) -> None:
        super().__init__(message)
        self.errors = errors


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    results: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value, None))
    except BaseException as error:  # report everything, including SystemExit, to the parent
        text = traceback.format_exc()
        try:
            results.put((rank, False, error, text))
        except Exception:  # the exception itself may not pickle
            results.put((rank, False, None, text))


def run_world(
    fn: Callable[..., Any],
    world_size: int = 4,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    expect_errors: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    With ``expect_errors`` the exceptions are returned in place of results instead of raised.
    """
    ctx = _context()
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                           timeout=timedelta(seconds=60), wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, server.port, backend, args, results, env or {}),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[bool, Any, str | None]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value, text = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                if dead and all(not p.is_alive() for p in procs):
                    # give the queue a moment to deliver what exited processes sent
                    time.sleep(0.2)
                    if results.empty():
                        break
                continue
            collected[rank] = (ok, value, text)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        del server
    missing = [r for r in range(world_size) if r not in collected]
    if missing and not expect_errors:
        raise AssertionError(
            f"ranks {missing} reported nothing within {timeout:g}s (hang, or crash before reporting); "
            f"exit codes: {[p.exitcode for p in procs]}"
        )
    if expect_errors:
        return [
            (collected[r][1] if collected[r][0] else (collected[r][1] or RuntimeError(collected[r][2])))
            if r in collected else TimeoutError(f"rank {r} did not finish")
            for r in range(world_size)
        ]
    failures = {r: v for r, v in collected.items() if not v[0]}
    if failures:
        message = "\n".join(f"--- rank {r} ---\n{v[2]}" for r, v in sorted(failures.items()))
        raise RankFailed(message, {r: v[1] for r, v in failures.items()})
    return [collected[r][1] for r in range(world_size)]
