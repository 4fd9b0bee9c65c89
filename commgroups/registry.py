"""The GroupRegistry: owns every process group a training job uses, one dedicated group per role.

The registry holds the current :class:`~commgroups.generation.Generation` and delegates to it.
Only :meth:`GroupRegistry.create` and :meth:`GroupRegistry.rebuild` make communicators (collective:
ranks agree on the plan first, so a disagreement is an error on every rank, not a hang); lookups
(``group``, ``ranks``, ``collectives``, ``device_mesh``) never run a collective nor make a group,
for the reason Megatron-Core's ``HyperCommGrid`` keeps ``create_pg`` and ``get_pg`` apart: a getter
reached on some ranks only would otherwise hang the others. A role's group is never the default
group, not even when the role spans the world.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import Self

from commgroups.backends import BackendAdapter
from commgroups.creation.meshes import check_mesh_request, mesh_names
from commgroups.creation.role_groups import CREATION_MODES, CreationContext
from commgroups.errors import (
    ArgumentError,
    CommGroupsError,
    LeftOutError,
    NotAMemberError,
    RebuildError,
    RegistryClosedError,
    RegistryNotCreatedError,
    RegistryStateError,
    StaleGenerationError,
    SurvivorLostError,
    WorldSizeMismatchError,
)
from commgroups.generation import (
    STORE_PREFIX,
    Generation,
    GenerationRequest,
    dims_needing_groups,
    make_generation,
)
from commgroups.layout import limits
from commgroups.layout.auto_layout import AutoLayout, job_layout
from commgroups.layout.specs import Layout, RoleSpec
from commgroups.planning.plan import Plan, plan
from commgroups.rank_loss import RebuildReport, Recovery
from commgroups.util.call_sites import call_site
from commgroups.util.role_table import LiveRole, role_table
from commgroups.util.serialized import serialized

if TYPE_CHECKING:
    from commgroups.collectives.role_collectives import RoleCollectives
    from commgroups.flight_recorder.session import FlightSession

__all__ = ["GroupRegistry", "RegistryState"]

logger = logging.getLogger(__name__)

DEFAULT_CREATE_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_S = 10.0
DEFAULT_DEAD_AFTER_S = 1.0
REBUILD_RETRIES = 3
"""How many times one ``rebuild()`` starts over without survivors that died during it
(:class:`~commgroups.errors.SurvivorLostError`): each retry follows a death, so more would
mean the job is going, not a race."""

MeshNames = tuple[str, ...]


class RegistryState(str, enum.Enum):
    """Where a registry is in its lifecycle (compares equal to its lower-case name)."""

    NEW = "new"
    """Constructed; :meth:`GroupRegistry.create` has not succeeded yet."""
    CREATED = "created"
    """The current generation is live."""
    RETIRED = "retired"
    """A rebuild retired the current generation and has not made the next one yet."""
    SPARE = "spare"
    """The last rebuild's smaller layout kept this rank as a spare: it holds no groups."""
    DROPPED = "dropped"
    """The last rebuild's smaller layout has no place for this rank: it should exit."""
    CLOSED = "closed"
    """:meth:`GroupRegistry.close` ran: every generation's groups are gone."""


class GroupRegistry:
    """Owns one dedicated process group per role of a :class:`~commgroups.Layout`.

    Use after ``torch.distributed.init_process_group`` (or under torchrun)::

        registry = GroupRegistry(layout)
        registry.create()                 # collective; or `with GroupRegistry(layout) as registry:`
        cp = registry.group("cp")         # never the default group
        mesh = registry.device_mesh(["dp_shard", "cp"])
        registry.close()                  # destroys every group it made

    Example: on 4 ranks with ``Layout(dims={"dp_shard": 2, "cp": 2})`` (built-in roles dp_shard,
    cp, fsdp, checkpoint-metadata), ``registry.ranks("cp")`` is ``(0, 1)`` on ranks 0 and 1 and
    ``(2, 3)`` on ranks 2 and 3; ``registry.ranks("fsdp")`` is ``(0, 1, 2, 3)`` everywhere, on a
    dedicated group that is not the default group.

    Args:
        layout: the validated layout; an :class:`~commgroups.AutoLayout` is resolved with
            ``torch.distributed``'s world size (restart mode).
        creation_mode: ``auto`` (fastest safe path per role), ``all_ranks``, ``local`` or
            ``split``; :meth:`creation_method` says which path each role took.
        create_timeout_s: how long ranks wait for each other during creation before every rank
            raises :class:`~commgroups.errors.AgreementTimeoutError`.
        meshes: meshes to plan at creation, each a list of dim or role names. A dim that no role
            covers gets its own group only here; :meth:`device_mesh` never creates one.
        heartbeat_s: seconds between this rank's backstop beats in the store
            (:mod:`commgroups.rank_loss.liveness`: a listening thread, two store requests per
            interval while idle); a beat still for ten ``dead_after_s`` (at least three beats)
            reports its rank as wedged. None: no listening thread (a rebuild then waits its
            whole window for absent ranks and decides only as a majority of every member, and
            a loss is only seen by the lost rank's peers).
        dead_after_s: how long a rebuild's roll call waits for an absent rank's thread to answer
            before that rank counts as dead (never a rank listed in ``alive=``).
    """

    def __init__(
        self,
        layout: Layout | AutoLayout,
        *,
        creation_mode: str = "auto",
        create_timeout_s: float = DEFAULT_CREATE_TIMEOUT_S,
        meshes: Iterable[str | Sequence[str]] = (),
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
    ) -> None:
        if isinstance(layout, AutoLayout):  # restart mode: the "auto" dim's size is the world's
            layout = job_layout(layout)
        if not isinstance(layout, Layout):
            raise TypeError(f"GroupRegistry needs a commgroups.Layout, got {type(layout).__name__}; "
                            "fix: build one with cg.Layout(...) or cg.load_layout(path)")
        if creation_mode not in CREATION_MODES:
            raise ArgumentError(f"creation_mode: unknown mode {creation_mode!r}; fix: use one of "
                                f"{', '.join(CREATION_MODES)}", field="creation_mode")
        # A bool, nan or inf here would validate and then fail inside create() with a raw error.
        self.create_timeout_s = limits.check_timeout(create_timeout_s, "create_timeout_s")
        self.heartbeat_s = (None if heartbeat_s is None
                            else limits.check_timeout(heartbeat_s, "heartbeat_s"))
        self.dead_after_s = limits.check_timeout(dead_after_s, "dead_after_s")
        self.creation_mode = creation_mode
        self._layout, self._plan = layout, plan(layout)
        self._mesh_requests: list[MeshNames] = []  # declared, then asked for: rebuilt in order
        for request in meshes:
            names = mesh_names(request, "meshes")
            check_mesh_request(layout, self._plan, names)
            if names not in self._mesh_requests:
                self._mesh_requests.append(names)
        self._declared = len(self._mesh_requests)
        self._rank = -1
        self._state = RegistryState.NEW
        self._current: Generation | None = None
        self._number = 0  # the current generation's number (spares count rebuilds too)
        self._recovery = Recovery(rank=-1, registry_id=-1)  # the rank-loss side, set by create()
        self._timeout_overrides: dict[str, timedelta] = {}
        self._lock = threading.RLock()
        self._creator = threading.current_thread()  # owns the role handles (RoleCollectives)
        self._creator_site = ""
        self._on_rebuilt: list[Callable[[RebuildReport], None]] = []
        self._barrier_calls: dict[tuple[int, str], int] = {}  # by generation and name

    # ------------------------------------------------------------------------------- creation
    @serialized
    def create(self) -> Self:
        """Make generation 0: every role's group and every declared mesh. Collective.

        Raises the same error on every rank, before any group exists, when the layout does not fit
        this job or ranks disagree.
        """
        if self._state is RegistryState.CLOSED:
            raise RegistryClosedError("this registry was closed; fix: make a new GroupRegistry")
        if self._state is not RegistryState.NEW:
            raise RegistryStateError("create() was already called on this registry; fix: call it once "
                                     "(after a rank loss, rebuild() makes the next generation)")
        if not dist.is_available() or not dist.is_initialized():
            raise RegistryStateError("torch.distributed is not initialized; fix: call "
                                     "init_process_group() (or run under torchrun) before create()")
        rank, world = dist.get_rank(), dist.get_world_size()
        self._rank = rank
        local_error: CommGroupsError | None = None
        if self._layout.world_size != world:
            local_error = WorldSizeMismatchError(
                f"dims: the layout's world size is {self._layout.world_size} "
                f"({' x '.join(f'{k}={v}' for k, v in self._layout.dims.items())}) but the job has "
                f"{world} ranks; fix: make the product of dims equal {world}",
                field="dims",
            )
        self._creator = threading.current_thread()
        self._creator_site = call_site(sys._getframe(1))
        # The note that this rank is done creating goes out from the starter thread
        # (Recovery.start_threads): one store round trip off the path every rank waits on.
        generation = make_generation(self._first_request(), local_error, announce=False)
        self._recovery.rank, self._recovery.registry_id = rank, generation.epoch
        self._start(generation)
        self._recovery.start_threads(generation, self.members, self.heartbeat_s,
                                     self.dead_after_s, self.create_timeout_s,
                                     lambda: self._current)
        return self

    def _first_request(self) -> GenerationRequest:
        """Generation 0's request (a rebuild derives the next one from the current request)."""
        context = CreationContext.detect()  # once per generation: torch_npu's probe is slow
        layout, the_plan = self._layout, self._plan
        return GenerationRequest(
            number=0, layout=layout, plan=the_plan, rank=self._rank, mode=self.creation_mode,
            create_timeout_s=self.create_timeout_s, context=context,
            mesh_dims=dims_needing_groups(layout, the_plan, self._mesh_requests, context))

    def _start(self, generation: Generation) -> None:
        """Make ``generation`` current: timeouts set earlier, then the planned and asked meshes."""
        for role, value in self._timeout_overrides.items():
            generation.set_timeout([role], value, dims_too=False)
        self._current = generation
        self._layout, self._plan = generation.layout, generation.plan
        self._state = RegistryState.CREATED
        for names in self._mesh_requests:
            generation.mesh(names)

    # -------------------------------------------------------------------------------- rebuild
    @property
    def generation(self) -> int:
        """0 after :meth:`create`; one more after each successful :meth:`rebuild`."""
        return self._number

    @property
    def members(self) -> tuple[int, ...]:
        """The global rank at each position of the current layout (``0 .. world - 1`` at first)."""
        members = self._plan.members
        return members if members is not None else tuple(range(self._layout.world_size))

    @serialized
    def rebuild(self, alive: Iterable[int] | None = None, *,
                timeout: float | timedelta | None = None) -> RebuildReport:
        """After a rank loss: make generation g+1 on the survivors. Collective over the survivors.

        Reports the loss to every rank (their groups of g are interrupted, so nobody waits out a
        collective), agrees on the survivors through the store, shrinks the layout by its
        ``elastic`` rules, retires g and makes every role and mesh again on the survivors
        (:mod:`commgroups.rank_loss`; the guide, 'Rank loss', says how long each step takes).

        Args:
            alive: the global ranks known alive, this one included: the check-in ends when they
                are all in. None: every member checks in or stops beating, or the window ends.
            timeout: the check-in window (seconds or timedelta), a backstop. Default: the longest
                role ``timeout_s`` given plus half of it (at least 2 s: a rank that waited out its
                role timeout still gets in), else ``create_timeout_s``.

        Raises:
            ReplanError: the survivors cannot form the layout; on every survivor, nothing retired.
            LeftOutError: the survivors were decided without this rank; it is out for good.
            RebuildError: ``alive`` is malformed, the ranks in are no majority of the live ones,
                or a backend cannot be rebuilt here.
            SurvivorLostError: survivors died during the rebuild, :data:`REBUILD_RETRIES` times
                over (each time a peer on their host saw it, every survivor started over
                without them, within about a second: ``report.retried``).
            AgreementTimeoutError, GroupCreationError: a survivor died during the rebuild where
                no peer on its host saw it (alone on its host, or the host gone), or while the
                groups were made: after ``create_timeout_s``; call ``rebuild()`` again.
            StoreUnreachableError: the store's host died.
        """
        current = self._current
        if current is None or self._state not in (RegistryState.CREATED, RegistryState.RETIRED):
            raise RebuildError(f"rebuild() needs a created registry (this one is "
                               f"{self._state.value}); fix: call it after create(), on every "
                               "member of the last generation")
        if isinstance(alive, Iterator):
            alive = list(alive)  # a retry checks in again with it
        retried: list[float] = []
        while True:
            started = time.monotonic()
            try:
                report, generation = self._recovery.rebuild(
                    current, alive, timeout, self._mesh_requests, self._timeout_overrides)
                break
            except LeftOutError:  # decided without this rank: it stays out, a retry included
                self._retire()
                self._recovery.release_retired()
                self._recovery.stop_liveness()
                self._state = RegistryState.DROPPED
                raise
            except SurvivorLostError as error:  # every survivor raised it: all start over
                if current.ended:
                    self._state = RegistryState.RETIRED
                if len(retried) == REBUILD_RETRIES:
                    raise
                retried.append(time.monotonic() - started)
                logger.info("rank %d: ranks %s died during rebuild(); rebuilding without them",
                            self._rank, list(error.lost))
                if alive is not None:
                    alive = [rank for rank in alive if rank not in error.lost]
            except BaseException:
                if current.ended:
                    self._state = RegistryState.RETIRED
                raise
        if retried:
            report = replace(report, retried=tuple(retried))
        self._number = report.generation
        if generation is None:
            self._state = RegistryState(report.place)
        else:
            mark = time.monotonic()
            self._start(generation)
            report.seconds["meshes"] = time.monotonic() - mark
            report.seconds["release"] = self._recovery.finish(report, current, generation)
            logger.info("rank %d: rebuilt generation %d on %d ranks in %.3fs", self._rank,
                        self._number, len(self.members), report.total_seconds)
        for callback in list(self._on_rebuilt):
            callback(report)
        return report

    def store_barrier(self, name: str, *, timeout: float | timedelta | None = None) -> None:
        """Every member of the current generation reaches ``name`` before any leaves, through
        the job's store: no collective on any group (torchtitan's timeout switch, which stock
        runs as a default-group barrier). Blocks; every member calls it, with the same names in
        the same order (the n-th call of a name meets the n-th on every rank).

        A rank lost before it arrived never will: a loss report of the current generation that
        reaches this rank ends the wait with :class:`~commgroups.errors.LossInterruptedError`
        within milliseconds, not after ``timeout``. Nobody is in a collective here, so no
        socket of a group sees a death: the dead rank's host relay reports it, a waiting rank
        reports a member dead on its own host (``/proc``, every 0.2 s), and the heartbeat's
        backstop a rank alone on its host or a host gone whole (with the heartbeat off nothing
        reports: a plain store barrier). Otherwise ``timeout`` (default:
        ``create_timeout_s``) raises :class:`~commgroups.errors.AgreementTimeoutError` naming
        the ranks that never arrived. Five store requests per rank (each deletes its arrival
        once through: two keys stay per call), and one connection for the wait.
        """
        if not isinstance(name, str) or not name or "/" in name:
            raise ArgumentError(f"name: a barrier's name is non-empty text without '/', got "
                                f"{name!r}; fix: give a name such as 'set_pg_timeouts'",
                                field="name")
        generation = self._live()
        seconds = (self.create_timeout_s if timeout is None
                   else limits.check_timeout(timeout, "timeout"))
        counted = (generation.number, name)  # a rebuilt generation counts afresh
        calls = self._barrier_calls[counted] = self._barrier_calls.get(counted, 0) + 1
        members = self.members
        self._recovery.store_barrier(
            f"{STORE_PREFIX}/barrier/{self._recovery.registry_id}/{generation.number}/{name}/"
            f"{calls}", members.index(self._rank), members, timedelta(seconds=seconds),
            f"store_barrier({name!r})", generation.number)

    def on_rebuilt(self, callback: Callable[[RebuildReport], None]) -> Callable[[], None]:
        """Call ``callback(report)`` on this rank at the end of each successful :meth:`rebuild`,
        once the new generation is current (``report.place`` says whether this rank is in it);
        returns the function that stops it. Local; callbacks run in the order added.

        For state that mirrors the registry's groups elsewhere, e.g. Megatron-Core's
        ``parallel_state`` globals (:func:`commgroups.integrations.megatron.install_parallel_state`
        re-points them here), so a bare ``registry.rebuild()`` leaves nothing on retired groups.
        An exception from ``callback`` propagates from ``rebuild()``, after the rebuild is done.
        """
        self._on_rebuilt.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):  # removed already: idempotent
                self._on_rebuilt.remove(callback)

        return remove

    def _retire(self) -> None:
        """Retire the live generation (released once this rank is past the check-in)."""
        if self._current is not None and not self._current.ended:
            self._recovery.retire(self._current)
            self._state = RegistryState.RETIRED

    def _role_timeout(self, role: str, adapter: BackendAdapter) -> timedelta:
        if role in self._timeout_overrides:
            return self._timeout_overrides[role]
        spec = self.spec(role)
        return (adapter.default_timeout() if spec.timeout_s is None
                else timedelta(seconds=spec.timeout_s))

    # -------------------------------------------------------------------------------- lookups
    def _live(self) -> Generation:
        """The current generation, if this rank can use it; else the error saying why not."""
        state = self._state
        if state is RegistryState.CREATED and self._current is not None:
            return self._current
        if state is RegistryState.CLOSED:
            raise RegistryClosedError("this registry was closed and its groups destroyed; fix: make "
                                      "a new GroupRegistry")
        if state is RegistryState.RETIRED:
            raise StaleGenerationError(
                f"generation {self._number} was retired by rebuild() and the next one was not "
                "made (the rebuild failed); fix: call registry.rebuild() again on every survivor",
                role=None, generation=self._number)
        if state in (RegistryState.SPARE, RegistryState.DROPPED):
            raise RegistryStateError(
                f"rank {self._rank} was left out of generation {self._number} as "
                f"{'a spare' if state is RegistryState.SPARE else 'dropped'} and holds no groups; "
                "fix: check rebuild()'s report before using the registry"
                + ("; a dropped rank should exit" if state is RegistryState.DROPPED else ""))
        raise RegistryNotCreatedError("the registry has no groups yet; fix: call registry.create() "
                                      "on every rank first")

    @property
    def layout(self) -> Layout:
        """The current generation's layout (read-only; ``rebuild()`` moves it on)."""
        return self._layout

    @property
    def plan(self) -> Plan:
        """The current generation's plan (read-only; ``rebuild()`` moves it on)."""
        return self._plan

    @property
    def state(self) -> RegistryState:
        """Where the registry is in its lifecycle."""
        return self._state

    @property
    def role_names(self) -> tuple[str, ...]:
        """Role names in declaration order."""
        return self._layout.role_names

    @property
    def created(self) -> bool:
        """True while the current generation is live (after create(), before close())."""
        return self._state is RegistryState.CREATED

    def spec(self, role: str) -> RoleSpec:
        """The RoleSpec of ``role``; KeyError listing the known roles otherwise."""
        return self._layout.role(role)

    def group(self, role: str) -> dist.ProcessGroup:
        """This rank's dedicated ProcessGroup for ``role`` (never the default group).

        Raises:
            KeyError: ``role`` is not in the layout (the message lists the roles).
            NotAMemberError: ``role`` has explicit rank groups and none holds this rank.
            RegistryStateError: no live generation (RegistryNotCreatedError before create(),
                RegistryClosedError after close).

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})`` on 4 ranks:
        ``dist.get_process_group_ranks(registry.group("cp"))`` is ``[0, 1]`` on ranks 0 and 1.
        """
        self.spec(role)
        group = self._live().role(role).group
        if group is None:
            raise NotAMemberError(f"rank {self._rank} is in no group of role {role!r}; fix: call "
                                  f"group({role!r}) on its member ranks only")
        return group

    def ranks(self, role: str) -> tuple[int, ...]:
        """Global ranks of this rank's group for ``role``, ascending (same errors as :meth:`group`).

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})``: ``registry.ranks("dp_shard")`` is
        ``(0, 2)`` on ranks 0 and 2, ``(1, 3)`` on ranks 1 and 3.
        """
        self.spec(role)
        self._live()
        ranks = self._plan.ranks_of(role, self._rank)
        if ranks is None:
            raise NotAMemberError(f"rank {self._rank} is in no group of role {role!r}; fix: call "
                                  f"ranks({role!r}) on its member ranks only")
        return ranks

    def process_groups(self) -> dict[str, dist.ProcessGroup]:
        """Every group of the live generation that holds this rank: role name -> its group, and
        ``mesh-<dim>`` -> the group of a dim no role covers. The audit reads this."""
        return {name: made.group for name, made in self._live().owned_groups().items()
                if made.group is not None}

    def resolved_backend(self, role: str) -> str:
        """The backend ``role`` resolved to on this machine (nccl, rccl, hccl, gloo, single or
        fake); ``spec(role).backend`` is the one requested (``device``, ``gloo``, ...)."""
        self.spec(role)
        return self._live().role(role).adapter.name

    backend = resolved_backend
    """Alias of :meth:`resolved_backend` (the name before 0.2)."""

    def creation_method(self, role: str) -> str:
        """How ``role``'s groups were created here (all_ranks, local or split)."""
        self.spec(role)
        return self._live().role(role).method

    def timeout(self, role: str) -> timedelta:
        """The collective timeout of ``role``'s group: its spec's, or the last set_timeout()."""
        self.spec(role)
        return self._role_timeout(role, self._live().role(role).adapter)

    def set_timeout(self, timeout: float | timedelta, role: str | None = None) -> None:
        """Change the collective timeout of one role's group, or of every group (``role=None``).

        Like ``torch.distributed.set_timeout``: applies to collectives issued after the call. Local
        (no barrier, cannot hang): call it on every rank, between steps. Kept across rebuilds.

        Example::

            registry.set_timeout(timedelta(minutes=5))       # every group this registry made
            registry.set_timeout(30, role="cp")              # only cp's group
        """
        if role is not None:
            self.spec(role)
        generation = self._live()
        seconds = limits.check_timeout(timeout, "timeout")
        new = timedelta(seconds=seconds)
        names = self.role_names if role is None else (role,)
        generation.set_timeout(names, new, dims_too=role is None)
        self._timeout_overrides.update(dict.fromkeys(names, new))
        logger.info("rank %d: timeout of %s set to %ss", self._rank,
                    "every group" if role is None else f"role {role}", seconds)

    @serialized
    def collectives(self, role: str) -> RoleCollectives:
        """The torch.distributed collective API on ``role``'s group, without ``group=``.

        Every call is issued ``async_op=True`` and waited at once (unless the role's
        ``async_and_wait`` is off). The handle issues from the thread that ran :meth:`create`
        (others get :class:`~commgroups.errors.ConcurrentRoleUseError` unless they ``adopt()``)
        and refuses to run once its generation is retired or closed.
        """
        from commgroups.collectives.role_collectives import RoleCollectives

        group = self.group(role)
        live = self._live()
        handles = live.handles
        # One object per role, so its call count (the sequence number errors name) is per role.
        if role not in handles:
            flight = live.flight
            # A gloo wait blocks this thread: it also watches for the generation's interruption.
            severs = live.role(role).adapter.severs
            handles[role] = RoleCollectives(group, role=role,
                                            async_and_wait=self.spec(role).async_and_wait,
                                            owner=self._creator, owner_site=self._creator_site,
                                            flight=flight.recorder.role(role) if flight else None,
                                            watch=live if severs else None,
                                            losses=live.loss_text)
        return handles[role]

    @serialized
    def device_mesh(self, dims_or_role: str | Sequence[str]) -> DeviceMesh:
        """A DeviceMesh over the live generation's groups, named by what was asked for. Local.

        Each name is a role over dims (one axis on the role's own group, its dims flattened) or a
        dim (the group of the role over exactly that dim, else the dim's group planned by
        ``meshes=``). Names cover distinct dims in layout order. The same names give the same
        object. Never creates a group: see the guide, 'Meshes'.

        Raises:
            UnknownDimError: a name is neither a dim nor a role.
            DimOrderError: the names overlap or are out of layout order.
            MeshNotPlannedError: a dim has no group; declare the mesh with ``meshes=``.

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})`` on 4 ranks:
        ``registry.device_mesh(["dp_shard", "cp"])`` is the mesh ``[[0, 1], [2, 3]]``;
        ``registry.device_mesh("fsdp")`` is the 1-D mesh ``[0, 1, 2, 3]`` on the fsdp group.
        """
        generation = self._live()
        names = mesh_names(dims_or_role)
        mesh = generation.mesh(names)
        if names not in self._mesh_requests:
            self._mesh_requests.append(names)  # rebuilt by every later generation
        return mesh

    # ------------------------------------------------------------------------------ reporting
    @property
    def flight_recorder(self) -> FlightSession | None:
        """The live generation's flight recorder (None: off, or no live generation)."""
        live = self._current if self._state is RegistryState.CREATED else None
        return live.flight if live is not None else None

    def dump_flight_recorder(self, directory: str | os.PathLike[str] | None = None) -> str | None:
        """Write this rank's flight recorder (JSON) into ``directory`` (default: ``$COMMGROUPS_
        FLIGHT_DIR``, else a temporary folder); returns the file's path, None when it is off.
        Local; ``commgroups flight merge DIR`` reads every rank's file."""
        flight = self.flight_recorder
        return flight.dump(directory) if flight is not None else None

    def describe(self) -> str:
        """A readable table: each role's dims, backend, size, groups, this rank's ranks, timeout."""
        current = self._current if self._state is RegistryState.CREATED else None
        live = None if current is None else {
            name: LiveRole(current.role(name).adapter.name, current.role(name).method,
                           self.timeout(name).total_seconds()) for name in self.role_names}
        return role_table(self._layout, self._plan, self._rank, self._state.value, live)

    def __repr__(self) -> str:
        return (f"GroupRegistry(world={self._layout.world_size}, roles={list(self.role_names)}, "
                f"state={self._state.value!r})")

    # ------------------------------------------------------------------------------- teardown
    @serialized
    def close(self) -> None:
        """Destroy every generation's groups, stop the heartbeat, delete the store keys.
        Idempotent, local.

        The registry is unusable after, and so is every handle it gave out
        (:class:`~commgroups.errors.RegistryClosedError`). A retired generation whose groups could
        not be interrupted (gloo off Linux) stays referenced: destroying it may block on a dead peer.
        """
        if self._state is RegistryState.CLOSED:
            return
        # The starter thread sends generation 0's note that this rank is done creating, which
        # destroy() waits for on every rank, on the connection the starter uses.
        self._recovery.wait_started()
        if self._current is not None and not self._current.ended:
            self._current.destroy()
            self._recovery.linger(self._current.lingering)
        members = self.members
        member = self._rank in members
        self._recovery.close(self._number, bool(members) and members[0] == self._rank,
                             members if member else ())
        self._state = RegistryState.CLOSED

    def __enter__(self) -> Self:
        if self._state is RegistryState.NEW:
            self.create()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
