"""The GroupRegistry: owns every process group a training job uses, one dedicated group per role.

Creation is collective and happens in one place: ranks first agree on the plan's fingerprint (so a
disagreement is an error on every rank, not a hang), then every rank makes the same creation calls in
the same order. A role's group is never the default group, not even when the role spans the world.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import Self

from commgroups import torch_internals
from commgroups.backends import BackendAdapter, resolve_backend
from commgroups.creation.agreement import agree, store_calls
from commgroups.creation.meshes import axes_in_order, build_mesh, forget_flattenings, register_flattening
from commgroups.creation.role_groups import (
    CREATION_MODES,
    CreatedRole,
    CreationContext,
    choose_method,
    create_role_group,
    creation_order,
    decide_local,
    local_vote,
    nonmember_split_hazard,
)
from commgroups.creation.store_keys import AttemptStore, open_attempt
from commgroups.errors import (
    BackendUnavailableError,
    CommGroupsError,
    DimOrderError,
    GroupCreationError,
    LayoutError,
    NotAMemberError,
    RebuildError,
    RegistryClosedError,
    RegistryStateError,
    StaleGenerationError,
    UnknownDimError,
    WorldSizeMismatchError,
)
from commgroups.layout import limits
from commgroups.layout.auto_layout import AutoLayout, job_layout
from commgroups.layout.specs import Layout, RoleSpec
from commgroups.planning.plan import RolePlan, plan
from commgroups.rank_loss.check_in import check_in
from commgroups.rank_loss.rebuild_report import RebuildReport
from commgroups.rank_loss.replan import as_rank_array, replan_arrays
from commgroups.rank_loss.shrink import Spine, prepare_spine
from commgroups.util.call_sites import call_site
from commgroups.util.text_table import format_ranks, format_table

if TYPE_CHECKING:
    from commgroups.collectives.role_collectives import RoleCollectives

__all__ = ["GroupRegistry"]

logger = logging.getLogger(__name__)

DEFAULT_CREATE_TIMEOUT_S = 300.0
STORE_PREFIX = "commgroups"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialized(
    method: Callable[Concatenate[GroupRegistry, _P], _R],
) -> Callable[Concatenate[GroupRegistry, _P], _R]:
    """Run ``method`` under the registry's lock: one thread at a time creates, meshes or closes.

    Creation is collective (every rank, same order); two threads of one rank racing into it would
    meet each other's agreement keys and time out. Serialised, the second thread finds the first
    one's result (a mesh is cached) or a clear state error.
    """

    @functools.wraps(method)
    def locked(self: GroupRegistry, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _same_device(a: BackendAdapter, b: BackendAdapter) -> bool:
    """Whether groups of ``a`` and ``b`` can serve one DeviceMesh (one device type)."""
    return a.serves_every_device or b.serves_every_device or a.device_type == b.device_type


def _set_group_timeout(created: CreatedRole, timeout: timedelta) -> None:
    """Give ``created``'s group (if this rank has one) a new collective timeout, in place."""
    if created.group is not None and created.adapter.has_timeout:
        # Updates the group's backend in place; collectives issued from now on read it.
        torch_internals.set_group_timeout(created.group, timeout)


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
    ``(2, 3)`` on ranks 2 and 3; ``registry.ranks("dp_shard")`` is ``(0, 2)`` on ranks 0 and 2 and
    ``(1, 3)`` on ranks 1 and 3; ``registry.ranks("fsdp")`` is ``(0, 1, 2, 3)`` everywhere, on a
    dedicated group that is not the default group.

    Args:
        layout: the validated layout; an :class:`~commgroups.AutoLayout` is resolved with
            ``torch.distributed``'s world size (restart mode), so create the registry after
            ``init_process_group``.
        creation_mode: ``auto`` (fastest safe path per role), ``all_ranks``, ``local`` or
            ``split``; :meth:`creation_method` says which path each role actually took.
        create_timeout_s: how long ranks wait for each other to agree on the plan before every rank
            raises :class:`~commgroups.errors.AgreementTimeoutError`.
    """

    def __init__(
        self,
        layout: Layout | AutoLayout,
        *,
        creation_mode: str = "auto",
        create_timeout_s: float = DEFAULT_CREATE_TIMEOUT_S,
    ) -> None:
        if isinstance(layout, AutoLayout):  # restart mode: the "auto" dim's size is the world's
            layout = job_layout(layout)
        if not isinstance(layout, Layout):
            raise TypeError(
                f"GroupRegistry needs a commgroups.Layout, got {type(layout).__name__}; "
                "fix: build one with cg.Layout(...) or cg.load_layout(path)"
            )
        if creation_mode not in CREATION_MODES:
            raise LayoutError(
                f"creation_mode: unknown mode {creation_mode!r}; fix: use one of "
                f"{', '.join(CREATION_MODES)}",
                field="creation_mode",
            )
        # A bool, nan or inf here would validate and then fail inside create() with a raw error.
        create_timeout_s = limits.check_timeout(create_timeout_s, "create_timeout_s")
        self.layout = layout
        self.plan = plan(layout)
        self.creation_mode = creation_mode
        self.create_timeout_s = create_timeout_s
        self._rank = -1
        self._created: dict[str, CreatedRole] = {}
        self._dim_groups: dict[str, CreatedRole] = {}
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._timeout_overrides: dict[str, timedelta] = {}
        self._collectives: dict[str, RoleCollectives] = {}
        self._attempts: list[AttemptStore] = []  # store namespaces to clean on close()
        self._lock = threading.RLock()
        self._creator = threading.current_thread()  # owns the role handles (RoleCollectives)
        self._creator_site = ""
        self._state = "new"
        self._generation = 0
        self._retired: list[CreatedRole] = []  # kept referenced, never destroyed (dead peers)
        self._rebuild_attempts = 0  # failed rebuild attempts toward the next generation
        self._registry_id = -1  # the agreement epoch of create(): the same on every rank
        self._retired_roles: dict[str, CreatedRole] = {}  # the last retired generation's roles
        self._mesh_names: list[tuple[str, ...]] = []  # meshes to rebuild, in the order asked
        self._spine: Spine | None = None  # bound NCCL: what rebuild() shrinks (commgroups.rank_loss.shrink)

    # --------------------------------------------------------------------------------- creation
    @_serialized
    def create(self) -> Self:
        """Create every role's dedicated group. Collective: every rank must call it.

        Raises the same LayoutError subclass on every rank when the layout is invalid for this job or
        when ranks disagree, before any group exists.
        """
        if self._state == "created":
            raise RegistryStateError("create() was already called on this registry")
        if self._state == "closed":
            raise RegistryClosedError("this registry was closed; make a new GroupRegistry")
        if not dist.is_available() or not dist.is_initialized():
            raise RegistryStateError(
                "torch.distributed is not initialized; fix: call "
                "torch.distributed.init_process_group() (or run under torchrun) before create()"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        self._rank = rank
        default_backend = str(dist.get_backend())
        local_error: CommGroupsError | None = None
        if self.layout.world_size != world:
            local_error = WorldSizeMismatchError(
                f"dims: the layout's world size is {self.layout.world_size} "
                f"({' x '.join(f'{k}={v}' for k, v in self.layout.dims.items())}) but the job has "
                f"{world} ranks; fix: make the product of dims equal {world}",
                field="dims",
            )
        adapters: dict[str, BackendAdapter] = {}
        methods: dict[str, str] = {}
        context = CreationContext.detect()
        if local_error is None:
            try:
                for role in self.layout.roles:
                    info = self.plan.role(role.name)
                    adapter = resolve_backend(role.backend, default_backend,
                                              info.group_size if info.regular else None,
                                              context.device_backend)
                    adapter.check_available()
                    adapters[role.name] = adapter
                    methods[role.name] = choose_method(self.creation_mode, info, adapter, context)
            except BackendUnavailableError as error:
                local_error = error
        payload: dict[str, Any] = {
            "layout": self.plan.canonical(),
            "backends": {name: adapter.name for name, adapter in adapters.items()},
            "creation": methods,
            "world_size": world,
            "error": f"{type(local_error).__name__}: {local_error}" if local_error else None,
        }
        # Regular roles first: keeps every rank's group count equal while local roles are created.
        order = creation_order(self.plan, methods)
        store: AttemptStore | None = None
        if default_backend != "fake":
            # One process simulates the world under the fake backend: there is nobody to disagree.
            store = self._agreement_store(rank)
            methods = self._agree(store, rank, world, payload, order, methods,
                                  vote=local_error is None)
        if local_error is not None:
            raise local_error

        self._creator = threading.current_thread()
        self._creator_site = call_site(sys._getframe(1))
        self._created = self._create_groups(order, adapters, methods, store, "the end of create()",
                                            context)
        if store is not None:
            self._attempts.append(store)
            self._registry_id = store.epoch
        self._state = "created"
        return self

    def _create_groups(
        self,
        infos: list[RolePlan],
        adapters: dict[str, BackendAdapter],
        methods: dict[str, str],
        store: AttemptStore | None,
        what: str,
        context: CreationContext | None = None,
    ) -> dict[str, CreatedRole]:
        """Create the groups of ``infos`` in order: the one creation path (roles and mesh dims).

        Collective over all ranks, after agreement (which settled ``methods``, local creation's safety
        included): creates each group under ``create_timeout_s``, then, where a backend connects on
        creation, notes in the attempt's store that this rank is done (no wait: ``close()`` waits
        for the others before destroying, see :meth:`AttemptStore.note_created`; ``what`` names
        that point in errors). On failure it destroys what it made and raises
        :class:`GroupCreationError` naming the role or step.
        """
        world = self.layout.world_size
        context = context if context is not None else CreationContext.detect()
        for info in infos:  # the same inputs on every rank: the same error, before any group
            hazard = nonmember_split_hazard(info, adapters[info.name], methods[info.name], context)
            if hazard is not None:
                raise GroupCreationError(
                    f"rank {self._rank}: {hazard}; nothing was created. fix: give the role backend "
                    "'device' (its groups then split like the others), let it be created by its "
                    "members only (creation_mode 'auto' on a regular role, made in the same order "
                    "on every rank), do not bind the default group (init_process_group without "
                    "device_id), or use torch >= 2.15"
                )
        started = time.monotonic()
        created: dict[str, CreatedRole] = {}
        current: RolePlan | None = None
        try:
            for current in infos:
                created[current.name] = self._create_one(
                    current, adapters[current.name], methods[current.name]
                )
            current = None
            # Only where a backend connects on creation (gloo; NCCL eager init): single-rank and
            # fake groups have no peer that could still be connecting.
            if store is not None and any(adapters[info.name].connects_on_create for info in infos):
                with store_calls(store, self._position, started, what):
                    store.note_created(world, started + self.create_timeout_s)
        except Exception as error:
            # Leave nothing half-made: destroy what this rank created, then say what failed.
            self._destroy_groups(created.values())
            step = (f"creating role {current.name!r} ({methods[current.name]})"
                    if current is not None else f"noting the end of creation at {what}")
            raise GroupCreationError(
                f"rank {self._rank}: {step} failed: {error}; fix: check that every rank is alive "
                "and makes the same registry calls in the same order; creation waits at most "
                f"create_timeout_s={self.create_timeout_s:g}s for peers"
            ) from error
        return created

    def _create_one(self, info: RolePlan, adapter: BackendAdapter, method: str) -> CreatedRole:
        spec = info.spec
        timeout = (adapter.default_timeout() if spec.timeout_s is None
                   else timedelta(seconds=spec.timeout_s))
        # Groups that rendezvous on creation do it under the group's own timeout (30 minutes by
        # default): a peer that died during create() would hang the others that long. Create under
        # create_timeout_s, then give the group its role timeout.
        bounded = adapter.connects_on_create and timeout.total_seconds() > self.create_timeout_s
        # After a shrink rebuild, device groups come from the spine, never the default group.
        make = create_role_group if self._spine is None else self._spine.creator(adapter)
        created = make(
            self.plan, info, adapter, spec.options,
            self.create_timeout_s if bounded else timeout.total_seconds(),
            self._rank, method,
            group_desc=info.name if info.name in self.layout.role_names else f"mesh-{info.name}",
        )
        if bounded:
            _set_group_timeout(created, timeout)
        logger.debug("rank %d: created %s via %s", self._rank, info.name, method)
        return created

    def _agree(self, store: AttemptStore, rank: int, world: int, payload: dict[str, Any],
               order: list[RolePlan], methods: dict[str, str], vote: bool = True) -> dict[str, str]:
        """Agree on ``payload`` and, in the same store round, on whether local creation is safe;
        returns the methods to create with. ``rank`` and ``world``: this rank's position and the
        size of the current generation's layout (the agreement's numbering). ``vote=False``: this
        rank holds an error that the agreement reports (its methods may be incomplete), so it casts
        no local vote."""
        ballot = local_vote(self.plan, order, methods, self._rank, world) if vote else None
        verdict = agree(store, rank, world, payload, timedelta(seconds=self.create_timeout_s),
                        finish=store.finish, ballot=ballot,
                        counter=torch_internals.next_counter_name() or "")
        decided = decide_local(methods, ballot, verdict, rank)
        every_rank = sorted(role for role, method in decided.items() if method != "local")
        if vote and verdict.counter_split and every_rank:
            # torch names a group every rank makes by a per-process counter: with counters apart,
            # each rank would wait for the others under its own name until create_timeout_s.
            raise GroupCreationError(
                f"rank {self._rank}: {verdict.counter_split} rank(s) created a different number of "
                "process groups before this call than the first rank to arrive, so torch would "
                f"give the groups of {every_rank} (made by every rank) different names on "
                "different ranks and creating them would wait until create_timeout_s; nothing was "
                "created. fix: make every rank create the same process groups in the same order "
                "before this call (a group made on some ranks only, e.g. a DeviceMesh or new_group "
                "of a subset, moves torch's counter on those ranks alone)"
            )
        return decided

    # ---------------------------------------------------------------------------------- rebuild
    @property
    def generation(self) -> int:
        """0 after :meth:`create`; one more after each successful :meth:`rebuild`."""
        return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """The global rank at each position of the current layout (``0 .. world - 1`` at first)."""
        members = self.plan.members
        return members if members is not None else tuple(range(self.layout.world_size))

    @_serialized
    def rebuild(
        self,
        alive: Iterable[int] | None = None,
        *,
        timeout: float | timedelta | None = None,
    ) -> RebuildReport:
        """After a rank loss: rebuild every role on the survivors. Collective over the survivors.

        Call it on every surviving rank after a role's collective failed (a peer died). The
        survivors check in through the store (a rank that misses the check-in window counts as
        lost; every survivor gets the same set or the same error), :func:`commgroups.rank_loss.replan` derives
        the smaller layout from the layout's ``elastic`` section, the old generation's groups are
        retired (aborted where the backend can; never destroyed, since they hold a dead peer), and
        every role, mesh-dim group and mesh asked for before is created again on the survivors
        only, with its own backend, options and timeout (never the default group, which still
        holds the dead rank). Handles of the old generation (``collectives(role)``) raise
        :class:`~commgroups.errors.StaleGenerationError`; take them again.

        Args:
            alive: the global ranks known to be alive, this one included (e.g. from the failure
                report of a launcher); the check-in then ends as soon as they are all in. None:
                every rank of the old generation is waited for until the window closes.
            timeout: the check-in window in seconds (or a timedelta), counted from this rank's
                check-in; it must cover the time every survivor takes to notice the loss. Default:
                twice the longest collective timeout of the registry's roles (give short role
                timeouts to a job that should rebuild quickly, or pass ``alive``).

        Returns:
            A :class:`~commgroups.rank_loss.rebuild_report.RebuildReport`: the new generation, layout, the
            lost ranks, spares, this rank's place and the seconds of each phase. A rank the new
            layout has no place for is a spare or dropped: its registry holds no groups.

        Raises:
            ReplanError: the survivors cannot form the layout (a lost rank in a dim that may not
                shrink); raised on every survivor, nothing retired.
            RebuildError: this rank checked in too late (the others rebuilt without it), ``alive``
                is malformed, or a backend cannot be rebuilt in place here.
            GroupCreationError: a survivor died during the rebuild; call ``rebuild()`` again.
            StoreUnreachableError: the store's host died; the job cannot meet without it.
        """
        seconds: dict[str, float] = {}
        started = time.monotonic()
        if self._state not in ("created", "retired"):
            raise RebuildError(
                f"rebuild() needs a created registry (this one is {self._state}); fix: call it "
                "after create() succeeded, on every survivor"
            )
        known = None if alive is None else self._check_alive(alive)
        self._check_rebuildable()
        window = self._check_in_window(timeout)
        survivors: np.ndarray
        if str(dist.get_backend()) == "fake":
            if known is None:
                raise RebuildError("rebuild() under the fake backend simulates one rank: pass "
                                   "alive= (there is nobody to check in with)")
            survivors = known
        else:
            prefix = (f"{STORE_PREFIX}/rebuild/{self._registry_id}/{self._generation + 1}/"
                      f"{self._rebuild_attempts}/")
            self._rebuild_attempts += 1
            survivors = np.asarray(check_in(
                torch_internals.default_store(), prefix, self._rank, self.members, window,
                None if known is None else known.tolist()), dtype=np.int64)
        seconds["check_in"] = time.monotonic() - started
        mark = time.monotonic()
        # Arrays from here on: at 65,536 ranks each Python step per rank (a tuple built, a
        # membership test on one) costs milliseconds.
        decision = replan_arrays(self.layout, self.plan.positions(survivors))
        new_members_array = self.plan.global_ranks(decision.ranks)
        lost, spares, dropped = (tuple(self.plan.global_ranks(positions).tolist())
                                 for positions in (decision.lost, decision.spares,
                                                   decision.dropped))
        new_plan = plan(decision.layout, new_members_array)
        seconds["replan"] = time.monotonic() - mark

        mark = time.monotonic()
        if self._spine is not None:  # taken from its role before the retire would abort it
            self._spine = self._spine.retarget(new_plan.members or (), self._rank)
        self._retire()
        seconds["retire"] = time.monotonic() - mark
        if not bool(new_plan.holds(np.array([self._rank]))[0]):
            self._generation += 1
            self._state = "spare" if self._rank in spares else "dropped"
            return RebuildReport(self._generation, decision.layout, new_plan.members or (),
                                 lost, spares, dropped, self._state, seconds)

        mark = time.monotonic()
        old_layout, old_plan = self.layout, self.plan
        self.layout, self.plan = decision.layout, new_plan
        try:
            self._created = self._create_generation(len(lost))
        except BaseException:
            self.layout, self.plan = old_layout, old_plan  # the next attempt replans from here
            raise
        for role, value in self._timeout_overrides.items():
            _set_group_timeout(self._created[role], value)
        self._generation += 1
        self._rebuild_attempts = 0
        self._state = "created"
        seconds["create"] = time.monotonic() - mark

        mark = time.monotonic()
        for names in self._mesh_names:
            self.device_mesh(names)
        seconds["meshes"] = time.monotonic() - mark
        logger.info("rank %d: rebuilt generation %d on %d ranks in %.3fs", self._rank,
                    self._generation, new_plan.world_size, time.monotonic() - started)
        return RebuildReport(self._generation, decision.layout, self.members, lost, spares,
                             dropped, "member", seconds)

    def _check_alive(self, alive: Iterable[int]) -> np.ndarray:
        """``alive`` as a sorted int64 array of distinct ranks of the current generation, this one
        included; else a RebuildError naming what is wrong."""
        try:
            given = as_rank_array(alive)
        except (TypeError, ValueError):
            raise RebuildError(f"alive: {limits.short_repr(alive)} is not a list of global "
                               "ranks; fix: pass e.g. alive=[0, 1, 3]") from None
        ranks = np.sort(given)
        if ranks.size:  # duplicates ignored (masks, not np.unique: see replan)
            ranks = ranks[np.concatenate(([True], ranks[1:] != ranks[:-1]))]
        outside = ranks[~self.plan.holds(ranks)].tolist()
        index = int(np.searchsorted(ranks, self._rank))
        if outside or index >= ranks.size or int(ranks[index]) != self._rank:
            raise RebuildError(
                f"alive: {format_ranks(ranks.tolist())} must be global ranks of the current "
                f"generation ({format_ranks(self.members)}) and include this rank ({self._rank}); "
                f"{'outside: ' + format_ranks(outside) if outside else 'this rank is missing'}; "
                "fix: pass the survivors' global ranks, or alive=None to let them check in"
            )
        return ranks

    def _check_rebuildable(self) -> None:
        """Refuse, on every rank alike, backends whose groups cannot be made without the dead rank.

        A bound default group (``init_process_group(device_id=...)``) gave the device backend's
        roles by ncclCommSplit of its communicator, which still holds the dead rank. There the
        rebuild shrinks a non-default world group the registry owns instead (never the default
        group) and splits every device role from it: :func:`commgroups.rank_loss.shrink.prepare_spine`
        finds that group or raises the refusal naming what is missing (the shrink capability, a
        role spanning the world) and the fix.
        """
        self._spine = prepare_spine(self._generation_roles(), self.plan, self._spine,
                                    CreationContext.detect())

    def _generation_roles(self) -> dict[str, CreatedRole]:
        """The roles of the generation being rebuilt from: live, or retired by a failed rebuild."""
        return self._created if self._state == "created" else self._retired_roles

    def _check_in_window(self, timeout: float | timedelta | None) -> timedelta:
        if timeout is None:
            # A survivor notices the loss at its collective's timeout at the latest, and one whose
            # peers left a collective early may wait out one more: twice the longest role timeout.
            longest = max((self._role_timeout(name, created.adapter).total_seconds()
                           for name, created in self._generation_roles().items()),
                          default=self.create_timeout_s)
            return timedelta(seconds=2 * longest)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        return timedelta(seconds=limits.check_timeout(seconds, "timeout"))

    def _role_timeout(self, role: str, adapter: BackendAdapter) -> timedelta:
        if role in self._timeout_overrides:
            return self._timeout_overrides[role]
        spec = self.spec(role)
        if spec.timeout_s is None:
            return adapter.default_timeout()
        return timedelta(seconds=spec.timeout_s)

    def _retire(self) -> None:
        """Retire the current generation: handles go stale, meshes are forgotten, groups aborted
        where the backend can (kept referenced otherwise: destroying one with a dead peer may
        block on it)."""
        if self._state != "created":
            return
        for handle in self._collectives.values():
            handle.retire(self._generation)
        self._collectives.clear()
        self._retired_roles = dict(self._created)
        for created in [*self._created.values(), *self._dim_groups.values()]:
            for group in created.owned:
                created.adapter.abort(group)
            self._retired.append(created)
        self._mesh_names = list(self._meshes)
        for mesh in self._meshes.values():
            forget_flattenings(mesh)
        if self._meshes:
            torch_internals.clear_dtensor_caches()
        self._meshes.clear()
        self._created = {}
        self._dim_groups = {}
        # The old generation's store namespaces include the lost ranks, which never release them.
        self._attempts.clear()
        self._state = "retired"

    def _create_generation(self, lost: int) -> dict[str, CreatedRole]:
        """Create every role on the current (rebuilt) plan's members: agreement, then creation."""
        default_backend = str(dist.get_backend())
        context = CreationContext.detect()
        # split_group needs every rank of its parent (the default group, which holds the lost
        # ranks): member-only creation where it is safe, all_ranks among the survivors otherwise.
        mode = "all_ranks" if self.creation_mode == "all_ranks" else "local"
        adapters: dict[str, BackendAdapter] = {}
        methods: dict[str, str] = {}
        for role in self.layout.roles:
            info = self.plan.role(role.name)
            adapter = resolve_backend(role.backend, default_backend,
                                      info.group_size if info.regular else None,
                                      context.device_backend)
            adapter.check_available()  # also registers backends commgroups provides
            adapters[role.name] = adapter
            methods[role.name] = choose_method(mode, info, adapter, context)
        order = creation_order(self.plan, methods)
        if self._spine is not None:  # device roles split from the shrunk spine, after the others
            order, methods = self._spine.arrange(order, methods, adapters)
        store: AttemptStore | None = None
        if default_backend != "fake":
            store = self._agreement_store(self._rank)
            payload: dict[str, Any] = {
                "layout": self.plan.canonical(),
                "members": list(self.members),
                "generation": self._generation + 1,
                "lost": lost,
                "backends": {name: adapter.name for name, adapter in adapters.items()},
                "creation": methods,
                "world_size": self.layout.world_size,
                "error": None,
            }
            methods = self._agree(store, self._position, self.layout.world_size, payload, order,
                                  methods)
        created = self._create_groups(order, adapters, methods, store,
                                      f"the end of rebuild() (generation {self._generation + 1})",
                                      context)
        if store is not None:
            self._attempts.append(store)
        return created

    @property
    def _position(self) -> int:
        """This rank's position in the current generation's layout (its global rank at first)."""
        return self.plan.position(self._rank)

    def _agreement_store(self, rank: int) -> AttemptStore:
        # One shared attempt counter, not a count per rank: after a rank skipped an attempt (the
        # others gave it up), every rank's next create() meets in the same fresh namespace.
        root = torch_internals.default_store()
        with store_calls(root, rank, time.monotonic(), "the start of GroupRegistry.create()"):
            return open_attempt(root, STORE_PREFIX)

    # ----------------------------------------------------------------------------------- access
    def _check_usable(self) -> None:
        if self._state == "closed":
            raise RegistryClosedError(
                "this registry was closed and its groups destroyed; make a new GroupRegistry"
            )
        if self._state == "retired":
            raise StaleGenerationError(
                f"generation {self._generation} of this registry was retired by rebuild() and the "
                "next one was not made (the rebuild failed); fix: call registry.rebuild() again on "
                "every survivor",
                role=None, generation=self._generation,
            )
        if self._state in ("spare", "dropped"):
            raise RegistryStateError(
                f"rank {self._rank} was left out of generation {self._generation} as "
                f"{'a spare' if self._state == 'spare' else 'dropped'} (the smaller layout has no "
                "place for it); it holds no groups. fix: check rebuild()'s report before using the "
                "registry" + ("; a dropped rank should exit" if self._state == "dropped" else "")
            )
        if self._state != "created":
            raise RegistryStateError(
                "the registry has no groups yet; fix: call registry.create() on every rank first"
            )

    @property
    def role_names(self) -> tuple[str, ...]:
        """Role names in declaration order."""
        return self.layout.role_names

    @property
    def created(self) -> bool:
        """True between a successful create() and close()."""
        return self._state == "created"

    def spec(self, role: str) -> RoleSpec:
        """The RoleSpec of ``role``; KeyError listing the known roles otherwise."""
        return self.layout.role(role)

    def group(self, role: str) -> dist.ProcessGroup:
        """This rank's dedicated ProcessGroup for ``role`` (never the default group).

        Args:
            role: a role of the layout.

        Returns:
            The group of ``role`` that holds this rank, made by :meth:`create`.

        Raises:
            KeyError: ``role`` is not in the layout (the message lists the roles).
            NotAMemberError: ``role`` has explicit rank groups and none holds this rank.
            RegistryStateError: :meth:`create` has not run yet (RegistryClosedError after close).

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})`` on 4 ranks:
        ``dist.get_process_group_ranks(registry.group("cp"))`` is ``[0, 1]`` on ranks 0 and 1,
        ``[2, 3]`` on ranks 2 and 3.
        """
        self.spec(role)
        self._check_usable()
        group = self._created[role].group
        if group is None:
            raise NotAMemberError(
                f"rank {self._rank} is in no group of role {role!r} (its ranks are "
                f"{self.layout.role(role).ranks}); fix: only call group({role!r}) on member ranks"
            )
        return group

    def ranks(self, role: str) -> tuple[int, ...]:
        """Global ranks of this rank's group for ``role``, ascending (same errors as :meth:`group`).

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})``: ``registry.ranks("dp_shard")`` is
        ``(0, 2)`` on ranks 0 and 2, ``(1, 3)`` on ranks 1 and 3.
        """
        self.spec(role)
        self._check_usable()
        ranks = self.plan.group_of(role, self._rank)
        if ranks is None:
            raise NotAMemberError(f"rank {self._rank} is in no group of role {role!r}")
        return ranks

    def process_groups(self) -> dict[str, dist.ProcessGroup]:
        """Every group of this registry that holds this rank, by what it serves.

        Returns:
            Role name -> the role's group (roles whose groups do not hold this rank are left
            out), and ``mesh-<dim>`` -> the dedicated group of a mesh dim that no role covers
            (made by :meth:`device_mesh` on first use). The audit reads this to tell the
            registry's groups from any other.

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})`` after ``device_mesh(["dp_shard",
        "cp"])``: keys ``dp_shard``, ``cp``, ``fsdp``, ``checkpoint-metadata`` (the mesh dims use
        the roles' groups, so no ``mesh-`` entry).
        """
        self._check_usable()
        groups = {name: created.group for name, created in self._created.items()
                  if created.group is not None}
        groups.update({f"mesh-{dim}": created.group for dim, created in self._dim_groups.items()
                       if created.group is not None})
        return groups

    def backend(self, role: str) -> str:
        """The backend ``role`` resolved to on this machine (nccl, rccl, hccl, gloo or fake)."""
        self.spec(role)
        self._check_usable()
        return self._created[role].adapter.name

    def creation_method(self, role: str) -> str:
        """How ``role``'s groups were created here (all_ranks, local or split)."""
        self.spec(role)
        self._check_usable()
        return self._created[role].method

    def timeout(self, role: str) -> timedelta:
        """The collective timeout of ``role``'s group: its spec's, or the last set_timeout()."""
        self.spec(role)
        self._check_usable()
        return self._role_timeout(role, self._created[role].adapter)

    def set_timeout(self, timeout: float | timedelta, role: str | None = None) -> None:
        """Change the collective timeout of one role's group, or of every group the registry made.

        Like ``torch.distributed.set_timeout(timeout, group)``: the new timeout applies to
        collectives issued after the call; one already in flight keeps the timeout it started with.
        The change is local to this rank (no communication, no barrier, so it cannot hang): call it
        on every rank, between steps, so that all ranks of a group time out alike. The layout (and
        its fingerprint) is unchanged.

        Args:
            timeout: seconds (> 0) or a ``timedelta``.
            role: the role whose group changes; None: every role and every dedicated mesh-dim
                group (what a trainer wants after its first step).

        Example::

            registry.set_timeout(timedelta(minutes=5))       # every group this registry made
            registry.set_timeout(30, role="cp")              # only cp's group
        """
        if role is not None:
            self.spec(role)
        self._check_usable()
        seconds = limits.check_timeout(
            timeout.total_seconds() if isinstance(timeout, timedelta) else timeout, "timeout_s")
        new = timedelta(seconds=seconds)
        names = self.role_names if role is None else (role,)
        targets = [self._created[name] for name in names]
        if role is None:
            targets += self._dim_groups.values()
        for created in targets:
            _set_group_timeout(created, new)
        self._timeout_overrides.update(dict.fromkeys(names, new))
        logger.info("rank %d: timeout of %s set to %ss", self._rank,
                    "every group" if role is None else f"role {role}", seconds)

    @_serialized
    def collectives(self, role: str) -> RoleCollectives:
        """The torch.distributed collective API on ``role``'s group, without ``group=``.

        Every call is issued ``async_op=True`` and waited at once (unless the role's ``async_and_wait`` is
        off); a caller that asks for ``async_op=True`` gets the Work back unwaited. The handle issues
        from the thread that ran :meth:`create` only (another thread gets
        :class:`~commgroups.errors.ConcurrentRoleUseError` unless it calls ``adopt()``), and
        refuses to run after :meth:`close`.
        """
        from commgroups.collectives.role_collectives import RoleCollectives

        group = self.group(role)
        # One object per role, so its call count (the sequence number errors name) is per role.
        if role not in self._collectives:
            # Owned by the thread that ran create(): decided by program order, the same on every
            # rank, never by which thread happens to call first (see RoleCollectives._enter).
            self._collectives[role] = RoleCollectives(
                group, role=role, async_and_wait=self.spec(role).async_and_wait,
                owner=self._creator, owner_site=self._creator_site,
            )
        return self._collectives[role]

    # ----------------------------------------------------------------------------------- meshes
    @_serialized
    def device_mesh(self, dims_or_role: str | Sequence[str]) -> DeviceMesh:
        """A DeviceMesh over the registry's own groups, named by what was asked for.

        ``dims_or_role`` is one name or a sequence of names, each a role over dims or a layout dim
        (a name that is both means the role). A dim uses the group of the role whose dims are
        exactly ``[dim]``, or else a dedicated group created on first use (that call is then
        collective: make it on every rank in the same order). A role is one mesh axis on the
        role's own group, its dims flattened row-major: this is how fsdp over dp_shard x cp is
        meshed, never with ``_flatten()``, and how HSDP gets ``device_mesh(["dp_replicate",
        "fsdp"])``. Names must cover disjoint dims in layout order; dims may come from the layout's
        ``dims`` or from a view. Meshes are cached: the same names give the same object (torch
        compares meshes by layout, third-party code sometimes by identity). Every run of axes that
        a role spans is pre-registered as that role's flattening (see
        :func:`commgroups.creation.meshes.register_flattening`).

        Args:
            dims_or_role: a dim or role name, or a sequence of them (outermost first).

        Returns:
            A DeviceMesh whose dim ``i`` is named ``names[i]`` and runs on the registry's group.

        Raises:
            UnknownDimError: a name is neither a dim nor a role.
            DimOrderError: the names overlap or are out of layout order.

        Example: ``Layout(dims={"dp_shard": 2, "cp": 2})`` on 4 ranks:
        ``registry.device_mesh(["dp_shard", "cp"])`` is the mesh ``[[0, 1], [2, 3]]`` on every rank,
        its ``cp`` groups ``(0, 1)`` / ``(2, 3)`` and ``dp_shard`` groups ``(0, 2)`` / ``(1, 3)``;
        ``registry.device_mesh("fsdp")`` is the 1-D mesh ``[0, 1, 2, 3]`` on the fsdp role's group.
        """
        self._check_usable()
        names = (dims_or_role,) if isinstance(dims_or_role, str) else (
            tuple(dims_or_role) if isinstance(dims_or_role, (list, tuple)) else ())
        if not names or not all(isinstance(name, str) for name in names):
            raise LayoutError(
                f"device_mesh: {limits.short_repr(dims_or_role)} is not a dim or role name, nor a "
                "list of them; fix: e.g. registry.device_mesh(['dp_shard', 'cp']) or "
                "registry.device_mesh('fsdp')",
                field="dims",
            )
        if names not in self._meshes:
            axes = [self._mesh_axis(name) for name in names]
            self._check_mesh_axes(names, [dims for dims, _, _ in axes])
            device_types = {adapter.device_type for _, adapter, _ in axes
                            if not adapter.serves_every_device}
            if not device_types:  # every axis is a single-rank group: the job's device type
                device_types = {resolve_backend("device", str(dist.get_backend())).device_type}
            if len(device_types) != 1:
                raise LayoutError(
                    f"device_mesh: {list(names)} use groups on different device types "
                    f"{sorted(device_types)}; fix: give those roles the same backend",
                    field="dims",
                )
            mesh = build_mesh(
                self.plan, self._rank, [dims for dims, _, _ in axes],
                [group for _, _, group in axes], device_types.pop(), names,
            )
            self._register_flattenings(mesh, names, [dims for dims, _, _ in axes])
            self._meshes[names] = mesh
        return self._meshes[names]

    def _register_flattenings(self, mesh: DeviceMesh, names: tuple[str, ...],
                              axes: list[tuple[str, ...]]) -> None:
        """Pre-register, for every run of axes a compute role spans, ``mesh[run]._flatten()`` as it.

        Under torch's default name (``"_".join(run)``) and under the role's name, so code that
        flattens the mesh it was handed (FSDP2's ``dp_mesh_dims``) gets the role's dedicated group,
        never a new one (the default group when the run spans the world).

        Only roles whose ``purpose`` is ``compute`` and whose groups live on the mesh's device are
        registered: DTensor's redistribute looks flattenings up *by layout* and merges reductions
        over several mesh dims onto whatever it finds, so a checkpoint-metadata gloo group
        registered here would carry model traffic (torchtitan's gradient-norm reduction did, every
        step). Without a matching flattening DTensor issues one reduction per mesh dim, as it does
        on a stock DeviceMesh.
        """
        by_dims = {
            self.plan.role(r).dim_names: r for r in self.role_names
            if self.spec(r).purpose == "compute"
            and (self._created[r].adapter.serves_every_device
                 or self._created[r].adapter.device_type == mesh.device_type)
        }
        for start in range(len(names)):
            for stop in range(start + 2, len(names) + 1):
                run_dims = tuple(d for axis in axes[start:stop] for d in axis)
                role = by_dims.get(run_dims)
                if role is None:
                    continue
                keys = {"_".join(names[start:stop]), role} - set(names)
                for key in sorted(keys):
                    if not register_flattening(mesh, names[start:stop], key, self.group(role)):
                        logger.info("this torch's DeviceMesh has no flatten mapping to fill: "
                                    "mesh[%s]._flatten() will create a new group",
                                    list(names[start:stop]))
                        return

    def _mesh_axis(
        self, name: str
    ) -> tuple[tuple[str, ...], BackendAdapter, dist.ProcessGroup]:
        """The dims, backend and group of one mesh axis named ``name`` (a role, else a dim)."""
        if name in self.role_names:
            if self.spec(name).purpose != "compute":
                raise LayoutError(
                    f"device_mesh: role {name!r} has purpose {self.spec(name).purpose!r}: its group "
                    "carries DCP's metadata exchange only and is never a mesh axis (DTensor would "
                    f"send model traffic over it); fix: use registry.group({name!r}) for DCP, or "
                    "a compute role or dims for the mesh",
                    field="dims",
                )
            dims = self.plan.role(name).dim_names
            if dims is None:
                raise LayoutError(
                    f"device_mesh: role {name!r} has explicit rank groups, which are not a mesh "
                    f"axis; fix: use registry.group({name!r}) directly",
                    field="dims",
                )
            return dims, self._created[name].adapter, self.group(name)
        if name in self.plan.all_dim_names:
            adapter, group = self._group_for_dim(name)
            return (name,), adapter, group
        raise UnknownDimError(
            f"device_mesh: {name!r} is neither a dim nor a role; dims: "
            f"{', '.join(self.plan.all_dim_names)}; roles: {', '.join(self.role_names)}",
            field="dims",
        )

    def _check_mesh_axes(self, names: tuple[str, ...], axes: list[tuple[str, ...]]) -> None:
        if not axes_in_order(self.plan, axes):
            raise DimOrderError(
                f"device_mesh: {list(names)} span dims {[list(a) for a in axes]}; they must be "
                "distinct and in layout order (outermost first; dims "
                f"{', '.join(self.layout.dims)}); fix: reorder or drop overlapping names",
                field="dims",
            )

    def _group_for_dim(self, dim: str) -> tuple[BackendAdapter, dist.ProcessGroup]:
        info = self.plan.dim_group(dim)
        default_backend = str(dist.get_backend())
        adapter = resolve_backend("device", default_backend, info.group_size)
        for role in self.layout.roles:
            if role.dims == [dim] and _same_device(self._created[role.name].adapter, adapter):
                return self._created[role.name].adapter, self.group(role.name)
        if dim not in self._dim_groups:
            adapter.check_available()
            methods = {dim: choose_method(self.creation_mode, info, adapter)}
            # Created on first use, so collective: ranks first agree on what they are creating.
            # Groups their members make alone (one rank) involve nobody else: no agreement.
            collective = default_backend != "fake" and not adapter.created_by_members
            store = self._agreement_store(self._rank) if collective else None
            if store is not None:
                methods = self._agree(
                    store, self._position, self.layout.world_size,
                    {"fingerprint": self.plan.fingerprint, "mesh_dim": dim, "creation": methods},
                    [info], methods)
            self._dim_groups.update(self._create_groups(
                [info], {dim: adapter}, methods, store, f"the creation of mesh dim {dim!r}"
            ))
            if store is not None:
                self._attempts.append(store)
        group = self._dim_groups[dim].group
        assert group is not None  # dims cover the world: every rank is in one group
        return adapter, group

    # ------------------------------------------------------------------------------- reporting
    def describe(self) -> str:
        """A readable table: each role's dims, backend, size, groups, this rank's ranks, timeout."""
        header = ("role", "dims", "backend", "size", "groups", "creation", "timeout", "async_and_wait",
                  "this rank's group")
        rows = []
        for name in self.role_names:
            spec = self.spec(name)
            info = self.plan.role(name)
            dims = "world" if spec.dims == "world" else ("x".join(info.dim_names) if info.dim_names
                                                          else "explicit")
            if self._state == "created":
                backend, method = self._created[name].adapter.name, self._created[name].method
                timeout = f"{self.timeout(name).total_seconds():g}s"
                mine = self.plan.group_of(name, self._rank)
                group_text = "-" if mine is None else format_ranks(mine)
            else:
                backend, method, group_text = spec.backend, "-", "-"
                timeout = "default" if spec.timeout_s is None else f"{spec.timeout_s:g}s"
            rows.append((name, dims, backend, str(info.group_size), str(info.num_groups), method,
                         timeout, "on" if spec.async_and_wait else "off", group_text))
        lines = format_table(header, rows)
        title = (f"GroupRegistry: world {self.layout.world_size} "
                 f"({', '.join(f'{k}={v}' for k, v in self.layout.dims.items())}), "
                 f"fingerprint {self.plan.fingerprint[:12]}, state {self._state}")
        return "\n".join([title, *lines])

    def __repr__(self) -> str:
        return (f"GroupRegistry(world={self.layout.world_size}, roles={list(self.role_names)}, "
                f"state={self._state!r})")

    # --------------------------------------------------------------------------------- teardown
    @_serialized
    def close(self) -> None:
        """Destroy every group this registry created and delete its store keys. Idempotent.

        The registry is unusable after, and so is every handle it gave out: a
        :class:`~commgroups.collectives.role_collectives.RoleCollectives` kept past ``close()`` raises
        :class:`~commgroups.errors.RegistryClosedError` instead of issuing on a destroyed group.
        Local: no rank waits for another (the last rank to close deletes the shared keys).
        """
        if self._state == "closed":
            return
        for handle in self._collectives.values():
            handle.close("the registry was closed")
        for attempt in self._attempts:
            attempt.wait_created()  # a peer may still be connecting to a group made just now
        self._destroy_groups([*self._created.values(), *self._dim_groups.values()])
        if self._spine is not None:
            self._spine.close()
            self._spine = None
        self._collectives.clear()
        if self._rank >= 0:
            for attempt in self._attempts:
                attempt.release(self._position, self.layout.world_size)
        self._attempts.clear()
        for mesh in self._meshes.values():
            forget_flattenings(mesh)
        if self._meshes:
            # DTensor caches its decisions by mesh, and compares meshes by layout and names: a
            # later mesh named like ours would get ours back, with destroyed groups.
            torch_internals.clear_dtensor_caches()
        self._meshes.clear()
        self._created.clear()
        self._dim_groups.clear()
        self._state = "closed"

    def _destroy_groups(self, created: Iterable[CreatedRole]) -> None:
        owned = [group for role in created for group in role.owned]
        if not (dist.is_available() and dist.is_initialized()):
            return  # the whole world was torn down already, our groups with it
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as error:  # already destroyed elsewhere
                logger.debug("destroying %s: %s", group, error)

    def __enter__(self) -> Self:
        if self._state == "new":
            self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

