"""Async-and-wait: issue every collective ``async_op=True`` and wait on it at once.

Why: since torch 2.8, ProcessGroupNCCL runs a *blocking* collective (``async_op=False``) on the caller's
current CUDA stream with no fence, while an ``async_op=True`` one runs on the group's own stream after
waiting on the caller's. Code that mixes both on one communicator (spmd_types' blocking CP collectives
next to FSDP2's async ones) drives one NCCL/RCCL communicator from two streams with nothing ordering
them, and ranks deadlock. Issuing everything async and waiting at once keeps one ordered stream per
communicator; ``work.wait()`` only makes the current stream wait (the host is not blocked on NCCL), so
it costs nothing. On gloo ``wait()`` blocks the calling thread: async-and-wait equals a blocking call.

Three ways to apply the rule:

- :class:`commgroups.collectives.role_collectives.RoleCollectives` (``registry.collectives(role)``)
for our own calls;
- :class:`AsyncWaitDist`, a module-like stand-in for ``torch.distributed`` for libraries that accept a
  dist module (``spmd_types.set_dist(cg.AsyncWaitDist())``);
- :func:`async_and_wait_scope`, a scope that patches ``torch.distributed``'s collective entry points for
  libraries that call ``torch.distributed`` directly.

A caller that explicitly asks for ``async_op=True`` always gets its Work back unwaited.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from commgroups import torch_internals
from commgroups.errors import RoleCollectiveError
from commgroups.flight_recorder import index as flight_index

__all__ = [
    "ASYNC_OP_FUNCTIONS",
    "BLOCKING_P2P_FUNCTIONS",
    "AsyncWaitDist",
    "async_and_wait_scope",
    "ABANDON_AFTER_S",
    "InterruptWatch",
    "WAIT_SLICE_S",
    "issue_and_wait",
    "issue_and_wait_on",
    "p2p_issuer",
    "scope_original",
    "source_rank",
    "wait_unless_interrupted",
    "wrap_async_wait",
]

logger = logging.getLogger(__name__)

# torch.distributed functions with an ``async_op`` parameter. Names missing from the installed torch
# (all_gather_single and reduce_scatter_single appeared in 2.13) are skipped.
ASYNC_OP_FUNCTIONS: tuple[str, ...] = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)

# Blocking point-to-point calls and the non-blocking call each one is rebuilt from.
BLOCKING_P2P_FUNCTIONS: tuple[tuple[str, str], ...] = (("send", "isend"), ("recv", "irecv"))

# Marks our wrappers, so nothing is wrapped twice and restore can tell ours from someone else's.
_MARK = "__commgroups_async_wait__"
# On wrap_async_wait's wrappers only: the collective (with an async_op parameter) they issue.
_ORIGINAL = "__commgroups_async_wait_original__"
# The process-wide patch state lives on the module it patches (see _PatchState).
_STATE_ATTR = "__commgroups_async_wait_state__"


def issue_and_wait(
    fn: Callable[..., Any], /, *args: Any, async_op: bool = False,
    interrupt: tuple[Any, InterruptWatch] | None = None, **kwargs: Any
) -> Any:
    """The async-and-wait rule, the one place it is written: every commgroups path calls this.

    Issues ``fn(*args, async_op=True, **kwargs)`` and, unless the caller itself asked for
    ``async_op=True``, waits on the returned Work at once (on NCCL the current stream waits; the host
    does not block). Callers that present a blocking API return None themselves, as torch does.

    Args:
        fn: a torch.distributed collective with an ``async_op`` parameter (or :func:`p2p_issuer`).
        args, kwargs: ``fn``'s own arguments, without ``async_op``.
        async_op: what the caller asked for: True hands the Work back unwaited.
        interrupt: ``(group, watch)`` for a call on a registry's gloo group: the wait runs in
            slices and gives up once the group's generation is interrupted
            (:func:`wait_unless_interrupted`).

    Returns:
        The Work (already waited unless ``async_op``), or None when this rank is not in the group.

    Example::

        issue_and_wait(dist.all_reduce, t, group=cp_group)          # async_op=True, waited
        work = issue_and_wait(dist.all_reduce, t, group=cp_group, async_op=True)  # not waited
    """
    work = fn(*args, async_op=True, **kwargs)
    if work is not None and not async_op:
        if interrupt is None:
            work.wait()
        else:
            wait_unless_interrupted(work, *interrupt)
    return work


WAIT_SLICE_S = 0.25
"""How often a wait on a gloo group looks at whether its generation was interrupted."""

ABANDON_AFTER_S = 1.0
"""How long a call may outlive its generation's interruption before it is abandoned: the sever
ends the others within milliseconds, a loaded host's threads within a fraction of this."""


class InterruptWatch(Protocol):
    """What a call on a registry's gloo group asks of the generation the group belongs to (its
    :class:`~commgroups.generation.Generation`): whether a loss report interrupted it, and where
    to leave a call that its interruption did not end."""

    interrupted: bool

    def abandon(self, group: Any, work: Any) -> None:
        """Keep ``work``, still running on ``group``, from blocking the group's destruction."""


def wait_unless_interrupted(work: Any, group: Any, watch: InterruptWatch) -> None:
    """Wait for ``work`` on ``group`` (gloo); once ``watch`` says interrupted, a second more.

    A loss report severs the generation's gloo sockets, and the calls blocked on them fail
    within milliseconds. Not every one: when every rank calls rebuild() right after an
    all_reduce, gloo leaves one rank's call waiting for its whole role timeout in 20 to 50
    rebuilds (2.13, 4 ranks: 60 s at 60 s timeouts), although every socket of its group is shut.
    Such a call is left to the generation (it keeps the group until the call ends: destroying
    it would wait as long) and fails here with a RuntimeError, so the caller goes on to rebuild().
    """
    seen: float | None = None  # when this wait first saw the interruption
    while not torch_internals.wait_slice(work, WAIT_SLICE_S):
        if not watch.interrupted:
            continue
        now = time.monotonic()
        if seen is None:
            seen = now
        elif now - seen >= ABANDON_AFTER_S:
            watch.abandon(group, work)
            raise RuntimeError(
                "interrupted: a rank-loss report ended this generation while the call "
                f"waited, and it did not end within {ABANDON_AFTER_S:g} s of that")


def issue_and_wait_on(group: Any, fn: Callable[..., Any], /, *args: Any, async_op: bool = False,
                      flight_op: str | None = None, **kwargs: Any) -> Any:
    """:func:`issue_and_wait` of a call on ``group`` (also among ``args``/``kwargs``), recorded
    in the flight recorder when ``group`` is a recorded registry group.

    For paths that reach commgroups with a group but no ``registry.collectives`` handle: the
    async-and-wait wrappers of torch.distributed (the scope, :class:`AsyncWaitDist`) and FSDP2's
    comms; ``flight_op`` names the op in the recorder (default: ``fn``'s name). A recorded call
    that times out raises the diagnosed
    :class:`~commgroups.errors.RoleHangError` (from torch's error); other failures keep torch's.
    """
    recorder = flight_index.lookup(group)
    if recorder is None:
        return issue_and_wait(fn, *args, async_op=async_op, **kwargs)
    entry = recorder.start(flight_op or str(getattr(fn, "__name__", "collective")), args, True,
                           async_op, sys._getframe(1))
    interrupt = None if recorder.watch is None else (group, recorder.watch)
    try:
        work = issue_and_wait(fn, *args, async_op=async_op, interrupt=interrupt, **kwargs)
    except RoleCollectiveError as error:
        # Diagnosed already, by a recorded call inside ``fn`` (FSDP2's default comms call the
        # scope's wrappers): a second diagnosis would ask the group again and nest the messages.
        recorder.end(entry, error)
        raise
    except RuntimeError as error:
        failure = recorder.failure(entry, error)
        if failure is None:
            raise
        raise failure from error
    except BaseException as error:
        recorder.end(entry, error)
        raise
    entry.end_ns = time.monotonic_ns()
    return work


def p2p_issuer(nonblocking: Callable[..., Any]) -> Callable[..., Any]:
    """``isend``/``irecv`` with an ``async_op`` parameter (ignored: they are always async)."""

    def issue(*args: Any, async_op: bool = True, **kwargs: Any) -> Any:
        del async_op
        return nonblocking(*args, **kwargs)

    issue.__name__ = getattr(nonblocking, "__name__", "p2p")
    return issue


def wrap_async_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a torch.distributed collective with an ``async_op`` parameter in the async-and-wait rule.

    The wrapper calls :func:`issue_and_wait` and returns what the blocking call returns (None); when
    the caller itself passes ``async_op=True`` (by keyword or position) the Work is returned unwaited.
    Wrapping a wrapper returns it unchanged.
    """
    if getattr(fn, _MARK, False):
        return fn
    params = list(inspect.signature(fn).parameters)
    if "async_op" not in params:
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} has no async_op parameter")
    index = params.index("async_op")
    later = params[index + 1:]
    group_at = params.index("group") if "group" in params else len(params)

    @functools.wraps(fn)
    def async_wait(*args: Any, **kwargs: Any) -> Any:
        if len(args) > index:  # async_op (and maybe later parameters) given by position
            kwargs.update(zip(later, args[index + 1:]))
            kwargs["async_op"], args = args[index], args[:index]
        caller_async = bool(kwargs.pop("async_op", False))
        group = kwargs.get("group", args[group_at] if group_at < len(args) else None)
        work = issue_and_wait_on(group, fn, *args, async_op=caller_async, **kwargs)
        return work if caller_async else None

    setattr(async_wait, _MARK, True)
    setattr(async_wait, _ORIGINAL, fn)
    return async_wait


def scope_original(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The collective a :func:`wrap_async_wait` wrapper issues (it has an ``async_op``
    parameter); None when ``fn`` is not such a wrapper.

    For callers that apply the async-and-wait rule and record the call themselves
    (``registry.collectives``): inside :func:`async_and_wait_scope` they look up the scope's
    wrapper, which would record and diagnose the same call a second time.
    """
    original: Callable[..., Any] | None = getattr(fn, _ORIGINAL, None)
    return original


def _wrap_send(isend: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    issue = p2p_issuer(isend)

    @functools.wraps(original)
    def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        issue_and_wait_on(group, issue, tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    setattr(send, _MARK, True)
    return send


def _wrap_recv(irecv: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    issue = p2p_issuer(irecv)

    @functools.wraps(original)
    def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
             group_src: int | None = None) -> int:
        work = issue_and_wait_on(group, issue, tensor, src=src, group=group, tag=tag,
                                 group_src=group_src)
        return source_rank(work, src, group, group_src)

    setattr(recv, _MARK, True)
    return recv


def source_rank(work: Any, src: int | None, group: Any, group_src: int | None) -> int:
    """The global rank a finished irecv came from, as ``torch.distributed.recv`` returns it.

    -1 when ``work`` is None (this rank is not in the group), as torch's ``recv`` returns.
    """
    if work is None:
        return -1
    if src is not None:
        return src
    pg = group if group is not None else torch_internals.default_group()
    if group_src is None:
        group_src = torch_internals.recv_source_rank(work)
    return int(dist.get_global_rank(pg, group_src))


def _wrapped_entry(name: str, original: Callable[..., Any], base: Any) -> Callable[..., Any]:
    """The async-and-wait version of ``base.<name>`` (``original``)."""
    for blocking, nonblocking in BLOCKING_P2P_FUNCTIONS:
        if name == blocking:
            maker = _wrap_send if name == "send" else _wrap_recv
            return maker(getattr(base, nonblocking), original)
    return wrap_async_wait(original)


def _entry_names() -> tuple[str, ...]:
    return ASYNC_OP_FUNCTIONS + tuple(name for name, _ in BLOCKING_P2P_FUNCTIONS)


class AsyncWaitDist:
    """A module-like stand-in for ``torch.distributed`` that issues collectives async and waits.

    Every attribute is forwarded to the wrapped module (``torch.distributed`` by default), looked up
    at call time; the collectives with an ``async_op`` parameter (:data:`ASYNC_OP_FUNCTIONS`) and the
    blocking ``send``/``recv`` are returned wrapped: issued ``async_op=True`` (``isend``/``irecv``)
    and waited at once. A caller passing ``async_op=True`` gets the Work back unwaited. Object
    collectives, ``get_rank``, ``ReduceOp`` and the rest pass through unchanged.

    Use it with libraries that take a dist module, e.g. spmd_types (0.2.3 and 0.3.x)::

        spmd_types.set_dist(cg.AsyncWaitDist())
        ...
        spmd_types.set_dist(None)   # back to torch.distributed

    Its reach is the library that was handed it; nothing process-wide changes.
    """

    def __init__(self, base: ModuleType | Any = None) -> None:
        # object.__setattr__ keeps __getattr__ (forwarding) away from our own two fields.
        object.__setattr__(self, "_base", dist if base is None else base)
        names = frozenset(n for n in _entry_names() if hasattr(self._base, n))
        object.__setattr__(self, "_wrapped_names", names)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._base, name)
        if name in self._wrapped_names and callable(attribute):
            return _wrapped_entry(name, attribute, self._base)
        return attribute

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._base)) | set(object.__dir__(self)))

    def __repr__(self) -> str:
        return f"AsyncWaitDist(base={getattr(self._base, '__name__', self._base)!r})"


class _PatchState:
    """Process-wide bookkeeping of the :func:`async_and_wait_scope` patch.

    The patch itself is process-wide (it replaces attributes of torch.distributed), so its bookkeeping
    must be too: this object is stored on ``torch.distributed.distributed_c10d`` itself, next to what
    it patches, rather than in a module global of ours. ``depth`` counts open scopes in all threads;
    the first opens the patch and the last closes it, so nested and overlapping scopes are safe.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.originals: dict[tuple[str, str], Callable[..., Any]] = {}


def _patch_state() -> _PatchState:
    # dict.setdefault is atomic under the GIL: two threads entering at once get the same state.
    state: _PatchState = vars(c10d).setdefault(_STATE_ATTR, _PatchState())
    return state


def _patched_modules() -> tuple[ModuleType, ...]:
    # torch.distributed re-exports c10d's functions: user code looks them up on torch.distributed,
    # torch's own helpers (all_gather_object -> all_gather, send -> isend) on distributed_c10d.
    return (dist, c10d)


def _install(state: _PatchState) -> None:
    wrappers: dict[int, Callable[..., Any]] = {}  # one wrapper per original function object
    for module in _patched_modules():
        for name in _entry_names():
            original = getattr(module, name, None)
            if original is None or getattr(original, _MARK, False):
                continue
            if id(original) not in wrappers:
                wrappers[id(original)] = _wrapped_entry(name, original, c10d)
            state.originals[(module.__name__, name)] = original
            setattr(module, name, wrappers[id(original)])
    logger.debug("async_and_wait: patched %d entry points", len(state.originals))


def _restore(state: _PatchState) -> None:
    modules = {module.__name__: module for module in _patched_modules()}
    for (module_name, name), original in state.originals.items():
        module = modules[module_name]
        current = getattr(module, name, None)
        if current is not None and not getattr(current, _MARK, False):
            # Someone replaced our wrapper while the scope was open; theirs stays, and it wraps ours
            # at worst, which is still correct. Say so rather than silently undo their change.
            logger.warning(
                "async_and_wait: %s.%s was replaced inside the scope; leaving the replacement in "
                "place", module_name, name,
            )
            continue
        setattr(module, name, original)
    state.originals.clear()


@contextlib.contextmanager
def async_and_wait_scope() -> Iterator[None]:
    """A scope in which ``torch.distributed``'s collectives are issued async and waited at once.

    Inside it, ``torch.distributed.<fn>`` and ``torch.distributed.distributed_c10d.<fn>`` for every
    function in :data:`ASYNC_OP_FUNCTIONS`, plus ``send`` and ``recv``, are replaced by wrappers that
    issue ``async_op=True`` (``isend``/``irecv``) and wait at once; all are restored on exit, also
    when the body raises. Use it for libraries that call ``torch.distributed`` directly::

        with cg.async_and_wait_scope():
            loss = model(batch)        # spmd_types' blocking CP collectives become async-and-wait

    Reach (read this before using it):

    - **Process-wide, all threads**: a collective issued by any thread while any scope is open is
      wrapped. That is harmless to callers: a blocking call still returns only when done, and an
      ``async_op=True`` call still gets its Work unwaited.
    - **Covered**: calls that look the function up on ``torch.distributed`` or
      ``torch.distributed.distributed_c10d`` at call time, including torch's own object collectives
      (``all_gather_object`` etc. call ``all_gather``/``broadcast``/``gather``/``scatter`` through
      ``distributed_c10d``), spmd_types (``_dist.dist.all_reduce``), FSDP2 and DCP.
    - **Not covered**: names bound before the scope opened (``from torch.distributed import
      all_reduce``), ``ProcessGroup`` methods (``pg.allreduce``), and functional collectives
      (``torch.distributed._functional_collectives``), which always take the async path anyway.
    - Nesting and overlapping scopes (also across threads) are safe: the patch is reference-counted
      and only the last scope to close restores the originals.
    """
    state = _patch_state()
    with state.lock:
        if state.depth == 0:
            _install(state)
        state.depth += 1
    try:
        yield
    finally:
        with state.lock:
            state.depth -= 1
            if state.depth == 0:
                _restore(state)
