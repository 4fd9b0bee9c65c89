"""Making a generation: agree on its request with every member, then create every group.

:func:`make_generation` is the one place communicators of a generation come from, for
``create()`` (generation 0) and for each ``rebuild()``; the :class:`~commgroups.generation.Generation`
it returns only looks groups up and ends them (HyperCommGrid keeps create apart from get the same
way). Collective over the generation's members; on failure nothing of the generation is left.

Example: ``make_generation(GenerationRequest(number=0, layout=Layout(dims={"dp": 2, "cp": 2}),
...))`` on 4 ranks agrees on the plan in a fresh store namespace, creates the groups of ``dp``,
``cp``, ``fsdp`` and ``checkpoint-metadata`` in one order on every rank, and opens the flight
recorder over them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commgroups import torch_internals
from commgroups.backends import BackendAdapter, resolve_backend
from commgroups.creation.agreement import OutcomeChannel, agree, store_calls
from commgroups.creation.descriptor_table import grow_ahead
from commgroups.creation.role_groups import (
    CreatedRole,
    choose_method,
    create_role_group,
    creation_order,
    decide_local,
    local_vote,
    nonmember_split_hazard,
    prefer_all_ranks,
)
from commgroups.creation.sockets import SocketLedger, detach_on_fork, gloo_descriptors
from commgroups.creation.store_keys import AttemptStore, open_attempt
from commgroups.errors import BackendUnavailableError, CommGroupsError, GroupCreationError
from commgroups.flight_recorder.session import open_flight
from commgroups.flight_recorder.settings import flight_enabled
from commgroups.generation.state import (
    STORE_PREFIX,
    Generation,
    GenerationRequest,
    destroy_groups,
    set_group_timeout,
)
from commgroups.planning.plan import Plan, RolePlan
from commgroups.util.error_text import first_fitting, listed

__all__ = ["agreement_store", "make_generation"]

logger = logging.getLogger(__name__)


def agreement_store(rank: int) -> AttemptStore:
    """A fresh store namespace for one creation attempt, shared by every rank.

    One shared attempt counter, not one per rank: after a rank skipped an attempt (the others
    gave it up), every rank's next creation meets in the same fresh namespace.
    """
    root = torch_internals.default_store()
    with store_calls(root, rank, time.monotonic(), "the start of GroupRegistry.create()"):
        return open_attempt(root, STORE_PREFIX)


def make_generation(request: GenerationRequest, local_error: CommGroupsError | None = None,
                    announce: bool = True) -> Generation:
    """Agree on the request with every member, then create every group. Collective.

    ``local_error``: an input error this rank found (world size, backend); it is voted with
    so every member raises the same error before any group exists. On failure nothing of this
    generation is left: what was made is destroyed and :class:`GroupCreationError` names the
    role or step. ``announce=False``: the store request saying this rank is done creating is
    left to :meth:`Generation.announce_created` (``create()``'s starter thread sends it).
    """
    plan, default_backend = request.plan, str(dist.get_backend())
    adapters: dict[str, BackendAdapter] = {}
    methods: dict[str, str] = {}
    infos: dict[str, RolePlan] = {}
    # split_group needs every rank of its parent (the default group, which holds the lost
    # ranks after a rank loss): a rebuild creates member-only where safe, else all_ranks.
    mode = request.mode if request.number == 0 else (
        "all_ranks" if request.mode == "all_ranks" else "local")
    if local_error is None:
        try:
            for role in request.layout.roles:
                info = infos[role.name] = plan.role(role.name)
                adapter = resolve_backend(role.backend, default_backend,
                                          info.group_size if info.regular else None,
                                          request.context.device_backend)
                adapter.check_available()  # also registers backends commgroups provides
                adapters[role.name] = adapter
                methods[role.name] = choose_method(mode, info, adapter, request.context)
            for dim in request.mesh_dims:
                info = infos[dim] = plan.dim_group(dim)
                adapter = resolve_backend("device", default_backend, info.group_size,
                                          request.context.device_backend)
                adapter.check_available()
                adapters[dim] = adapter
                methods[dim] = choose_method(mode, info, adapter)
        except BackendUnavailableError as error:
            if request.number > 0:
                raise
            local_error = error
        if mode == "auto" and local_error is None:
            methods = prefer_all_ranks(methods, infos, adapters, request.context)
    order = _order(plan, request.mesh_dims, infos, methods)
    if request.spine is not None:  # device roles split from the shrunk spine, after the others
        order, methods = request.spine.arrange(order, methods, adapters)
    store: AttemptStore | None = None
    if default_backend != "fake":  # one process simulates the world: nobody to disagree
        if local_error is None:
            # Before the agreement's round trips: a growth of the descriptor table that this
            # creation needs then waits out its grace period while this rank waits for its
            # peers, not inside a group's connect, where the group's peers wait for it.
            grow_ahead(_descriptors_opened(request, order, adapters))
        store = agreement_store(request.rank)
        payload: dict[str, Any] = {
            "layout": plan.canonical(),
            "generation": request.number,
            "backends": {name: adapter.name for name, adapter in adapters.items()},
            "creation": methods,
            "mesh_dims": list(request.mesh_dims),
            "world_size": request.layout.world_size,
            "error": f"{type(local_error).__name__}: {local_error}" if local_error else None,
        }
        if request.number > 0:
            payload.update(members=list(plan.members or ()), lost=request.lost)
        channel = request.outcomes(store) if request.outcomes is not None else None
        single = frozenset(name for name, adapter in adapters.items()
                           if adapter.created_by_members)
        try:
            methods = _agree(request, store, payload, order, methods,
                             vote=local_error is None, single=single, channel=channel)
        finally:
            if channel is not None:
                channel.close()
    if local_error is not None:
        raise local_error
    what = ("the end of create()" if request.number == 0
            else f"the end of rebuild() (generation {request.number})")
    made = _create_groups(request, order, adapters, methods, store, what, announce)
    generation = Generation(request=request,
                     roles={n: made[n] for n in request.layout.role_names},
                     dim_groups={d: made[d] for d in request.mesh_dims},
                     attempts=[store] if store is not None else [],
                     epoch=store.epoch if store is not None else -1)
    if generation.sockets():
        # A child forked later (a DataLoader worker) would keep them open past this rank's
        # death, and its peers would wait for the child to exit to see it.
        detach_on_fork(generation, Generation.sockets)
    generation.flight = open_flight(
        {name: made[name].group for name in request.layout.role_names},
        enabled=flight_enabled(request.layout), generation=request.number,
        epoch=generation.epoch, store_prefix=STORE_PREFIX, publish=store is not None,
        members=request.layout.world_size,
        backends={name: made[name].adapter.name for name in request.layout.role_names})
    if generation.flight is not None:  # calls recorded on a gloo group watch for interruption
        for name, recorder in generation.flight.recorder.roles.items():
            if made[name].adapter.severs:
                recorder.watch = generation
    return generation


def _descriptors_opened(request: GenerationRequest, order: Sequence[RolePlan],
                        adapters: dict[str, BackendAdapter]) -> int:
    """How many descriptors this rank's groups of ``order`` open while they are made, as far as
    known: gloo's (:func:`~commgroups.creation.sockets.gloo_descriptors`). Another backend's
    are not counted (NCCL's open at a communicator's first collective, or are unknown here),
    nor the control plane's (its threads connect after creation, off the path peers wait on)."""
    opened = 0
    for info in order:
        if adapters[info.name].severs:
            members = request.plan.ranks_of(info, request.rank)
            if members is not None:
                opened += gloo_descriptors(len(members))
    return opened


def _order(plan: Plan, mesh_dims: Sequence[str], infos: dict[str, RolePlan],
           methods: dict[str, str]) -> list[RolePlan]:
    """Creation order: regular roles, then dim groups, by the rules of ``creation_order``.

    Dim groups are regular; they go after the regular roles of their own creation path so
    every rank's group count stays equal while member-only groups are made.
    """
    roles = creation_order(plan, {n: m for n, m in methods.items() if n in plan.role_names})
    dims = [infos[d] for d in mesh_dims if d in infos]
    plain = [d for d in dims if methods.get(d.name) != "split"]
    split = [d for d in dims if methods.get(d.name) == "split"]
    regular_plain = [r for r in roles if r.regular and methods.get(r.name) != "split"]
    regular_split = [r for r in roles if r.regular and methods.get(r.name) == "split"]
    irregular = [r for r in roles if not r.regular]
    return [*regular_plain, *plain, *regular_split, *split, *irregular]

def _agree(request: GenerationRequest, store: AttemptStore, payload: dict[str, Any],
           order: list[RolePlan], methods: dict[str, str], vote: bool,
           single: frozenset[str] = frozenset(),
           channel: OutcomeChannel | None = None) -> dict[str, str]:
    """Agree on ``payload`` and, in the same store round, on whether local creation is safe;
    returns the methods to create with. ``vote=False``: this rank holds an error the
    agreement reports, so it casts no local vote. ``single``: the single-rank groups' roles
    and dims (:func:`~commgroups.creation.role_groups.local_vote`)."""
    # The ranks that meet: the job's world in generation 0 (whatever the layout claims: a
    # wrong world size is reported through this vote), the survivors after that.
    world = dist.get_world_size() if request.number == 0 else request.layout.world_size
    position = request.position
    ballot = (local_vote(request.plan, order, methods, request.rank, world, single) if vote
              else None)
    verdict = agree(store, position, world, payload,
                    timedelta(seconds=request.create_timeout_s), finish=store.finish,
                    ballot=ballot, counter=torch_internals.next_counter_name() or "",
                    members=request.plan.members if request.number > 0 else None,
                    channel=channel)
    decided = decide_local(methods, ballot, verdict, request.rank)
    every_rank = sorted(role for role, method in decided.items() if method != "local")
    if vote and verdict.counter_split and every_rank:
        # torch names a group every rank makes by a per-process counter: with counters apart,
        # each rank would wait for the others under its own name until create_timeout_s.
        names = listed([repr(role) for role in every_rank], 60)
        raise GroupCreationError(
            f"rank {request.rank}: {verdict.counter_split} rank(s) created a different number of "
            f"process groups before this call, so torch would name [{names}] differently per "
            "rank; nothing was created. fix: create the same groups in the same order on every "
            "rank first"
        )
    return decided

def _create_groups(request: GenerationRequest, infos: list[RolePlan],
                   adapters: dict[str, BackendAdapter], methods: dict[str, str],
                   store: AttemptStore | None, what: str, announce: bool,
                   ) -> dict[str, CreatedRole]:
    """Create the groups of ``infos`` in order, after agreement; all or nothing.

    Where a backend connects on creation, this rank then notes in the attempt's store that it
    is done (no wait: ``destroy()`` waits for the others; ``announce=False``: noted here, sent
    later, see :meth:`AttemptStore.note_created`). ``what`` names that point in errors.
    """
    for info in infos:  # the same inputs on every rank: the same error, before any group
        hazard = nonmember_split_hazard(info, adapters[info.name], methods[info.name],
                                        request.context)
        if hazard is not None:
            raise GroupCreationError(
                f"rank {request.rank}: {hazard}; nothing was created. fix: give the role "
                "backend 'device' or let its members create it (see the guide, 'Bound "
                "default group')"
            )
    started = time.monotonic()
    created: dict[str, CreatedRole] = {}
    current: RolePlan | None = None
    ledger: SocketLedger | None = None  # from the first group whose sockets are severed
    try:
        for current in infos:
            if adapters[current.name].severs:
                ledger = ledger or SocketLedger()
                ledger.watch(current.name, request.plan.ranks_of(current, request.rank))
            elif ledger is not None:
                ledger.gap()
            created[current.name] = _create_one(
                request, current, adapters[current.name], methods[current.name])
        current = None
        for name, sockets in ({} if ledger is None else ledger.finish()).items():
            if created[name].owned:
                created[name].sockets = sockets
        # Only where a backend connects on creation (gloo; NCCL eager init): single-rank and
        # fake groups have no peer that could still be connecting.
        if store is not None and any(adapters[info.name].connects_on_create for info in infos):
            with store_calls(store, request.position, started, what):
                store.note_created(request.layout.world_size,
                                   started + request.create_timeout_s, announce)
    except Exception as error:
        destroy_groups(created.values())  # leave nothing half-made
        step = (f"creating role {current.name!r} ({methods[current.name]})"
                if current is not None else f"noting the end of creation at {what}")
        fix = ("call rebuild() again on every survivor (it rebuilds without a rank that "
               "died meanwhile)" if request.number > 0 else "check that every rank is alive "
               "and makes the same registry calls in the same order")
        raise GroupCreationError(first_fitting(
            f"rank {request.rank}: {step} failed: {error}; fix: {fix}",
            f"rank {request.rank}: {step} failed: {str(error)[:80]}...; fix: {fix}"),
        ) from error
    return created

def _create_one(request: GenerationRequest, info: RolePlan, adapter: BackendAdapter,
                method: str) -> CreatedRole:
    """Create one role's (or dim's) group."""
    spec = info.spec
    timeout = (adapter.default_timeout() if spec.timeout_s is None
               else timedelta(seconds=spec.timeout_s))
    # Groups that rendezvous on creation do it under the group's own timeout (30 minutes by
    # default): a peer that died during creation would hang the others that long. Create
    # under create_timeout_s, then give the group its role timeout.
    bounded = adapter.connects_on_create and timeout.total_seconds() > request.create_timeout_s
    make = create_role_group if request.spine is None else request.spine.creator(adapter)
    is_role = info.name in request.layout.role_names
    created = make(
        request.plan, info, adapter, spec.options,
        request.create_timeout_s if bounded else timeout.total_seconds(),
        request.rank, method, group_desc=info.name if is_role else f"mesh-{info.name}",
    )
    if bounded:
        set_group_timeout(created, timeout)
    logger.debug("rank %d: created %s via %s", request.rank, info.name, method)
    return created
