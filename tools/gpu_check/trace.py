"""Read a PyTorch profiler (Kineto) Chrome trace: which stream each GPU event ran on, and why.

Pure: reads the JSON ``torch.profiler.profile.export_chrome_trace`` writes (or its ``traceEvents``
list), imports no torch. The collector (:mod:`tools.gpu_check.streams`) brackets what it measures
with three ``record_function`` ranges on the caller's stream:

``cg:before``  a marker kernel: its stream is the caller's current stream;
``cg:call``    the collective call under test;
``cg:after``   a second marker kernel: if it started only after the collective's GPU work ended, the
               caller's stream was ordered behind the collective (it waited).

A GPU event (kernel, memcpy, memset) is tied to the CPU range that launched it through its
``correlation`` id, which it shares with the CUDA runtime/driver call that launched it. It is
*collective* work when its name says NCCL or its launch happened inside a communication op
(``nccl:*``, ``c10d::*``, ``record_param_comms``, ``_c10d_functional::*``): a one-rank NCCL
communicator often moves its bytes with a plain ``cudaMemcpyAsync``, whose event is named
``Memcpy DtoD`` and says nothing of NCCL. With ``enable_cuda_sync_events``, Kineto also records
``cuda_sync`` events; a ``Stream Wait Event`` on the caller's stream whose ``wait_on_stream`` is the
collective's stream is direct evidence that the caller waited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMM_OP_PREFIXES",
    "GPU_CATEGORIES",
    "OUTSIDE",
    "PHASES",
    "GpuEvent",
    "ParsedTrace",
    "StreamWait",
    "parse_trace",
    "trim_trace",
]

GPU_CATEGORIES: tuple[str, ...] = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto categories of work that runs on a GPU stream."""
LAUNCH_CATEGORIES: tuple[str, ...] = ("cuda_runtime", "cuda_driver")
COMM_OP_PREFIXES: tuple[str, ...] = ("nccl:", "c10d::", "record_param_comms", "_c10d_functional::")
"""CPU op names whose launches are collective work."""
PHASES: tuple[str, ...] = ("cg:before", "cg:call", "cg:after")
"""The record_function ranges the stream collector puts around each measured call."""
STREAM_WAIT = "Stream Wait Event"
OUTSIDE = "outside"
"""The phase of an event launched outside every ``cg:*`` range."""
# Only these args survive trimming: what parse_trace reads, plus a few that help a person reading it.
_KEPT_ARGS = ("stream", "correlation", "device", "wait_on_stream", "cuda_sync_kind", "bytes",
              "External id", "cbid")


@dataclass(frozen=True)
class GpuEvent:
    """One piece of GPU work from the trace."""

    name: str
    category: str
    stream: int
    start_us: float
    end_us: float
    phase: str | None
    """The ``cg:*`` range its launch fell in, :data:`OUTSIDE` when its launch is known but in no
    range, None when the trace does not say where it was launched."""
    collective: bool

    @property
    def short_name(self) -> str:
        """The name cut at its first ``(`` or ``<`` and to 48 characters, for tables."""
        name = self.name
        for stop in ("(", "<"):
            if stop in name and not name.startswith(stop):
                name = name.split(stop, 1)[0]
        return name.strip()[:48]


@dataclass(frozen=True)
class StreamWait:
    """A ``Stream Wait Event``: ``stream`` was made to wait for work recorded on ``wait_on_stream``."""

    stream: int
    wait_on_stream: int | None
    phase: str | None


@dataclass(frozen=True)
class ParsedTrace:
    """The GPU side of one trace, ordered by start time."""

    gpu: tuple[GpuEvent, ...]
    waits: tuple[StreamWait, ...]
    sync_events_recorded: bool
    """Kineto recorded cuda_sync events at all (``enable_cuda_sync_events``); without them a missing
    ``Stream Wait Event`` proves nothing."""

    def in_phase(self, phase: str, *, collective: bool | None = None) -> list[GpuEvent]:
        """GPU events launched in ``phase`` (optionally only collective or only other work)."""
        return [e for e in self.gpu if e.phase == phase
                and (collective is None or e.collective == collective)]


def _events(trace: Mapping[str, Any] | Sequence[Any]) -> list[Mapping[str, Any]]:
    raw = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    return [e for e in raw if isinstance(e, Mapping)]


def _number(value: Any) -> float | None:
    try:
        return float(value)  # Kineto writes ts as a number; some exporters as a string
    except (TypeError, ValueError):
        return None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _inside(ranges: Sequence[tuple[str, float, float]], ts: float | None) -> str | None:
    """The range ``ts`` falls in; :data:`OUTSIDE` if none; None when ``ts`` is unknown."""
    if ts is None:
        return None
    for name, start, end in ranges:
        if start <= ts <= end:
            return name
    return OUTSIDE


def parse_trace(trace: Mapping[str, Any] | Sequence[Any]) -> ParsedTrace:
    """The GPU events of a Chrome trace with their stream, ``cg:*`` phase and collective flag.

    Args:
        trace: the loaded JSON (a dict with ``traceEvents``, or that list itself).

    Returns:
        A :class:`ParsedTrace`; events with no ``args.stream`` are skipped.

    Example::

        parsed = parse_trace(json.loads(Path("trace.json").read_text()))
        {e.stream for e in parsed.in_phase("cg:call", collective=True)}
    """
    events = _events(trace)
    phases: list[tuple[str, float, float]] = []
    comm_ops: list[tuple[str, float, float]] = []
    launches: dict[int, float] = {}
    for event in events:
        ts, category, name = _number(event.get("ts")), event.get("cat"), str(event.get("name", ""))
        if ts is None:
            continue
        end = ts + (_number(event.get("dur")) or 0.0)
        if category == "user_annotation" and name in PHASES:
            phases.append((name, ts, end))
        elif category == "cpu_op" and name.startswith(COMM_OP_PREFIXES):
            comm_ops.append((name, ts, end))
        elif category in LAUNCH_CATEGORIES:
            correlation = _int((event.get("args") or {}).get("correlation"))
            if correlation is not None:
                launches[correlation] = ts
    gpu: list[GpuEvent] = []
    waits: list[StreamWait] = []
    sync_recorded = False
    for event in events:
        args = event.get("args") or {}
        category, name = event.get("cat"), str(event.get("name", ""))
        stream, ts = _int(args.get("stream")), _number(event.get("ts"))
        correlation = _int(args.get("correlation"))
        launch = launches.get(correlation) if correlation is not None else None
        if category == "cuda_sync":
            sync_recorded = True
            kind = args.get("cuda_sync_kind", name)
            if kind == STREAM_WAIT and stream is not None:
                source = _int(args.get("wait_on_stream"))
                waits.append(StreamWait(stream, None if source is None or source < 0 else source,
                                        _inside(phases, launch)))
            continue
        if category not in GPU_CATEGORIES or stream is None or ts is None:
            continue
        collective = "nccl" in name.lower() or _inside(comm_ops, launch) not in (None, OUTSIDE)
        gpu.append(GpuEvent(name, str(category), stream, ts,
                            ts + (_number(event.get("dur")) or 0.0),
                            _inside(phases, launch), collective))
    gpu.sort(key=lambda e: e.start_us)
    return ParsedTrace(tuple(gpu), tuple(waits), sync_recorded)


def trim_trace(trace: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    """Only what :func:`parse_trace` reads: GPU work, its launches, sync events, cg and comm ranges.

    A profiler trace of one call is mostly Python and CPU op events; the trimmed one keeps the
    answer (tens of events) small enough to travel back from a GPU machine and to commit.
    """
    events = _events(trace)
    wanted: set[int] = set()
    for event in events:
        if event.get("cat") in (*GPU_CATEGORIES, "cuda_sync"):
            correlation = _int((event.get("args") or {}).get("correlation"))
            if correlation is not None:
                wanted.add(correlation)
    kept: list[dict[str, Any]] = []
    for event in events:
        category, name = event.get("cat"), str(event.get("name", ""))
        args = event.get("args") or {}
        keep = (
            category in (*GPU_CATEGORIES, "cuda_sync")
            or (category == "user_annotation" and name in PHASES)
            or (category == "cpu_op" and name.startswith(COMM_OP_PREFIXES))
            or (category in LAUNCH_CATEGORIES and _int(args.get("correlation")) in wanted)
        )
        if keep and event.get("ph", "X") == "X":
            slim = {k: event[k] for k in ("name", "cat", "ph", "ts", "dur", "pid", "tid")
                    if k in event}
            slim["args"] = {k: args[k] for k in _KEPT_ARGS if k in args}
            kept.append(slim)
    return {"traceEvents": kept}
