"""Run one benchmark function on a real multi-process gloo world, or on a one-process fake world.

Ranks are forked from a forkserver that imported torch once, so a world starts in about a second
instead of paying torch's import per rank. The parent owns the TCPStore server (no port races), relays
rank 0's progress messages to the progress bar and enforces a deadline: a hung benchmark becomes an
error naming the ranks that did not finish, never a hung CLI.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.bench.progress import NullProgress, Progress, QueueProgress, apply_message

__all__ = ["WorldFailed", "run_world"]

_PRELOAD = ["torch", "torch.distributed", "commgroups", "commgroups.bench"]


class WorldFailed(RuntimeError):
    """A benchmark rank raised, crashed or did not finish in time."""


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
    progress_queue: Any,
) -> None:
    progress: Progress = QueueProgress(progress_queue) if rank == 0 else NullProgress()
    try:
        if backend == "fake":
            # One process is rank 0 of a simulated world; the function (re)initialises it itself,
            # since creation benchmarks start each repetition from a fresh default group.
            value = fn(rank, world_size, progress, *args)
        else:
            store = TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=120))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=300))
            try:
                value = fn(rank, world_size, progress, *args)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put((rank, True, value, None))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, None, traceback.format_exc()))


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    progress: Progress | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, progress, *args)`` on every rank; return the results by rank.

    With ``backend="fake"`` a single process runs ``fn(0, world_size, progress, *args)`` and the
    result list has one entry. ``fn`` and ``args`` must pickle (module-level functions).
    """
    ctx = _context()
    processes = 1 if backend == "fake" else world_size
    server = None
    port = 0
    if backend != "fake":
        server = TCPStore("127.0.0.1", 0, world_size, is_master=True,
                               timeout=timedelta(seconds=120), wait_for_workers=False)
        port = server.port
    results = ctx.Queue()
    messages = ctx.Queue()
    procs = [
        ctx.Process(target=_worker,
                    args=(fn, rank, world_size, port, backend, args, results, messages),
                    daemon=True)
        for rank in range(processes)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[bool, Any, str | None]] = {}
    deadline = time.monotonic() + timeout_s

    def relay() -> None:
        while True:
            try:
                message = messages.get_nowait()
            except queue.Empty:
                return
            if progress is not None:
                apply_message(progress, message)

    try:
        while len(collected) < processes and time.monotonic() < deadline:
            relay()
            try:
                rank, ok, value, text = results.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or all(
                    not p.is_alive() for p in procs
                ):
                    time.sleep(0.5)  # let the queue deliver what exited processes sent
                    if results.empty():
                        break
                continue
            collected[rank] = (ok, value, text)
            if not ok:
                # The others would wait for the failed rank until their collective timeout: give
                # them a moment to report their own errors, then stop the world.
                deadline = min(deadline, time.monotonic() + 5.0)
        relay()
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(collected) == processes else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        del server
    failures = {r: v[2] for r, v in collected.items() if not v[0]}
    if failures:
        raise WorldFailed("\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items())))
    missing = [r for r in range(processes) if r not in collected]
    if missing:
        raise WorldFailed(
            f"{backend} world of {world_size}: ranks {missing} did not finish within {timeout_s:g}s "
            f"(hang or crash); exit codes {[p.exitcode for p in procs]}"
        )
    return [collected[r][1] for r in range(processes)]
