"""``registry.collectives(role)``: the torch.distributed collective API bound to one role's group.

Every method has torch.distributed's signature without ``group=``. With the role's ``async_and_wait`` on
(the default) each call is issued ``async_op=True`` and waited at once, so on NCCL/RCCL it runs on the
group's own stream behind a fence instead of unfenced on the caller's stream (see
:mod:`commgroups.collectives.async_wait`); a caller that asks for ``async_op=True`` gets the Work
back unwaited.
Object collectives (``all_gather_object`` ...) pass through to torch, run inside
:func:`~commgroups.collectives.async_wait.async_and_wait_scope` so that the tensor collectives
torch issues for them
follow the same rule. With ``async_and_wait=False`` every call goes to torch exactly as given.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.collectives.async_wait import (
    InterruptWatch,
    async_and_wait_scope,
    issue_and_wait,
    p2p_issuer,
    scope_original,
    source_rank,
)
from commgroups.errors import (
    ConcurrentRoleUseError,
    RegistryClosedError,
    RoleCollectiveError,
    RoleTimeoutError,
    StaleGenerationError,
)
from commgroups.flight_recorder.entries import FlightEntry
from commgroups.flight_recorder.recorder import RoleRecorder
from commgroups.util.error_text import backend_words, first_fitting

__all__ = ["RoleCollectives"]


def _caller_site(frame: Any) -> str:
    """``file:line`` of the first frame outside commgroups and torch, from ``frame`` outwards."""
    from commgroups.util.call_sites import call_site  # the slow paths only

    return call_site(frame)


def _short_site(site: str) -> str:
    """A call site (``path:line in function``) with its path cut to the last two parts."""
    path, colon, rest = site.partition(":")
    while rest and not rest.split(" ", 1)[0].isdigit():  # a ':' inside the path (Windows drives)
        more, colon, rest = rest.partition(":")
        path = f"{path}:{more}"
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + colon + rest if colon else site


def _thread_name(thread: threading.Thread, width: int = 40) -> str:
    name = thread.name
    return repr(name if len(name) <= width else name[: width - 3] + "...")

logger = logging.getLogger(__name__)

Work = Any  # torch.distributed.Work; torch's stubs type the async returns loosely
ReduceOp = Any  # dist.ReduceOp or dist.ReduceOp.RedOpType, as torch.distributed accepts


class RoleCollectives:
    """torch.distributed collectives on one role's dedicated group, async-and-wait by default.

    Made by :meth:`commgroups.GroupRegistry.collectives`; usable on any ProcessGroup::

        cp = registry.collectives("cp")
        cp.all_gather_into_tensor(out, x)            # issued async_op=True, waited at once
        work = cp.all_reduce(t, async_op=True)       # the caller's Work, unwaited
        peers = cp.p2p_op(dist.isend, t, peer=1)     # P2POp bound to this group

    Args:
        group: the process group every call runs on.
        role: the role's name (for messages and logs).
        async_and_wait: issue every call ``async_op=True`` and wait at once (off: pass calls through).
        owner: the one thread allowed to issue (see :meth:`adopt`); default: the calling thread.
            The registry passes the thread that ran ``create()``.
        owner_site: where ``owner`` took the role (``file:line``), for the error naming it.
    """

    def __init__(self, group: dist.ProcessGroup, *, role: str, async_and_wait: bool,
                 owner: threading.Thread | None = None, owner_site: str = "",
                 flight: RoleRecorder | None = None, watch: InterruptWatch | None = None,
                 losses: Callable[[dist.ProcessGroup], str | None] | None = None) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"RoleCollectives for role {role!r} needs a ProcessGroup, got "
                f"{type(group).__name__}; fix: pass registry.group({role!r})"
            )
        self.group = group
        self.role = role
        self.async_and_wait = async_and_wait
        self.calls = 0
        """How many calls this object has issued: the sequence number errors name."""
        # The one thread allowed to issue (see _enter), and where it took the role.
        self._owner_thread = owner if owner is not None else threading.current_thread()
        self._owner = self._owner_thread.ident
        self._owner_site = owner_site if owner is not None else _caller_site(sys._getframe(1))
        self._claim_lock = threading.Lock()
        self._closed: str | None = None
        self._retired_generation: int | None = None
        self.flight = flight
        """The role's flight recorder (None: off); every call is recorded in it."""
        # Set for gloo groups, whose wait() blocks this thread: it watches for interruption.
        self._interrupt = None if watch is None else (group, watch)
        self._losses = losses  # the loss reports covering the group, in words (or None)

    def close(self, reason: str) -> None:
        """Refuse every later call with :class:`RegistryClosedError` saying ``reason``.

        The registry calls it on ``close()``: a handle kept past it would otherwise keep issuing on a
        destroyed group.
        """
        self._closed = reason

    def retire(self, generation: int) -> None:
        """Refuse every later call with :class:`StaleGenerationError`: ``registry.rebuild()``
        retired generation ``generation``, whose group holds a lost rank."""
        self._retired_generation = generation

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed is not None

    def adopt(self) -> None:
        """Make the calling thread this role's issuing thread (see :meth:`_enter`).

        For calls that move to another thread in an order that is the same on every rank: a
        communication thread taking over, or autograd's backward on CUDA (a device thread runs
        custom Functions' backward) calling ``adopt()`` before its collectives.
        """
        with self._claim_lock:
            self._owner = threading.get_ident()
            self._owner_thread = threading.current_thread()
            self._owner_site = _caller_site(sys._getframe(1))

    def _enter(self, op: str) -> None:
        """Refuse the call when the handle is closed or comes from a thread that does not own it.

        Ranks pair a group's collectives by issue order; two threads issuing on one role
        interleave differently on each rank and silently meet other calls' data (wrong sums, no
        error). Neither serialising them nor letting the first one win helps: which thread comes
        first differs between ranks. So the owner is decided by program order, the same on every
        rank: the thread that created the registry (or the handle), until a thread calls
        :meth:`adopt`. Costs one thread-id comparison per call.
        """
        if self._closed is not None:
            raise RegistryClosedError(
                f"role {self.role!r}: {op} on a RoleCollectives of a closed registry "
                f"({self._closed}); fix: take a new handle, registry.collectives({self.role!r}), "
                "from a created registry"
            )
        if self._retired_generation is not None:
            raise StaleGenerationError(
                f"role {self.role!r}: {op} on generation {self._retired_generation}'s group, "
                "which registry.rebuild() retired (it holds a lost rank); fix: take a new handle, "
                f"registry.collectives({self.role!r}), after the rebuild",
                role=self.role, generation=self._retired_generation,
            )
        if self._owner != threading.get_ident():
            raise self._refusal(op, sys._getframe(1))

    def _refusal(self, op: str, frame: Any) -> ConcurrentRoleUseError:
        # Why a second thread is refused (ranks pair calls by issue order): the guide, 'Threads'.
        owner = self._owner_thread
        here, there = _caller_site(frame), self._owner_site

        def text(site: Callable[[str], str]) -> str:
            return (f"role {self.role!r}: {op} from thread {_thread_name(threading.current_thread())} "
                    f"({site(here)}), but thread {_thread_name(owner)}"
                    f"{' (alive)' if owner.is_alive() else ' (ended)'} owns its calls"
                    + (f" since {site(there)}" if there else "")
                    + "; fix: one thread per role, or adopt() first, in the same order on every rank")

        return ConcurrentRoleUseError(
            first_fitting(text(_short_site), text(lambda s: _short_site(s).split(" in ")[0])),
            role=self.role, op=op,
        )

    def __repr__(self) -> str:
        return (f"RoleCollectives(role={self.role!r}, group={self.group.group_name!r}, "
                f"size={self.size}, async_and_wait={self.async_and_wait})")

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return int(self.group.size())

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return int(self.group.rank())

    # ------------------------------------------------------------------------------- the rule
    def _failure(self, op: str, seq: int, error: RuntimeError,
                 entry: FlightEntry | None = None) -> RoleCollectiveError:
        """The error naming the role, op and sequence number for a failed call (with the flight
        recorder on: the ranks behind, ahead and mismatched, from their published status)."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        cls = RoleTimeoutError if timed_out else RoleCollectiveError
        what = "timed out" if timed_out else "failed"
        failure = cls(
            f"role {self.role!r}: {op} #{seq} on group {self.group.group_name!r} {what}: {text}"
            f"; fix: check that every rank of the role is alive and issues the same "
            f"collectives in the same order"
            + (", or raise the role's timeout_s" if timed_out else ""),
            role=self.role, op=op, seq=seq, cause=text,
        )
        if self.flight is not None:
            if entry is not None:
                self.flight.end(entry, error)
            if self.flight.diagnose is not None:
                failure = self.flight.diagnose(failure, entry)
        # After the diagnosis, which a loss report ends early: the report says why.
        lost = self._losses(self.group) if self._losses is not None else None
        if lost is None:
            return failure
        head = (f"role {self.role!r}: {op} #{seq} on group {self.group.group_name!r} was "
                f"interrupted: {lost}; fix: call registry.rebuild() on every survivor")
        return RoleCollectiveError(
            first_fitting(f"{head} (the backend: {backend_words(failure.cause or text, 100)})",
                          head),
            role=self.role, op=op, seq=seq, cause=failure.cause, flight=failure.flight)

    @contextmanager
    def _named(self, op: str) -> Iterator[None]:
        """Number the call and turn a failure into an error naming the role, op and sequence."""
        self._enter(op)
        self.calls += 1
        seq = self.calls
        flight = self.flight
        entry = (flight.start(op, (), self.async_and_wait, False, sys._getframe(1))
                 if flight is not None else None)
        try:
            yield
        except RoleCollectiveError as error:
            # Diagnosed already (an object collective's inner calls go through the scope's
            # recorded wrappers): no second diagnosis, but this call failed too, not in flight.
            if entry is not None:
                flight.end(entry, error)  # type: ignore[union-attr]  # set with entry
            raise
        except RuntimeError as error:  # DistBackendError, DistNetworkError, gloo/NCCL timeouts
            raise self._failure(op, seq, error, entry) from error
        except BaseException as error:  # refused arguments (ValueError): no longer in flight
            if entry is not None:
                flight.end(entry, error)  # type: ignore[union-attr]  # set with entry
            raise
        if entry is not None:
            flight.end(entry)  # type: ignore[union-attr]  # set with entry

    def _issue(self, fn: Callable[..., Any], async_op: bool, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, group=self.group, **kwargs)`` with torch's return shape (Work or None)."""
        work = self._call(fn, async_op, *args, **kwargs)
        return work if async_op or not self.async_and_wait else None

    def _call(self, fn: Callable[..., Any], async_op: bool, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` on this group under the role's async-and-wait setting; returns the Work.

        Failures of calls this method waits for name the role, op and sequence number; a Work
        handed back unwaited (``async_op=True``) raises torch's own error from its ``wait()``.
        """
        # Inline rather than through _named: this is the hot path (a few microseconds per call).
        op = fn.__name__
        self._enter(op)
        # Inside async_and_wait_scope() dist.<fn> is the scope's wrapper, which records and
        # diagnoses a failure itself: issue what it wraps, under its rule (async and wait, also
        # with this role's off), so one call makes one entry and one diagnosis.
        scoped = scope_original(fn)
        if scoped is not None:
            fn = scoped
        wait = self.async_and_wait or scoped is not None
        self.calls += 1
        seq = self.calls
        flight = self.flight
        entry = (flight.start(op, args, wait or async_op, async_op, sys._getframe(1))
                 if flight is not None else None)
        try:
            if not wait:
                work = fn(*args, group=self.group, async_op=async_op, **kwargs)
            else:
                work = issue_and_wait(fn, *args, group=self.group, async_op=async_op,
                                      interrupt=self._interrupt, **kwargs)
        except RoleCollectiveError as error:  # diagnosed already, by a wrapper inside fn
            if entry is not None:
                flight.end(entry, error)  # type: ignore[union-attr]  # set with entry
            raise
        except RuntimeError as error:  # DistBackendError, DistNetworkError, gloo/NCCL timeouts
            raise self._failure(op, seq, error, entry) from error
        except BaseException as error:  # refused arguments (ValueError): no longer in flight
            if entry is not None:
                flight.end(entry, error)  # type: ignore[union-attr]  # set with entry
            raise
        if entry is not None:
            entry.end_ns = time.monotonic_ns()  # RoleRecorder.end, inline: the hot path
        if scoped is not None and not self.async_and_wait and not async_op:
            return None  # the blocking call's return, as the scope's wrapper gives it
        return work

    @contextmanager
    def _object_scope(self, op: str) -> Iterator[None]:
        with self._named(op), async_and_wait_scope() if self.async_and_wait else nullcontext():
            yield

    # -------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Work | None:
        """``torch.distributed.all_reduce`` on this role's group."""
        return self._issue(dist.all_reduce, async_op, tensor, op=op)

    def broadcast(self, tensor: torch.Tensor, src: int | None = None, async_op: bool = False,
                  group_src: int | None = None) -> Work | None:
        """``torch.distributed.broadcast``; ``src`` is a global rank, ``group_src`` a group rank."""
        return self._issue(dist.broadcast, async_op, tensor, src=src, group_src=group_src)

    def reduce(self, tensor: torch.Tensor, dst: int | None = None,
               op: ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
               group_dst: int | None = None) -> Work | None:
        """``torch.distributed.reduce``; ``dst`` is a global rank, ``group_dst`` a group rank."""
        return self._issue(dist.reduce, async_op, tensor, dst=dst, op=op, group_dst=group_dst)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   async_op: bool = False) -> Work | None:
        """``torch.distributed.all_gather`` (into a list; tensors may have uneven sizes)."""
        return self._issue(dist.all_gather, async_op, tensor_list, tensor)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False) -> Work | None:
        """``torch.distributed.all_gather_into_tensor`` (``all_gather_single`` in torch >= 2.13)."""
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._issue(fn, async_op, output_tensor, input_tensor)

    all_gather_single = all_gather_into_tensor

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor],
                       op: ReduceOp = dist.ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """``torch.distributed.reduce_scatter`` (from a list of inputs)."""
        return self._issue(dist.reduce_scatter, async_op, output, input_list, op=op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: ReduceOp = dist.ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """``torch.distributed.reduce_scatter_tensor`` (``reduce_scatter_single`` in >= 2.13)."""
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._issue(fn, async_op, output, input, op=op)

    reduce_scatter_single = reduce_scatter_tensor

    def all_to_all(self, output_tensor_list: list[torch.Tensor],
                   input_tensor_list: list[torch.Tensor], async_op: bool = False) -> Work | None:
        """``torch.distributed.all_to_all`` (lists; chunks may have uneven sizes)."""
        return self._issue(dist.all_to_all, async_op, output_tensor_list, input_tensor_list)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """``torch.distributed.all_to_all_single``."""
        return self._issue(dist.all_to_all_single, async_op, output, input,
                           output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
               dst: int | None = None, async_op: bool = False,
               group_dst: int | None = None) -> Work | None:
        """``torch.distributed.gather``; ``gather_list`` only on the destination."""
        return self._issue(dist.gather, async_op, tensor, gather_list=gather_list, dst=dst,
                           group_dst=group_dst)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
                src: int | None = None, async_op: bool = False,
                group_src: int | None = None) -> Work | None:
        """``torch.distributed.scatter``; ``scatter_list`` only on the source."""
        return self._issue(dist.scatter, async_op, tensor, scatter_list=scatter_list, src=src,
                           group_src=group_src)

    def barrier(self, async_op: bool = False, device_ids: list[int] | None = None,
                timeout: timedelta | None = None) -> Work | None:
        """``torch.distributed.barrier`` on this role's group."""
        # torch 2.10's barrier has no timeout parameter: pass it only when given.
        extra = {} if timeout is None else {"timeout": timeout}
        return self._issue(dist.barrier, async_op, device_ids=device_ids, **extra)

    # ------------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int | None = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        """``torch.distributed.send``: with async-and-wait, ``isend`` waited at once."""
        if not self.async_and_wait:
            with self._named("send"):
                dist.send(tensor, dst=dst, group=self.group, tag=tag, group_dst=group_dst)
            return
        self._call(p2p_issuer(dist.isend), False, tensor, dst=dst, tag=tag, group_dst=group_dst)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0,
             group_src: int | None = None) -> int:
        """``torch.distributed.recv``: returns the sender's global rank (``irecv`` waited at once)."""
        if not self.async_and_wait:
            with self._named("recv"):
                return int(dist.recv(tensor, src=src, group=self.group, tag=tag,
                                     group_src=group_src))
        work = self._call(p2p_issuer(dist.irecv), False, tensor, src=src, tag=tag,
                          group_src=group_src)
        return source_rank(work, src, self.group, group_src)

    def isend(self, tensor: torch.Tensor, dst: int | None = None, tag: int = 0,
              group_dst: int | None = None) -> Work | None:
        """``torch.distributed.isend``: the caller's Work, unwaited."""
        self._enter("isend")
        return dist.isend(tensor, dst=dst, group=self.group, tag=tag, group_dst=group_dst)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0,
              group_src: int | None = None) -> Work | None:
        """``torch.distributed.irecv``: the caller's Work, unwaited."""
        self._enter("irecv")
        return dist.irecv(tensor, src=src, group=self.group, tag=tag, group_src=group_src)

    def p2p_op(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,
               tag: int = 0, group_peer: int | None = None) -> dist.P2POp:
        """A ``torch.distributed.P2POp`` bound to this role's group, for :meth:`batch_isend_irecv`."""
        return dist.P2POp(op, tensor, peer, self.group, tag, group_peer)

    def batch_isend_irecv(self, p2p_op_list: list[dist.P2POp]) -> list[Work]:
        """``torch.distributed.batch_isend_irecv``; every op must be on this role's group.

        Returns the Works unwaited, like torch (the call is asynchronous by definition).
        """
        for index, p2p in enumerate(p2p_op_list):
            if p2p.group is not self.group:
                default = torch_internals.default_group()
                where = ("the default group" if p2p.group is None or p2p.group is default
                         else f"group {getattr(p2p.group, 'group_name', p2p.group)!r}")
                raise ValueError(
                    f"batch_isend_irecv on role {self.role!r}: op {index} is on {where}, not this "
                    f"role's group; fix: build it with registry.collectives({self.role!r}).p2p_op(...)"
                )
        self._enter("batch_isend_irecv")
        return list(dist.batch_isend_irecv(p2p_op_list))


    # --------------------------------------------------------------------- object collectives
    def all_gather_object(self, object_list: list[Any], obj: Any) -> None:
        """``torch.distributed.all_gather_object`` on this role's group."""
        with self._object_scope("all_gather_object"):
            dist.all_gather_object(object_list, obj, group=self.group)

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None,
                      dst: int | None = None, group_dst: int | None = None) -> None:
        """``torch.distributed.gather_object`` on this role's group."""
        with self._object_scope("gather_object"):
            dist.gather_object(obj, object_gather_list, dst=dst, group=self.group,
                               group_dst=group_dst)

    def broadcast_object_list(self, object_list: list[Any], src: int | None = None,
                              device: torch.device | None = None,
                              group_src: int | None = None) -> None:
        """``torch.distributed.broadcast_object_list`` on this role's group."""
        with self._object_scope("broadcast_object_list"):
            dist.broadcast_object_list(object_list, src=src, group=self.group, device=device,
                                       group_src=group_src)

    def scatter_object_list(self, scatter_object_output_list: list[Any],
                            scatter_object_input_list: list[Any] | None = None,
                            src: int | None = None, group_src: int | None = None) -> None:
        """``torch.distributed.scatter_object_list`` on this role's group."""
        with self._object_scope("scatter_object_list"):
            dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list,
                                     src=src, group=self.group, group_src=group_src)

    def send_object_list(self, object_list: list[Any], dst: int | None = None,
                         device: torch.device | None = None,
                         group_dst: int | None = None) -> None:
        """``torch.distributed.send_object_list`` on this role's group."""
        with self._object_scope("send_object_list"):
            dist.send_object_list(object_list, dst=dst, group=self.group, device=device,
                                  group_dst=group_dst)

    def recv_object_list(self, object_list: list[Any], src: int | None = None,
                         device: torch.device | None = None,
                         group_src: int | None = None) -> int:
        """``torch.distributed.recv_object_list`` on this role's group; returns the sender rank."""
        with self._object_scope("recv_object_list"):
            return int(dist.recv_object_list(object_list, src=src, group=self.group,
                                             device=device, group_src=group_src))
