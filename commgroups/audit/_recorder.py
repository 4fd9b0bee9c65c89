"""Recording every collective this rank issues, whoever issued it.

Observation point: a ``TorchDispatchMode`` (the mechanism of torch's own ``CommDebugMode``). Every
``torch.distributed`` collective reaches the dispatcher as a ``torch.ops.c10d.*`` op (``all_reduce``
-> ``c10d.allreduce_``, ``all_gather_into_tensor`` -> ``c10d._allgather_base_`` ...), whether it came
from our wrapper, FSDP2, DCP's object collectives, spmd_types or user code; functional collectives
arrive as ``torch.ops._c10d_functional.*``. What each observation sees:

- ``c10d.*`` ops carry the ProcessGroup and, in their schema, ``bool async_op=True``: the flag the
  caller issued (the dispatcher omits it from ``args`` when it equals the default True, so it is read
  through the schema). ``send``/``recv_``/``recv_any_source_`` have no flag (``async_op`` is None);
  ``monitored_barrier_`` is always blocking.
- ``_c10d_functional.*`` ops carry the group *name*; they always take the async path (``async_op`` is
  True). Their inner ``c10d`` calls run with the mode popped, so nothing is counted twice.
- The CUDA stream is the caller's current stream at issue time (``"cpu"`` for CPU tensors): where a
  blocking NCCL call runs. An async call runs on the group's own stream, which no public API names;
  the recorder models it as ``group:<name>`` (see :attr:`CollectiveRecord.exec_stream`).

Not seen: collectives issued on another thread (dispatch modes are thread-local: DCP ``async_save``'s
background thread), and calls made straight on a ``Backend`` object, which skip the dispatcher.
Cost: every aten op of the recorded thread passes through Python while recording; fine for a debug
run, not for production throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import typing_extensions
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import commgroups

if TYPE_CHECKING:
    from commgroups.audit._analysis import Hazard

__all__ = [
    "AUDIT_DIR_ENV",
    "FILE_FORMAT",
    "P2P_OPS",
    "CollectiveRecord",
    "Recorder",
    "from_env",
    "record",
    "rank_file_name",
]

logger = logging.getLogger(__name__)

AUDIT_DIR_ENV = "COMMGROUPS_AUDIT_DIR"
FILE_FORMAT = "commgroups-audit/1"

# Namespaces whose ops are collectives (c10d_functional is the legacy Python functional API).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd",
                                    "c10d_functional"})
# Ops in those namespaces that move no data between ranks.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "wait"})
# Point-to-point ops: no async flag, and not part of a group's collective sequence.
P2P_OPS = frozenset({"c10d.send", "c10d.recv_", "c10d.recv_any_source_"})


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    ``async_op`` is the flag as issued (None for point-to-point ops, which carry none); ``stream`` is
    the caller's current CUDA stream id at issue time, or ``"cpu"``; ``exec_stream`` is where the
    call executes under ProcessGroupNCCL's rule (blocking: the caller's stream; async: the group's
    own stream, ``group:<name>``). ``group_seq`` counts this rank's recorded calls on the group from 1.
    ``caller`` is the first frame outside torch and commgroups (``path:line in function``), also
    skipping decorator plumbing (typing_extensions, contextlib, functools).
    """

    index: int
    op: str
    group: str
    group_seq: int
    roles: tuple[str, ...]
    async_op: bool | None
    stream: int | str
    device: str
    exec_stream: str | None
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    caller: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = dataclasses.asdict(self)
        data["roles"] = list(self.roles)
        data["shapes"] = [list(s) for s in self.shapes]
        data["dtypes"] = list(self.dtypes)
        return data


@dataclasses.dataclass
class _GroupInfo:
    ranks: list[int] | None
    backend: str | None
    default: bool


def _skip_prefixes() -> tuple[str, ...]:
    roots = {os.path.dirname(torch.__file__), os.path.dirname(commgroups.__file__)}
    # commgroups/backends is a symlink to ../backends: frames there carry the real path.
    roots |= {os.path.realpath(root) for root in roots}
    roots.add(os.path.realpath(os.path.join(os.path.dirname(commgroups.__file__), "backends")))
    prefixes = [root.rstrip(os.sep) + os.sep for root in roots]
    # Decorator plumbing between torch and its caller (typing_extensions.deprecated wraps
    # all_gather_into_tensor in torch 2.13) is nobody's call site: skip those files too.
    prefixes += [os.path.splitext(module.__file__ or "")[0] for module in
                 (typing_extensions, contextlib, functools) if module.__file__]
    return tuple(prefixes)


def _resolve_roles(roles: Any) -> dict[str, dist.ProcessGroup]:
    """role -> this rank's group, from a GroupRegistry or a mapping (None values are skipped)."""
    if roles is None:
        return {}
    if isinstance(roles, Mapping):
        resolved: dict[str, dist.ProcessGroup] = {}
        for role, group in roles.items():
            if group is None:
                continue
            if not isinstance(group, dist.ProcessGroup):
                raise TypeError(
                    f"audit roles: {role!r} maps to {type(group).__name__}, not a ProcessGroup; "
                    "fix: pass {role: mesh.get_group(dim)} or a GroupRegistry"
                )
            resolved[str(role)] = group
        return resolved
    from commgroups.errors import NotAMemberError
    from commgroups.registry import GroupRegistry

    if not isinstance(roles, GroupRegistry):
        raise TypeError(
            f"audit roles: expected a GroupRegistry or a mapping role -> ProcessGroup, got "
            f"{type(roles).__name__}"
        )
    if not roles.created:
        raise ValueError(
            "audit roles: the GroupRegistry has no groups yet; fix: call registry.create() on "
            "every rank before recording"
        )
    resolved = {}
    for role in roles.role_names:
        try:
            resolved[role] = roles.group(role)
        except NotAMemberError:
            continue  # this rank is in no group of the role: nothing to map
    return resolved


class Recorder:
    """The collectives recorded on this rank, with what is needed to name hazards.

    Made by :func:`record`; ``roles`` (a :class:`~commgroups.GroupRegistry`, or a mapping role ->
    ProcessGroup for groups built another way, e.g. ``{"cp": mesh.get_group("cp")}``) names each
    group's role(s) and lets the analysis tell when the default group does a role's work.
    """

    def __init__(self, roles: Any = None) -> None:
        self.records: list[CollectiveRecord] = []
        self._role_groups = _resolve_roles(roles)
        self._groups: dict[str, _GroupInfo] = {}
        self._group_seq: dict[str, int] = {}
        self._skip = _skip_prefixes()
        # The demo is a user of commgroups: its frames are call sites, not plumbing.
        self._keep = os.path.join(os.path.dirname(commgroups.__file__), "demo") + os.sep
        self._roles_by_group: dict[str, list[str]] = {}
        for role, group in self._role_groups.items():
            self._roles_by_group.setdefault(group.group_name, []).append(role)
            self._group_info(group)

    # ---------------------------------------------------------------------------- observation
    def _group_info(self, group: dist.ProcessGroup) -> _GroupInfo:
        name = group.group_name
        if name not in self._groups:
            try:
                ranks: list[int] | None = [int(r) for r in dist.get_process_group_ranks(group)]
            except (RuntimeError, ValueError, KeyError):
                ranks = None  # a group c10d does not track (made outside new_group)
            try:
                backend: str | None = str(dist.get_backend(group))
            except (RuntimeError, ValueError, KeyError):
                backend = None
            default = dist.is_initialized() and group is c10d._get_default_group()
            self._groups[name] = _GroupInfo(ranks, backend, default)
        return self._groups[name]

    def _caller(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not filename.startswith(self._skip) or filename.startswith(self._keep):
                return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back  # type: ignore[assignment]
        return "<unknown>"

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record one dispatcher call if it is a collective (called by the dispatch mode)."""
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace not in _COLLECTIVE_NAMESPACES or name in _NOT_COLLECTIVES:
            return
        values: dict[str, Any] = {}
        for position, argument in enumerate(func._schema.arguments):
            if position < len(args):
                values[argument.name] = args[position]
            elif argument.name in kwargs:
                values[argument.name] = kwargs[argument.name]
            elif argument.has_default_value():
                values[argument.name] = argument.default_value
        group: dist.ProcessGroup | None = None
        if "process_group" in values:
            group = dist.ProcessGroup.unbox(values["process_group"])
        elif "group_name" in values:
            # Functional collectives name their group; c10d's registry of names resolves it.
            group = c10d._resolve_process_group(  # type: ignore[attr-defined]
                values["group_name"])
        if group is None:
            return  # not a collective on a group (nothing we know how to attribute)
        op = f"{namespace}.{name}"
        if namespace == "c10d":
            async_op: bool | None = bool(values["async_op"]) if "async_op" in values else None
            if name == "monitored_barrier_":
                async_op = False
        else:
            async_op = True  # functional collectives always take the async path
        tensors = [leaf for leaf in tree_leaves(list(args) + list(kwargs.values()))
                   if isinstance(leaf, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        stream: int | str = "cpu"
        if device.type == "cuda":
            stream = int(torch.cuda.current_stream(device).stream_id)
        self._group_info(group)  # cache ranks/backend while the group is alive
        group_name = group.group_name
        if async_op is None:
            exec_stream = None
        elif async_op:
            exec_stream = f"group:{group_name}"
        else:
            exec_stream = f"{device}/stream:{stream}" if device.type == "cuda" else str(device)
        self._group_seq[group_name] = self._group_seq.get(group_name, 0) + 1
        roles = tuple(self._roles_by_group.get(group_name, ()))
        self.records.append(CollectiveRecord(
            index=len(self.records),
            op=op,
            group=group_name,
            group_seq=self._group_seq[group_name],
            roles=roles,
            async_op=async_op,
            stream=stream,
            device=str(device),
            exec_stream=exec_stream,
            shapes=tuple(tuple(int(d) for d in t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors),
            caller=self._caller(),
        ))
        logger.debug("audit: %s on group %s async_op=%s", op, group_name, async_op)

    # ------------------------------------------------------------------------------- results
    def to_dict(self) -> dict[str, Any]:
        """This rank's recording as a JSON-ready dict (the per-rank file's content)."""
        initialized = dist.is_available() and dist.is_initialized()
        default = c10d._get_default_group().group_name if initialized else None
        role_ranks: dict[str, list[int] | None] = {}
        for role, group in self._role_groups.items():
            role_ranks[role] = self._group_info(group).ranks
        return {
            "format": FILE_FORMAT,
            "rank": dist.get_rank() if initialized else int(os.environ.get("RANK", "0")),
            "world_size": dist.get_world_size() if initialized else None,
            "default_group": default,
            "groups": {
                name: {"ranks": info.ranks, "backend": info.backend,
                       "default": info.default or name == default,
                       "roles": self._roles_by_group.get(name, [])}
                for name, info in self._groups.items()
            },
            "roles": {role: group.group_name for role, group in self._role_groups.items()},
            "role_ranks": role_ranks,
            "records": [r.to_dict() for r in self.records],
        }

    def hazards(self) -> list[Hazard]:
        """Hazards visible from this rank alone (aliasing, mixed streams); see ``find_hazards``."""
        from commgroups.audit._analysis import find_hazards

        return find_hazards([self.to_dict()])

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's file into ``directory`` (created if missing); returns its path."""
        data = self.to_dict()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        target = path / rank_file_name(int(data["rank"]))
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(target)  # a merge running meanwhile never reads half a file
        return target


def rank_file_name(rank: int) -> str:
    """The per-rank file name: ``rank00003.json``."""
    return f"rank{rank:05d}.json"


class _AuditMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Passes every op through unchanged, telling the recorder about collectives."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            try:
                self.recorder.observe(func, tuple(args), kwargs)
            except Exception:  # the audit must never break the job it watches
                logger.warning("audit: could not record %s", func, exc_info=True)
        return func(*args, **kwargs)


@contextmanager
def record(roles: Any = None) -> Iterator[Recorder]:
    """Record every collective this thread issues inside the block; yields the :class:`Recorder`.

    ``roles``: a created :class:`~commgroups.GroupRegistry`, or a mapping role -> ProcessGroup (for
    groups built another way, e.g. ``{"cp": mesh.get_group("cp")}``), so records and hazards name
    roles. Start and stop recording at the same point of the program on every rank, or the
    cross-rank sequence check compares different stretches. Nested ``record()`` blocks each see every
    call. See the module docstring for what the observation point sees and misses::

        with cg.audit.record(registry) as rec:
            train_step()
        for hazard in rec.hazards():
            print(hazard.message)
    """
    recorder = Recorder(roles)
    with _AuditMode(recorder):
        yield recorder


@contextmanager
def from_env(roles: Any = None, *,
             environ: Mapping[str, str] | None = None) -> Iterator[Recorder | None]:
    """Record the block when ``COMMGROUPS_AUDIT_DIR`` is set, writing this rank's file on exit.

    The switch for whole runs: wrap the training loop in it and launch with
    ``COMMGROUPS_AUDIT_DIR=/path``; each rank writes ``rank<NNNNN>.json`` there (also when the block
    raises), and ``commgroups audit /path`` merges them. Unset or empty: records nothing, yields None.
    The variable is only read (``environ`` defaults to ``os.environ``), never written.
    """
    directory = (os.environ if environ is None else environ).get(AUDIT_DIR_ENV, "")
    if not directory:
        yield None
        return
    with record(roles) as recorder:
        try:
            yield recorder
        finally:
            path = recorder.write(directory)
            logger.info("audit: wrote %d records to %s", len(recorder.records), path)
