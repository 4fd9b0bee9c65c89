"""Run one benchmark function on a real multi-process gloo world, or on a one-process fake world.

Built on :func:`commgroups.util.local_world.run_local_world` (forkserver ranks, parent-owned TCPStore, a
deadline); this module adds rank 0's progress messages, relayed to the CLI's progress bar.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

from commgroups.bench.progress import NullProgress, Progress, QueueProgress, apply_message
from commgroups.creation.descriptor_table import grow_to
from commgroups.errors import WorldFailed  # defined there; importable from here as before
from commgroups.flight_recorder import session as flight_session
from commgroups.flight_recorder.session import DIAGNOSIS
from commgroups.util.local_world import Post, run_local_world

__all__ = ["DiagnosesAtDebug", "WorldFailed", "grow_descriptor_table", "run_world"]

_PRELOAD = ("torch", "torch.distributed", "commgroups", "commgroups.bench")
_DESCRIPTOR_TABLE = 1024


class DiagnosesAtDebug(logging.Filter):
    """Lowers the flight recorder's diagnoses to debug: a benchmark's rank losses are planned,
    and their diagnoses (one per role and world) would fill the bench's console. Every other
    record passes as it is: a real error still prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, DIAGNOSIS, False) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def grow_descriptor_table(size: int = _DESCRIPTOR_TABLE) -> None:
    """Grow this process's descriptor table to ``size`` entries (capped by ``RLIMIT_NOFILE``)
    now, before anything is measured (:func:`~commgroups.creation.descriptor_table.grow_to`).

    A growth waits for an RCU grace period in a process with threads (Linux's
    ``expand_fdtable``): 25-35 ms here on 8 gloo ranks, once per doubling. The creation variants
    open different numbers of sockets (8 ranks: the registry's groups take a rank from 47
    descriptors to 80, DeviceMesh's to 61), so in a world that runs them one after another that
    stall landed on whichever variant first passed 64: the registry in at least two worlds of
    five, DeviceMesh in none. Grown first, it is a cost of the rank's start, like the warm-up
    group's connections. The first creation in a fresh process is measured without it
    (``run_world(grow_table=False)``: :func:`~commgroups.bench.creation.measure_first`).
    """
    grow_to(size - 1)


def _with_progress(fn: Callable[..., Any], simulated_world: int | None, grow_table: bool,
                   rank: int, world_size: int, post: Post, *args: Any) -> Any:
    logging.getLogger(flight_session.__name__).addFilter(DiagnosesAtDebug())
    if grow_table:
        grow_descriptor_table()
    progress: Progress = QueueProgress(post) if rank == 0 else NullProgress()
    # A fake world is one process playing rank 0 of `simulated_world`; the function (re)initialises
    # it itself, since creation benchmarks start each repetition from a fresh default group.
    return fn(rank, simulated_world or world_size, progress, *args)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    progress: Progress | None = None,
    lost: Collection[int] = (),
    grow_table: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, progress, *args)`` on every rank; return the results by rank.

    With ``backend="fake"`` a single process runs ``fn(0, world_size, progress, *args)`` and the
    result list has one entry. ``fn`` and ``args`` must pickle (module-level functions).
    ``lost``: ranks expected to die (a rank-loss benchmark kills them): their results are None,
    and the survivors get until the deadline to report (not a few seconds after the death).
    ``grow_table``: grow each rank's descriptor table first (:func:`grow_descriptor_table`).
    """
    fake = backend == "fake"
    processes = 1 if fake else world_size
    reports = run_local_world(
        functools.partial(_with_progress, fn, world_size if fake else None, grow_table),
        processes, *args,
        backend=None if fake else backend, timeout_s=timeout_s, init_timeout_s=300.0,
        preload=_PRELOAD,
        on_message=None if progress is None else functools.partial(apply_message, progress),
        grace_s=None if lost else 5.0,
    )
    failures = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    if failures:
        raise WorldFailed("\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items())))
    missing = [r for r in range(processes) if r not in reports and r not in lost]
    if missing:
        raise WorldFailed(
            f"{backend} world of {world_size}: ranks {missing} did not finish within {timeout_s:g}s "
            "(hang or crash)"
        )
    return [reports[r].value if r in reports else None for r in range(processes)]
