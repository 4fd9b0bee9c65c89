"""Recording every collective this rank issues, whoever issued it.

:func:`record` runs a ``TorchDispatchMode`` (the mechanism of torch's ``CommDebugMode``) over a
block: every ``c10d`` and functional collective the block's thread issues becomes a
:class:`~commgroups.audit.records.CollectiveRecord` (op, group, role, ``async_op``, stream, whether
DCP issued it), and each group's own collective count (gloo, NCCL) is compared at the end, so calls
it could not see are reported (``uncounted``). What it sees and misses, and why: the guide,
'Reading the audit' / 'How the recorder sees'. Debug runs only: every op of the thread passes
through Python.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.audit.hazards import Hazard, find_hazards
from commgroups.audit.records import (
    AUDIT_DIR_ENV,
    CHECKPOINT_MODULES,
    COLLECTIVE_NAMESPACES,
    FILE_FORMAT,
    NOT_COLLECTIVES,
    CollectiveRecord,
    rank_file_name,
)
from commgroups.errors import RegistryNotCreatedError
from commgroups.registry import GroupRegistry
from commgroups.torch_internals import TorchDispatchMode, tree_leaves
from commgroups.util.call_sites import call_site, inside

__all__ = ["Recorder", "from_env", "record"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _GroupInfo:
    ranks: list[int] | None
    backend: str | None
    default: bool


def _default_group() -> dist.ProcessGroup | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return torch_internals.default_group()


def _group_by_name(name: str) -> dist.ProcessGroup:
    # Functional collectives name their group; c10d's registry of names resolves it.
    return torch_internals.resolve_group_name(name)


@dataclasses.dataclass
class _Roles:
    """What the recorder knows of the roles: their groups, purposes, and the registry's groups."""

    groups: dict[str, dist.ProcessGroup]
    """role -> this rank's group."""
    purposes: dict[str, str]
    """role -> ``compute`` or ``checkpoint`` (only roles that came from a registry)."""
    async_and_wait: dict[str, bool]
    """role -> whether its spec asks for async-and-wait (only roles that came from a registry)."""
    made: dict[str, dist.ProcessGroup] | None
    """Every group the registry made that holds this rank (None: no registry given)."""


def _resolve_roles(roles: Any) -> _Roles:
    """The roles to name, from a GroupRegistry or a mapping role -> group (None values skipped)."""
    if roles is None:
        return _Roles({}, {}, {}, None)
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
        return _Roles(resolved, {}, {}, None)
    if not isinstance(roles, GroupRegistry):
        raise TypeError(
            f"audit roles: expected a GroupRegistry or a mapping role -> ProcessGroup, got "
            f"{type(roles).__name__}"
        )
    if not roles.created:
        raise RegistryNotCreatedError(
            "audit roles: the GroupRegistry has no groups yet; fix: call registry.create() on "
            "every rank before recording"
        )
    made = roles.process_groups()
    return _Roles({role: group for role, group in made.items() if role in roles.role_names},
                  {role: roles.spec(role).purpose for role in roles.role_names},
                  {role: roles.spec(role).async_and_wait for role in roles.role_names}, made)


class Recorder:
    """The collectives recorded on this rank, with what is needed to name hazards.

    Made by :func:`record` (or :func:`from_env`), which feeds it every dispatcher call of the block.

    Args:
        roles: a created :class:`~commgroups.GroupRegistry`, or a mapping role -> ProcessGroup for
            groups built another way (``{"cp": mesh.get_group("cp")}``), or None. It names each
            group's role(s) and lets the analysis tell when the default group does a role's work.

    Example::

        with cg.audit.record(registry) as rec:
            train_step()
        len(rec.records)                 # collectives this rank issued in the block
        rec.records[0].op                # e.g. 'c10d._allgather_base_'
        rec.write("/tmp/audit")          # /tmp/audit/rank00002.json on rank 2
    """

    def __init__(self, roles: Any = None) -> None:
        self.records: list[CollectiveRecord] = []
        """Every collective recorded so far, in issue order."""
        resolved = _resolve_roles(roles)
        self._role_groups = resolved.groups
        self._purposes = resolved.purposes
        self._async_and_wait = resolved.async_and_wait
        self._made = (None if resolved.made is None
                      else sorted({group.group_name for group in resolved.made.values()}))
        self._groups: dict[str, _GroupInfo] = {}
        self._group_seq: dict[str, int] = {}
        self._roles_by_group: dict[str, list[str]] = {}
        # Each group's own collective count (where its backend keeps one) when first met and when
        # the block ended: the cross-check against what was recorded.
        self._watched: dict[str, dist.ProcessGroup] = {}
        self._sequence_start: dict[str, int] = {}
        self._sequence_end: dict[str, int] | None = None
        # A registry that rebuilds makes new groups under the same roles: followed by generation.
        self._registry = roles if isinstance(roles, GroupRegistry) else None
        self._generation = roles.generation if isinstance(roles, GroupRegistry) else 0
        for role, group in self._role_groups.items():
            self._roles_by_group.setdefault(group.group_name, []).append(role)
            self._group_info(group)
        default = _default_group()
        for group in [*(resolved.made or {}).values(), *self._role_groups.values(),
                      *([default] if default is not None else [])]:
            self._watch(group)

    # ---------------------------------------------------------------------------- observation
    def _follow_rebuilds(self) -> None:
        """After ``registry.rebuild()``: name the new generation's groups by their roles too."""
        registry = self._registry
        if registry is None or registry.generation == self._generation or not registry.created:
            return
        self._generation = registry.generation
        made = registry.process_groups()
        for role, group in made.items():
            if role in registry.role_names:
                self._role_groups[role] = group
                self._roles_by_group.setdefault(group.group_name, []).append(role)
                self._group_info(group)
        self._made = sorted({*(self._made or ()), *(g.group_name for g in made.values())})
        for group in made.values():
            self._watch(group)

    def _watch(self, group: dist.ProcessGroup) -> None:
        name = group.group_name
        if name in self._watched:
            return
        self._watched[name] = group
        count = torch_internals.group_sequence_number(group)
        if count is not None:
            self._sequence_start[name] = count

    def finish(self) -> None:
        """Read every watched group's own collective count once more: the end of the recording.

        :func:`record` calls it when its block ends (also when the block raises); later calls do
        nothing. Until then :meth:`to_dict` reads the counts live.
        """
        if self._sequence_end is None:
            self._sequence_end = self._read_sequence_end()

    def _read_sequence_end(self) -> dict[str, int]:
        ends = {}
        for name in self._sequence_start:
            count = torch_internals.group_sequence_number(self._watched[name])
            if count is not None:
                ends[name] = count
        return ends

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
            self._groups[name] = _GroupInfo(ranks, backend, group is _default_group())
        return self._groups[name]

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record one dispatcher call if it is a collective on a group.

        Called by the dispatch mode of :func:`record` for every op of the block; anything that is
        not a collective (aten ops, ``wait_tensor``, higher-order operators) is ignored.

        Args:
            func: the dispatcher op (an ``OpOverload``).
            args: its positional arguments as dispatched.
            kwargs: its keyword arguments as dispatched.
        """
        namespace = getattr(func, "namespace", None)
        if namespace not in COLLECTIVE_NAMESPACES:
            return
        name = torch_internals.op_schema(func).name.split("::")[-1]
        if name in NOT_COLLECTIVES:
            return
        values: dict[str, Any] = {}
        for position, argument in enumerate(torch_internals.op_schema(func).arguments):
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
            group = _group_by_name(values["group_name"])
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
        self._watch(group)  # before the op runs: its count does not include this call yet
        group_name = group.group_name
        if async_op is None:
            exec_stream = None
        elif async_op:
            exec_stream = f"group:{group_name}"
        else:
            exec_stream = f"{device}/stream:{stream}" if device.type == "cuda" else str(device)
        self._group_seq[group_name] = self._group_seq.get(group_name, 0) + 1
        if group_name not in self._roles_by_group:
            self._follow_rebuilds()
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
            caller=call_site(),
            in_checkpoint=inside(CHECKPOINT_MODULES),
        ))
        logger.debug("audit: %s on group %s async_op=%s", op, group_name, async_op)

    # ------------------------------------------------------------------------------- results
    def to_dict(self) -> dict[str, Any]:
        """This rank's recording as JSON-ready data: the per-rank file's content.

        Returns:
            A dict in the schema of :mod:`commgroups.audit.records` (format, rank, world_size,
            default_group, groups, roles, role_ranks, purposes, async_and_wait, registry_groups,
            sequence, records).
        """
        default_group = _default_group()
        initialized = default_group is not None
        ends = self._sequence_end if self._sequence_end is not None else self._read_sequence_end()
        default = default_group.group_name if default_group is not None else None
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
            "purposes": dict(self._purposes),
            "async_and_wait": dict(self._async_and_wait),
            "registry_groups": self._made,
            "sequence": {name: [start, ends[name]] for name, start in self._sequence_start.items()
                         if name in ends},
            "records": [r.to_dict() for r in self.records],
        }

    def hazards(self) -> list[Hazard]:
        """The hazards visible from this rank alone.

        Returns:
            :func:`commgroups.audit.hazards.find_hazards` of this rank's recording: aliasing of the
            default group and mixed streams (the sequence check needs every rank: use
            :func:`commgroups.audit.merge.merge`).

        Example::

            [h.kind for h in rec.hazards()]   # ['aliasing', 'mixed_streams'] for plain cp == world
        """
        return find_hazards([self.to_dict()])

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's file into ``directory``, atomically.

        Args:
            directory: where the run's per-rank files go (created if missing).

        Returns:
            The file written, ``directory/rank<NNNNN>.json``; a merge running meanwhile never reads
            half a file.
        """
        data = self.to_dict()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        target = path / rank_file_name(int(data["rank"]))
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(target)
        return target


# torch's own operator namespaces: their ops are never custom_op bodies worth opening.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "higher_order", "profiler", "quantized", "inductor"})


class _AuditMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Passes every op through unchanged, telling the recorder about collectives."""

    # Higher-order operators (flex_attention, cond, ...) reach __torch_dispatch__ instead of
    # raising "no rule registered"; their namespace is "higher_order", never a collective one, so
    # they run unchanged like every other non-collective op.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile traces, on for the compiled code: fullgraph compiles work."""
        return True

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", None)
        if namespace != "higher_order" and torch_internals.defers_to_subclass(types):
            # Let DTensor (or another wrapper subclass) desugar the op under this mode: the
            # collectives it issues then come back through here and are recorded.
            return NotImplemented
        if namespace in COLLECTIVE_NAMESPACES:
            try:
                self.recorder.observe(func, tuple(args), kwargs)
            except Exception:  # the audit must never break the job it watches
                logger.warning("audit: could not record %s", func, exc_info=True)
        elif namespace not in _TORCH_NAMESPACES:
            body = torch_internals.custom_op_body(func, args)
            if body is not None:
                # A custom op's body runs with this mode popped: run it here, under the mode, so
                # the collectives inside it are recorded too.
                with self:
                    return body(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def record(roles: Any = None) -> Iterator[Recorder]:
    """Record every collective this thread issues inside the block.

    Start and stop recording at the same point of the program on every rank, or the cross-rank
    sequence check compares different stretches. Nested ``record()`` blocks each see every call.
    What the observation point sees and misses: the guide, 'How the recorder sees'.

    Args:
        roles: a created :class:`~commgroups.GroupRegistry`, or a mapping role -> ProcessGroup (for
            groups built another way, e.g. ``{"cp": mesh.get_group("cp")}``), so records and
            hazards name roles; None records without role names.

    Returns:
        A context manager yielding the :class:`Recorder`, filled as the block runs.

    Raises:
        TypeError: ``roles`` is neither a registry nor a mapping to ProcessGroups.
        RegistryNotCreatedError: the registry has not created its groups yet (a ValueError).

    Example::

        with cg.audit.record(registry) as rec:
            train_step()
        for hazard in rec.hazards():
            print(hazard.message)
        # 4 ranks, cp == world through the registry: no hazard on any rank
    """
    recorder = Recorder(roles)
    try:
        with _AuditMode(recorder):
            yield recorder
    finally:
        recorder.finish()


@contextmanager
def from_env(roles: Any = None, *,
             environ: Mapping[str, str] | None = None) -> Iterator[Recorder | None]:
    """Record the block when ``COMMGROUPS_AUDIT_DIR`` is set, writing this rank's file on exit.

    The switch for whole runs: wrap the training loop in it and launch with
    ``COMMGROUPS_AUDIT_DIR=/path``; each rank writes ``rank<NNNNN>.json`` there (also when the block
    raises), and ``commgroups audit /path`` merges them. The variable is only read, never written.

    Args:
        roles: as for :func:`record`.
        environ: where to read the variable (default ``os.environ``).

    Returns:
        A context manager yielding the :class:`Recorder`, or None when the variable is unset or
        empty (then nothing is recorded).

    Example::

        # COMMGROUPS_AUDIT_DIR=/tmp/audit torchrun --nproc-per-node 4 train.py
        with cg.audit.from_env(registry):
            for step in range(steps):
                train_step()
        # rank 0 writes /tmp/audit/rank00000.json, rank 1 rank00001.json, ... rank 3 rank00003.json
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
