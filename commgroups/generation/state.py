"""A generation's state: the communicators one ``create()`` or ``rebuild()`` made, and their end.

A :class:`Generation` holds its roles' groups, the dedicated groups of mesh dims no role covers,
the meshes built over them and the store namespaces its creation met in. It is made only by
:func:`commgroups.generation.make.make_generation`; what belongs here are lookups and
teardowns. Lookups (:meth:`Generation.role`, :meth:`~Generation.dim_group`,
:meth:`~Generation.mesh`) are local: they never run a collective nor make a communicator (a mesh
is built over groups that exist). Teardowns: :meth:`~Generation.interrupt` (any thread: blocked
collectives fail at once), :meth:`~Generation.retire` (after a rank loss: handles go stale, groups
are aborted and kept referenced), :meth:`~Generation.release` (retired and no rank waits on it:
groups destroyed) and :meth:`~Generation.destroy` (``close()``); retire and destroy are one
routine.

Example: ``Layout(dims={"dp": 2, "cp": 2})`` on 4 ranks; generation 0 holds the groups of the
roles ``dp``, ``cp``, ``fsdp`` and ``checkpoint-metadata``; ``mesh(("dp", "cp"))`` is built from
the ``dp`` and ``cp`` role groups, creating nothing.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commgroups import torch_internals
from commgroups.backends import BackendAdapter, resolve_backend
from commgroups.creation.agreement import OutcomeChannel
from commgroups.creation.meshes import (
    axes_in_order,
    build_mesh,
    forget_flattenings,
    register_flattening,
)
from commgroups.creation.role_groups import (
    CreatedRole,
    CreationContext,
)
from commgroups.creation.shrink import Spine
from commgroups.creation.sockets import SocketRef, sever
from commgroups.creation.store_keys import AttemptStore
from commgroups.errors import (
    DimOrderError,
    MeshNotPlannedError,
    MeshRequestError,
    UnknownDimError,
)
from commgroups.flight_recorder.session import FlightSession
from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan
from commgroups.util.error_text import listed
from commgroups.util.text_table import format_ranks

if TYPE_CHECKING:
    from commgroups.collectives.role_collectives import RoleCollectives

__all__ = ["STORE_PREFIX", "Generation", "GenerationRequest", "MeshAxis", "destroy_groups",
           "dims_needing_groups", "set_group_timeout"]

logger = logging.getLogger(__name__)

STORE_PREFIX = "commgroups"

MeshAxis = tuple[tuple[str, ...], BackendAdapter, dist.ProcessGroup]
"""One mesh axis: the dims it spans, its group's backend and the group."""


def same_device(a: BackendAdapter, b: BackendAdapter) -> bool:
    """Whether groups of ``a`` and ``b`` can serve one DeviceMesh (one device type)."""
    return a.serves_every_device or b.serves_every_device or a.device_type == b.device_type


def covering_role(layout: Layout, plan: Plan, dim: str, context: CreationContext) -> str | None:
    """The role whose dims are exactly ``[dim]`` and whose groups can serve a mesh axis on the
    device (its backend resolves to the device's type), else None. Pure: the same on every rank."""
    default_backend = str(dist.get_backend())
    for spec in layout.roles:
        if spec.dims == [dim]:
            adapter = resolve_backend(spec.backend, default_backend,
                                      plan.role(spec.name).group_size, context.device_backend)
            device = resolve_backend("device", default_backend, plan.dim_size(dim),
                                     context.device_backend)
            if same_device(adapter, device):
                return spec.name
    return None


def dims_needing_groups(layout: Layout, plan: Plan, meshes: Iterable[Sequence[str]],
                        context: CreationContext) -> tuple[str, ...]:
    """The dims that get their own group at creation, in first-use order.

    A dim of one of ``meshes`` that no role on the device covers (a communicator each on NCCL:
    only when a mesh needs it), and every size-1 dim no role covers (a single-rank group costs no
    communicator). Pure: the same answer on every rank.
    """
    wanted = [name for names in meshes for name in names if name not in layout.role_names]
    wanted += [dim for dim in plan.all_dim_names if plan.dim_size(dim) == 1]
    return tuple(dim for dim in dict.fromkeys(wanted)
                 if covering_role(layout, plan, dim, context) is None)


def set_group_timeout(created: CreatedRole, timeout: timedelta) -> None:
    """Give ``created``'s group (if this rank has one) a new collective timeout, in place."""
    if created.group is not None and created.adapter.has_timeout:
        torch_internals.set_group_timeout(created.group, timeout)


@dataclass(frozen=True)
class GenerationRequest:
    """What one generation is made of, settled before any communicator exists."""

    number: int
    """0 for ``create()``, one more per ``rebuild()``."""
    layout: Layout
    plan: Plan
    rank: int
    """This process's global rank."""
    mode: str
    """The creation mode (``auto``, ``all_ranks``, ``local``, ``split``)."""
    create_timeout_s: float
    context: CreationContext
    mesh_dims: tuple[str, ...] = ()
    """Dims that get a dedicated group (no role covers them): declared meshes, size-1 dims."""
    spine: Spine | None = None
    """After a shrink rebuild: the group every device role is split from."""
    lost: int = 0
    """How many ranks the previous generation lost (agreed on by the survivors)."""
    outcomes: Callable[[AttemptStore], OutcomeChannel] | None = None
    """A rebuild's: the channel its agreement's waiting ranks hear the outcome on, for the
    attempt's namespace (:class:`~commgroups.rank_loss.attempt_channel.AttemptChannel`); None:
    a store wait."""

    @property
    def position(self) -> int:
        """This rank's position in the generation's layout (its global rank in generation 0)."""
        return self.plan.position(self.rank)


@dataclass
class Generation:
    """One generation's groups, meshes and store namespaces: lookups, and the verbs that end them.

    Made by :func:`~commgroups.generation.make.make_generation` only; the registry owns the
    current one and delegates to it.
    """

    request: GenerationRequest
    roles: dict[str, CreatedRole]
    dim_groups: dict[str, CreatedRole] = field(default_factory=dict)
    meshes: dict[tuple[str, ...], DeviceMesh] = field(default_factory=dict)
    attempts: list[AttemptStore] = field(default_factory=list)
    handles: dict[str, RoleCollectives] = field(default_factory=dict)
    epoch: int = -1
    """The agreement epoch of the creation (the same on every rank; -1 under the fake backend)."""
    ended: str = ""
    """Empty while live; ``retired``, ``released`` or ``destroyed`` after :meth:`retire`,
    :meth:`release`, :meth:`destroy`."""
    interrupted: bool = False
    """:meth:`interrupt` ran: the groups are aborted or severed, none carries traffic any more."""
    reported_lost: list[frozenset[int] | None] = field(default_factory=list)
    """The ranks each loss report that reached this generation named (None: nobody in
    particular); see :meth:`note_loss` and :meth:`loss_text`."""
    aborted: set[int] = field(default_factory=set)
    """``id()`` of each group aborted already (abort runs once per group)."""
    flight: FlightSession | None = None
    """The flight recorder of this generation's roles (None: off; see commgroups.flight_recorder)."""
    lingering: list[weakref.ref[dist.ProcessGroup]] = field(default_factory=list)
    """After :meth:`release`: its groups something else still held (see :meth:`_drop_references`)."""
    abandoned: list[tuple[dist.ProcessGroup, Any]] = field(default_factory=list)
    """Calls its interruption did not end, each with its group (see :meth:`abandon`)."""
    flight_events: list[int] = field(default_factory=list)
    """After :meth:`release` on the last rank to release its flight recorder: the listener
    events its asks sent, to delete once every listener is past them (the rank-loss side)."""

    def note_loss(self, suspects: frozenset[int] | None) -> None:
        """A loss report of this generation named ``suspects`` (None: nobody in particular).
        From the listener's thread, before it interrupts the generation."""
        self.reported_lost.append(suspects)

    def loss_text(self, group: dist.ProcessGroup) -> str | None:
        """Why a call on ``group`` failed where a loss report covers it (it names a member of
        ``group``, or nobody in particular): the ranks reported lost, as an error's words; None
        where no report covers the group (its failure is its own)."""
        reports = list(self.reported_lost)
        if not reports:
            return None
        if any(named is None for named in reports):
            return f"a rank loss was reported in generation {self.number}"
        members = set(dist.get_process_group_ranks(group))
        lost = sorted(set().union(*(named for named in reports if named is not None)) & members)
        if not lost:
            return None
        which = f"rank {lost[0]} was" if len(lost) == 1 else f"ranks {format_ranks(lost)} were"
        return f"{which} reported lost in generation {self.number}"

    def abandon(self, group: dist.ProcessGroup, work: Any) -> None:
        """Keep ``work``, a call on ``group`` that survived this generation's interruption, from
        blocking: the group is destroyed only once the call ended (at its own timeout), since
        destroying a gloo group waits for its running calls. The wait that gave up on it
        (:func:`~commgroups.collectives.async_wait.wait_unless_interrupted`) calls this."""
        self.abandoned.append((group, work))

    def _still_running(self) -> set[int]:
        """``id()`` of each group whose abandoned call has not ended yet (the ended ones are
        forgotten)."""
        self.abandoned = [(group, work) for group, work in self.abandoned
                          if not work.is_completed()]
        return {id(group) for group, _ in self.abandoned}

    def created(self) -> list[CreatedRole]:
        """Every role's and mesh dim's created group (empty once the generation was released or
        destroyed: :meth:`_drop_references` lets them go)."""
        return [*self.roles.values(), *self.dim_groups.values()]

    def sockets(self) -> list[SocketRef]:
        """Every socket its gloo groups opened (:mod:`commgroups.creation.sockets`), while they
        exist: what a child forked from this rank lets go of (``detach_on_fork``)."""
        return [ref for role in self.created() for ref in role.sockets]

    @property
    def layout(self) -> Layout:
        """The layout this generation was made from."""
        return self.request.layout

    @property
    def plan(self) -> Plan:
        """The plan this generation was made from."""
        return self.request.plan

    @property
    def number(self) -> int:
        """0 for the generation ``create()`` made, one more per ``rebuild()``."""
        return self.request.number

    # -------------------------------------------------------------------------------- lookups
    def role(self, name: str) -> CreatedRole:
        """What creating role ``name`` left on this rank (its group may be None: not a member)."""
        return self.roles[name]

    def dim_group(self, dim: str) -> MeshAxis:
        """The axis of dim ``dim``: the group of the role over exactly ``[dim]``, else the dim's
        own group made at creation; :class:`MeshNotPlannedError` when neither exists."""
        role = covering_role(self.layout, self.plan, dim, self.request.context)
        created = self.roles[role] if role is not None else self.dim_groups.get(dim)
        if created is not None and created.group is not None:
            return (dim,), created.adapter, created.group
        raise MeshNotPlannedError(
            f"device_mesh: dim {dim!r} has no group (no role covers exactly [{dim!r}]); fix: "
            f"declare the mesh, GroupRegistry(layout, meshes=[[..., {dim!r}, ...]]), or add a "
            f"role over [{dim!r}]",
            field="meshes",
        )

    def axis(self, name: str) -> MeshAxis:
        """The dims, backend and group of the mesh axis ``name`` (a role, else a dim)."""
        if name in self.layout.role_names:
            spec = self.layout.role(name)
            if spec.purpose != "compute":
                raise MeshRequestError(
                    f"device_mesh: role {name!r} has purpose {spec.purpose!r} and is never a mesh "
                    f"axis; fix: pass registry.group({name!r}) to DCP, and mesh compute roles",
                    field="dims",
                )
            dims = self.plan.role(name).dim_names
            created = self.roles[name]
            if dims is None or created.group is None:
                raise MeshRequestError(
                    f"device_mesh: role {name!r} has explicit rank groups, which are not a mesh "
                    f"axis; fix: use registry.group({name!r}) directly",
                    field="dims",
                )
            return dims, created.adapter, created.group
        if name in self.plan.all_dim_names:
            return self.dim_group(name)
        raise UnknownDimError(
            f"device_mesh: {name!r} is neither a dim nor a role; fix: use a dim "
            f"({listed(self.plan.all_dim_names, 80)}) or a role "
            f"({listed(self.layout.role_names, 80)})",
            field="dims",
        )

    def mesh(self, names: tuple[str, ...]) -> DeviceMesh:
        """The DeviceMesh over ``names`` (roles or dims), built once from existing groups.

        Local: :meth:`~torch.distributed.device_mesh.DeviceMesh.from_group` runs no collective,
        and a dim without a group is refused (:meth:`dim_group`), never created.
        """
        if names in self.meshes:
            return self.meshes[names]
        axes = [self.axis(name) for name in names]
        spans = [dims for dims, _, _ in axes]
        if not axes_in_order(self.plan, spans):
            raise DimOrderError(
                f"device_mesh: {list(names)} span dims {[list(a) for a in spans]}; fix: name "
                f"distinct dims in layout order ({', '.join(self.layout.dims)})",
                field="dims",
            )
        device_types = {adapter.device_type for _, adapter, _ in axes
                        if not adapter.serves_every_device}
        if not device_types:  # every axis is a single-rank group: the job's device type
            device_types = {resolve_backend("device", str(dist.get_backend())).device_type}
        if len(device_types) != 1:
            raise MeshRequestError(
                f"device_mesh: {list(names)} use groups on device types {sorted(device_types)}; "
                "fix: give those roles the same backend",
                field="dims",
            )
        mesh = build_mesh(self.plan, self.request.rank, spans,
                          [group for _, _, group in axes], device_types.pop(), names)
        self._register_flattenings(mesh, names, spans)
        self.meshes[names] = mesh
        return mesh

    def _register_flattenings(self, mesh: DeviceMesh, names: tuple[str, ...],
                              spans: list[tuple[str, ...]]) -> None:
        """Pre-register every run of axes a compute role spans as that role's flattening.

        Under torch's default name (``"_".join(run)``) and the role's name, so code that flattens
        the mesh it was handed (FSDP2's ``dp_mesh_dims``) gets the role's group, never a new one.
        Compute roles on the mesh's device only: DTensor looks flattenings up by layout, and would
        send model traffic over a gloo checkpoint group (the guide, 'DTensor and flattenings').
        """
        by_dims = {
            self.plan.role(r).dim_names: r for r in self.layout.role_names
            if self.layout.role(r).purpose == "compute" and self.roles[r].group is not None
            and (self.roles[r].adapter.serves_every_device
                 or self.roles[r].adapter.device_type == mesh.device_type)
        }
        for start in range(len(names)):
            for stop in range(start + 2, len(names) + 1):
                role = by_dims.get(tuple(d for axis in spans[start:stop] for d in axis))
                if role is None:
                    continue
                group = self.roles[role].group
                assert group is not None
                for key in sorted({"_".join(names[start:stop]), role} - set(names)):
                    if not register_flattening(mesh, names[start:stop], key, group):
                        logger.info("this torch's DeviceMesh has no flatten mapping to fill: "
                                    "mesh[%s]._flatten() will create a new group",
                                    list(names[start:stop]))
                        return

    def owned_groups(self) -> dict[str, CreatedRole]:
        """Every group this generation made: roles by name, dim groups as ``mesh-<dim>``."""
        return {**self.roles, **{f"mesh-{dim}": made for dim, made in self.dim_groups.items()}}

    def set_timeout(self, names: Iterable[str], timeout: timedelta, dims_too: bool) -> None:
        """Give the groups of roles ``names`` (and every dim group if ``dims_too``) ``timeout``."""
        targets = [self.roles[name] for name in names]
        if dims_too:
            targets += self.dim_groups.values()
        for created in targets:
            set_group_timeout(created, timeout)

    # ------------------------------------------------------------------------------ teardown
    def interrupt(self, keep: Collection[dist.ProcessGroup] = (),
                  holding: Collection[int] | None = None) -> None:
        """Free every collective blocked on this generation's groups, here and at their peers.

        From any thread (the liveness watcher calls it when a peer reports a loss), idempotent:
        device groups are aborted where the backend can, gloo groups severed
        (:mod:`commgroups.creation.sockets`). Every later collective on them fails at once.
        Handles and meshes stay until :meth:`retire`. ``keep``: groups left alone (the NCCL
        spine a shrink rebuild still needs). ``holding``: only the roles whose group here holds
        one of these global ranks (the ranks that left the generation); None: every role.
        """
        if self.ended:
            return
        made = self.created()
        if holding is not None:
            wanted = set(holding)
            made = [role for role in made
                    if any(wanted.intersection(dist.get_process_group_ranks(group))
                           for group in role.owned)]
            if not made:
                return
        self.interrupted = True
        if self.flight is not None:  # the failures that follow are this interruption's
            self.flight.interrupted = True
        _abort_groups(made, self.aborted, keep)

    def retire(self) -> None:
        """After a rank loss: every handle goes stale, meshes are forgotten, groups aborted where
        the backend can and kept referenced (destroying one with a dead peer may block on it).

        The store namespaces are dropped unreleased: the lost ranks never release their part.
        """
        number = self.number
        self.interrupted = True
        if self.flight is not None:
            self.flight.interrupted = True
        self._teardown("retired", lambda handle: handle.retire(number),
                       lambda made: _abort_groups(made, self.aborted))

    def release(self, lost: Sequence[int] = ()) -> bool:
        """After :meth:`retire`, once no rank waits on it: destroy its groups and delete its store
        keys (``lost``: positions that died and never delete theirs). Local.

        Only where every group was interrupted for sure (aborted, or gloo severed); otherwise it
        stays referenced, since destroying a group blocked on a dead peer blocks. Returns whether
        it was released.
        """
        if self.ended != "retired":
            return False
        made = self.created()
        if not all(role.adapter.aborts or role.sockets or not role.owned
                   or not role.adapter.connects_on_create for role in made):
            return False
        if self._still_running():  # tried again at the next rebuild() or close()
            return False
        destroy_groups(made)
        del made  # a reference here would keep every group alive through _drop_references
        if self.flight is not None:
            members = self.plan.members or tuple(range(self.layout.world_size))
            self.flight_events = self.flight.release(tuple(members[position] for position in lost))
        if self.request.rank >= 0:
            for attempt in self.attempts:
                attempt.release(self.request.position, self.layout.world_size, lost)
        self.attempts.clear()
        self.lingering = self._drop_references(full=False)
        self.ended = "released"
        return True

    def _drop_references(self, full: bool) -> list[weakref.ref[dist.ProcessGroup]]:
        """Let the groups go now: a group's threads and sockets live as long as its last reference.
        Returns weak references to the groups something else still holds.

        Some sit in reference cycles (an interrupted collective's exception and traceback hold
        them, measured on 2.13): a young-generation collection frees those in about a millisecond.
        A full one (0.2-0.7 s with torch loaded) runs only with ``full``: a ``rebuild()`` called
        from the ``except`` block of the failed step (the guide's pattern) still holds the
        groups through the live exception, and a caller of ``close()`` often still holds a
        group or a mesh; no collection frees those, so it cost every rebuild and close that time
        for nothing (close: 326 ms of 8 ranks' 326, cProfile). The rank-loss side collects what
        lingers a second later instead (:meth:`commgroups.rank_loss.Recovery.linger`).
        """
        left = [weakref.ref(group) for made in self.created() for group in made.owned]
        self.roles.clear()
        self.dim_groups.clear()
        self.meshes.clear()
        for generation in (1, 2) if full else (1,):
            if not any(ref() is not None for ref in left):
                return []
            gc.collect(generation)
        return [ref for ref in left if ref() is not None]

    def announce_created(self) -> None:
        """Send this rank's note that it is done creating, where :func:`make_generation` left it
        to the caller (``announce=False``); nothing otherwise. Any thread; once."""
        for attempt in list(self.attempts):
            attempt.announce_created()

    def destroy(self) -> None:
        """``close()``: every handle refuses later calls, groups are destroyed, store keys released.

        Waits first for a peer still connecting to one of the gloo groups (at most until its
        creation would have timed out). Local: no rank waits for another to destroy.
        """
        for attempt in self.attempts:
            attempt.wait_created()
        running = self._still_running()

        def destroy_ended(made: Iterable[CreatedRole]) -> None:
            # A group with an abandoned call still running is left to torch (destroying it would
            # block until the call's timeout): closed with the process, or by whoever destroys
            # torch.distributed.
            destroy_groups([role for role in made
                            if not any(id(group) in running for group in role.owned)])

        self._teardown("destroyed", lambda handle: handle.close("the registry was closed"),
                       destroy_ended)
        if self.request.rank >= 0:
            for attempt in self.attempts:
                attempt.release(self.request.position, self.layout.world_size)
        self.attempts.clear()
        self.lingering = self._drop_references(full=False)

    def _teardown(self, how: str, end_handle: Callable[[RoleCollectives], None],
                  end_groups: Callable[[Iterable[CreatedRole]], None]) -> None:
        """The one teardown: handles, groups, then meshes (and DTensor's caches of them)."""
        if self.ended:
            return
        for handle in self.handles.values():
            end_handle(handle)
        self.handles.clear()
        if self.flight is not None:
            self.flight.close(release=how == "destroyed")
        end_groups(self.created())
        for mesh in self.meshes.values():
            forget_flattenings(mesh)
        if self.meshes:
            # DTensor caches its decisions by mesh and compares meshes by layout and names: a
            # later mesh named like ours would get ours back, with ended groups.
            torch_internals.clear_dtensor_caches()
        self.ended = how


def _abort_groups(created: Iterable[CreatedRole], done: set[int],
                  keep: Collection[dist.ProcessGroup] = ()) -> None:
    """Abort each owned group not in ``done`` nor ``keep`` (adding it to ``done``); sever gloo's."""
    for role in created:
        for group in role.owned:
            if id(group) not in done and not any(group is kept for kept in keep):
                done.add(id(group))
                role.adapter.abort(group)
        sever(role.sockets)


def destroy_groups(created: Iterable[CreatedRole]) -> None:
    """Destroy every group ``created`` owns (a no-op once torch.distributed was torn down)."""
    owned = [group for role in created for group in role.owned]
    if not (dist.is_available() and dist.is_initialized()):
        return  # the whole world was torn down already, our groups with it
    for group in owned:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as error:  # already destroyed elsewhere
            logger.debug("destroying %s: %s", group, error)
