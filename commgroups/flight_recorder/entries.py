"""One recorded collective (:class:`FlightEntry`) and the cheap call-site walk that names its caller.

The hot path stores references only (the caller's code object and line, the tensors' shapes and
dtypes as torch gives them); text is made when an entry is read (:meth:`FlightEntry.to_dict`), so
recording stays a few attribute stores per call.
"""

from __future__ import annotations

import time
from types import CodeType, FrameType
from typing import Any

import torch

from commgroups.util.call_sites import is_plumbing

__all__ = ["FlightEntry", "SiteCache", "caller_of", "caller_stream", "line_of", "site_text", "tensor_facts"]

# Tensors of a list argument recorded per call (all_gather's output list can hold hundreds).
_MAX_LISTED = 8


class SiteCache:
    """Per-recorder memory of which code objects are plumbing (torch, commgroups' wrappers).

    A frame's module is looked up once per code object, so the walk costs a dict lookup per frame.
    """

    __slots__ = ("plumbing",)

    def __init__(self) -> None:
        # Keyed by id(code): hashing a code object hashes its constants and names (microseconds
        # for a long function). The code object is kept in the value, so its id stays its own.
        self.plumbing: dict[int, tuple[CodeType, bool]] = {}


def caller_of(frame: FrameType | None, cache: SiteCache) -> tuple[CodeType | None, int]:
    """The first frame from ``frame`` outwards outside the plumbing, as (code, instruction offset).

    ``(None, -1)`` when every frame is plumbing. Uses ``frame.f_back`` only: no ``inspect``; the
    offset (``f_lasti``) is kept rather than ``f_lineno``, which decodes the line table on every
    read (microseconds in a long function): :func:`line_of` turns it into a line when read.
    """
    known = cache.plumbing
    while frame is not None:
        code = frame.f_code
        seen = known.get(id(code))
        if seen is not None and seen[0] is code:
            inside = seen[1]
        else:
            module = frame.f_globals.get("__name__")
            inside = isinstance(module, str) and is_plumbing(module)
            known[id(code)] = (code, inside)
        if not inside:
            return code, frame.f_lasti
        frame = frame.f_back
    return None, -1


def line_of(code: CodeType, offset: int) -> int:
    """The source line of instruction ``offset`` in ``code`` (0 if unknown)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or 0
    return code.co_firstlineno


def site_text(code: CodeType | None, offset: int) -> str:
    """``path:line in function`` (the form :func:`commgroups.util.call_sites.call_site` prints)
    of instruction ``offset`` in ``code``."""
    if code is None:
        return "<unknown>"
    return f"{code.co_filename}:{line_of(code, offset)} in {code.co_name}"


def tensor_facts(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, torch.Tensor | None]:
    """Shapes of the tensor arguments (lists: their first few), the first dtype, the first tensor."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):  # all_reduce, broadcast: most calls
        tensor = args[0]
        return (tensor.shape,), tensor.dtype, tensor
    shapes: list[Any] = []
    first: torch.Tensor | None = None
    for arg in args:
        if isinstance(arg, torch.Tensor):
            shapes.append(arg.shape)
            if first is None:
                first = arg
        elif isinstance(arg, (list, tuple)):
            for item in arg[:_MAX_LISTED]:
                if isinstance(item, torch.Tensor):
                    shapes.append(item.shape)
                    if first is None:
                        first = item
    return tuple(shapes), (first.dtype if first is not None else None), first


def caller_stream(tensor: torch.Tensor | None) -> str:
    """Where a blocking call on ``tensor`` runs under NCCL/RCCL's rule: the caller's current
    stream (``cuda:0/stream:7``) for a CUDA tensor, else the device type (``cpu``)."""
    if tensor is None:
        return "cpu"
    if tensor.is_cuda:
        return f"{tensor.device}/stream:{torch.cuda.current_stream(tensor.device).stream_id}"
    return str(tensor.device.type)


class FlightEntry:
    """One collective as this rank issued it on a role.

    Attributes:
        op: the torch.distributed function's name (``all_reduce``, ``all_gather_object``, ...).
        seq: this role's recorded calls so far, from 1.
        group_seq: the group's own collective count after the call was issued (torch counts every
            call on the group, plain and functional ones too), or None where the backend keeps none.
        shapes, dtype: the tensor arguments' shapes and the first one's dtype.
        async_op: the flag as issued to torch (True under async-and-wait).
        caller_async: what the caller asked for.
        stream: where the call runs under NCCL/RCCL's rule: ``cpu``, the caller's stream
            (``cuda:0/stream:7``) for a blocking call, ``group:<name>`` for an async one.
        start_ns, end_ns: ``time.monotonic_ns()`` at issue and when it returned (0: in flight).
        error: the first line of the failure, if it failed.
    """

    __slots__ = ("async_op", "caller_async", "code", "dtype", "end_ns", "error", "group_seq",
                 "offset", "op", "seq", "shapes", "start_ns", "stream")

    def __init__(self, op: str, seq: int, group_seq: int | None, shapes: tuple[Any, ...],
                 dtype: Any, async_op: bool, caller_async: bool, stream: str,
                 code: CodeType | None, offset: int) -> None:
        self.op = op
        self.seq = seq
        self.group_seq = group_seq
        self.shapes = shapes
        self.dtype = dtype
        self.async_op = async_op
        self.caller_async = caller_async
        self.stream = stream
        self.code = code
        self.offset = offset
        self.error = ""
        self.end_ns = 0
        self.start_ns = time.monotonic_ns()

    @property
    def caller(self) -> str:
        """``path:line in function`` of the first frame outside torch and commgroups."""
        return site_text(self.code, self.offset)

    @property
    def state(self) -> str:
        """``in flight``, ``done`` or ``failed``."""
        return "failed" if self.error else ("done" if self.end_ns else "in flight")

    def to_dict(self, wall_offset_ns: int = 0) -> dict[str, Any]:
        """JSON-ready data; times become wall-clock seconds given ``time_ns() - monotonic_ns()``."""
        return {
            "op": self.op, "seq": self.seq, "group_seq": self.group_seq,
            "shapes": [list(shape) for shape in self.shapes],
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "async_op": self.async_op, "caller_async": self.caller_async, "stream": self.stream,
            "caller": self.caller, "state": self.state, "error": self.error,
            "start_s": (self.start_ns + wall_offset_ns) / 1e9,
            "end_s": (self.end_ns + wall_offset_ns) / 1e9 if self.end_ns else None,
        }
