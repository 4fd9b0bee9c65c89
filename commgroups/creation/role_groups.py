"""How a role's groups are created: the same calls, in the same order, on every rank.

Three paths, chosen per role by :func:`choose_method` from facts that are the same on every rank (the
plan, the role's backend adapter and the default group's device binding):

``all_ranks``
    torch's default contract: every rank calls ``new_group`` for every group of the role
    (``world / group size`` calls per rank). Always safe; the fallback for everything else.
``local``
    ``new_group(my_ranks, use_local_synchronization=True)``: one call per role per rank, non-members
    skip it. torch names such a group by hashing its ranks with a per-process counter (which counter
    changed in torch 2.14), so every member must be in the same naming state when it calls.
    :func:`creation_order` and :func:`local_vote` (which asks torch for the names, see
    :mod:`commgroups.torch_internals`) guarantee that, or the role falls back to ``all_ranks``.
``split``
    ``split_group(split_ranks=all groups of the role)``: one call per role per rank (ncclCommSplit),
    when the default group is bound to a device and the backend can split.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.backends import BackendAdapter, detect_device_backend
from commgroups.creation.agreement import Ballot, Verdict
from commgroups.layout.specs import RoleOptions
from commgroups.planning.plan import Plan, RolePlan
from commgroups.torch_internals import (
    GroupCall,
    default_store,
    group_naming_state,
    predict_group_names,
    registered_group_names,
)
from commgroups.torch_internals.version import torch_version

__all__ = [
    "CREATION_MODES",
    "nonmember_split_hazard",
    "CreatedRole",
    "CreationContext",
    "choose_method",
    "prefer_all_ranks",
    "ALL_RANKS_CALLS_WITHOUT_VOTE",
    "decide_local",
    "local_vote",
    "create_role_group",
    "split_role_group",
    "creation_order",
]

logger = logging.getLogger(__name__)

CREATION_MODES: tuple[str, ...] = ("auto", "all_ranks", "local", "split")

# Where each rank records the hashed group names it has had torch create (see local_vote): one key
# per rank, its names comma-separated.
_CLAIM_PREFIX = "commgroups/hashed-names/"


@dataclass(frozen=True)
class CreationContext:
    """The job-wide facts that decide a creation path; identical on every rank of a sane job.

    They enter the agreement payload through the chosen methods, so a rank that differs (one rank
    bound to a device, another not) is an error on every rank, not a hang.
    """

    default_backend: str
    """``dist.get_backend()`` of the default group (e.g. nccl, gloo, fake, cpu:gloo,cuda:nccl)."""
    device_bound: bool
    """The default group is bound to a device (``init_process_group(device_id=...)``; on torch
    2.15's default ``nccl``, ``ProcessGroupNCCL2``, also without it: it binds itself)."""
    accelerator: bool = False
    """An accelerator is visible (split_group needs one)."""
    torchcomms: bool = False
    """torch delegates new_group to split_group (TorchComms); local creation raises there."""
    device_backend: str = "gloo"
    """What a role's ``device`` backend means here (:func:`~commgroups.backends.detect_device_backend`)."""

    @classmethod
    def detect(cls) -> CreationContext:
        """Read the facts from the initialized default group and the running torch."""
        default_pg = torch_internals.default_group()
        accelerator_mod = getattr(torch, "accelerator", None)
        if accelerator_mod is not None:
            accelerator = bool(accelerator_mod.is_available())
        else:
            accelerator = bool(torch.cuda.is_available())
        return cls(
            default_backend=str(dist.get_backend()),
            device_bound=getattr(default_pg, "bound_device_id", None) is not None,
            accelerator=accelerator,
            torchcomms=torch_internals.torchcomms_enabled(),
            device_backend=detect_device_backend(),
        )


@dataclass
class CreatedRole:
    """What creating one role left on this rank."""

    group: dist.ProcessGroup | None
    """This rank's group of the role; None when the rank is in no group (explicit-ranks roles)."""
    method: str
    """The creation path used: all_ranks, local or split."""
    adapter: BackendAdapter
    """The backend the group was created on."""
    owned: list[dist.ProcessGroup] = field(default_factory=list)
    """Groups this rank must destroy on close."""
    sockets: tuple[tuple[int, str], ...] = ()
    """The sockets the groups opened, where the backend is severed through them (gloo on Linux:
    :mod:`commgroups.creation.sockets`)."""


def creation_order(plan: Plan, methods: dict[str, str] | None = None) -> list[RolePlan]:
    """The order roles are created in: regular roles first (layout order), then irregular ones.

    Creating a regular role registers exactly one group on every rank, whatever the path; an
    irregular role registers one on its members only. Putting irregular roles last keeps every rank's
    group count equal while regular roles are created, which local creation needs (torch's hashed
    group name includes that count). With ``methods``, regular roles made by ``split_group`` come
    after the other regular ones: torch names split groups on another path, so member-only roles
    after them could not have their names predicted (and would be made by every rank, which on a
    device-bound default group before torch 2.15 hangs gloo subgroups: see
    :func:`nonmember_split_hazard`).
    """
    roles = [plan.role(name) for name in plan.role_names]
    split = set() if methods is None else {n for n, m in methods.items() if m == "split"}
    return ([r for r in roles if r.regular and r.name not in split]
            + [r for r in roles if r.regular and r.name in split]
            + [r for r in roles if not r.regular])


def _split_blocker(adapter: BackendAdapter, context: CreationContext) -> str | None:
    """Why split creation cannot be used (None: it can)."""
    if not adapter.supports_split:
        return f"backend {adapter.name} cannot split communicators"
    if not context.device_bound:
        return "the default group is not bound to a device (init_process_group(device_id=...))"
    if context.default_backend != adapter.torch_backend:
        return (f"the default group's backend {context.default_backend!r} is not "
                f"{adapter.torch_backend!r} (split children inherit the parent's backends)")
    if not context.accelerator:
        return "no accelerator is visible"
    return None


def _local_blocker(adapter: BackendAdapter, context: CreationContext) -> str | None:
    """Why member-only creation cannot be used (None: it can)."""
    if not adapter.supports_local_creation:
        return f"member-only creation hangs on backend {adapter.name}"
    if context.device_bound and adapter.supports_split:
        # With a bound default group (NCCL), the members of a new NCCL group create it by
        # ncclCommSplit of the default communicator, which every rank of it must join: torch makes
        # non-members join with no color (perform_nocolor_split, c10d _new_process_group_helper,
        # torch 2.10-2.15). Skipping the call, as member-only creation does, hangs the members.
        # Groups of another backend (gloo) do not split, so member-only creation is safe for them,
        # and it is the safe path: an all-ranks call would send their non-members, and not their
        # members, into the split (pytorch#145376, fixed in 2.15).
        return ("the default group is bound to a device: non-members must join torch's comm split "
                f"of the {adapter.torch_backend} communicator")
    if context.torchcomms:
        return "TorchComms delegates new_group to split_group, which has no member-only mode"
    if context.default_backend == "mpi":
        return "MPI has no member-only synchronization"
    return None


# torch sends the non-members of every new subgroup into a no-color split of a bound default
# group's communicator, whatever the subgroup's backend, so members of a gloo subgroup (which do
# not split) leave them waiting forever (pytorch#145376). torch 2.15 splits only when the
# requested backend is the parent's (_get_split_source); checked on 2.10, 2.13 and 2.15.
_NONMEMBER_SPLIT_FIXED = (2, 15)


def nonmember_split_hazard(
    role: RolePlan, adapter: BackendAdapter, method: str, context: CreationContext
) -> str | None:
    """Why creating ``role`` by ``method`` would hang here (None: it would not).

    Every-ranks creation of a group that has non-members, on a backend that does not split from a
    device-bound default group, on torch < 2.15: the non-members join a comm split the members
    never make.
    """
    if method != "all_ranks" or not context.device_bound or role.spans_world:
        return None
    if adapter.supports_split:
        return None  # members split from the bound communicator too: the non-members' split is matched
    if torch_version()[:2] >= _NONMEMBER_SPLIT_FIXED:
        return None
    return (f"role {role.name!r} ({adapter.name}) would be created by every rank, and torch "
            f"{torch.__version__} sends the non-members of each of its groups into a split of the "
            "device-bound default group's communicator that its members never make "
            "(pytorch#145376, fixed in torch 2.15): a hang")


def choose_method(
    mode: str,
    role: RolePlan,
    adapter: BackendAdapter,
    context: CreationContext | None = None,
) -> str:
    """The creation path for ``role`` under ``mode``; the same answer on every rank.

    ``auto`` picks split, else local, else all_ranks (and :func:`prefer_all_ranks` then makes
    a few local roles all_ranks where that is cheaper); ``local`` and ``split`` fall back to
    all_ranks (with a log line saying why) where they are not safe. Only regular roles (every rank in
    exactly one equal-sized group) use local or split. ``context`` defaults to
    :meth:`CreationContext.detect`.

    Args:
        mode: the registry's creation mode (:data:`CREATION_MODES`).
        role: the plan of the role (or mesh-dim group) to create.
        adapter: the backend the role resolved to; its capability flags decide.

    Returns:
        ``"split"``, ``"local"`` or ``"all_ranks"``.
    """
    if mode not in CREATION_MODES:
        raise ValueError(f"creation mode {mode!r} is not supported; use one of {CREATION_MODES}")
    if adapter.created_by_members:
        return "local"  # whatever the mode: e.g. a single-rank group involves no other rank
    if mode == "all_ranks":
        return "all_ranks"
    if not role.regular:
        level = logging.INFO if mode != "auto" else logging.DEBUG
        logger.log(level, "role %s: its explicit rank groups do not cover the world evenly; "
                   "creating it on every rank (all_ranks)", role.name)
        return "all_ranks"
    ctx = context if context is not None else CreationContext.detect()
    split_reason = _split_blocker(adapter, ctx)
    local_reason = _local_blocker(adapter, ctx)
    if mode in ("auto", "split") and split_reason is None:
        return "split"
    if mode in ("auto", "local") and local_reason is None:
        return "local"
    reason = split_reason if mode == "split" else local_reason
    level = logging.DEBUG if mode == "auto" else logging.INFO
    logger.log(level, "role %s: %s creation not used (%s); creating on every rank (all_ranks)",
               role.name, "split" if mode == "split" else "local", reason)
    return "all_ranks"


ALL_RANKS_CALLS_WITHOUT_VOTE = 32
"""``auto`` creates every member-only candidate on every rank instead when that costs a rank at
most this many ``new_group`` calls in all. A call for a group the rank is not in registers a name
and returns (7 us on torch 2.13's fake backend, no communicator on any backend), so 32 of them
cost less than the local vote's two store round trips (0.2 ms on a quiet machine, 1-3 ms where 8
ranks share 2 cores): 4 and 8 gloo ranks, ``dp_shard x cp``, 4 roles: 6 and 8 calls, 18.9 against
20.9 ms and 45.1 against 50.2 ms to create (``commgroups bench --quick``, 2026-12-05). Above it
the calls grow with the world (16,388 at 65,536 ranks on the same layout) and local wins."""


def prefer_all_ranks(methods: dict[str, str], infos: dict[str, RolePlan],
                     adapters: dict[str, BackendAdapter], context: CreationContext,
                     ) -> dict[str, str]:
    """``auto``'s last step: ``methods`` with its local roles made on every rank instead where
    they need at most :data:`ALL_RANKS_CALLS_WITHOUT_VOTE` calls per rank together (then no
    role is local and no vote is held). A role local by its backend (single-rank groups) stays
    local, and nothing changes on a device-bound default group (a group every rank makes may
    hang its non-members there: :func:`nonmember_split_hazard`). The same answer on every
    rank: it reads the plan and the job-wide context only."""
    chosen = [name for name, method in methods.items()
              if method == "local" and not adapters[name].created_by_members]
    calls = sum(infos[name].num_groups for name in chosen)
    if not chosen or context.device_bound or calls > ALL_RANKS_CALLS_WITHOUT_VOTE:
        return methods
    logger.debug("roles %s: %d all-ranks calls cost less than the local vote; creating on every "
                 "rank", chosen, calls)
    return {name: "all_ranks" if name in chosen else method for name, method in methods.items()}


def _planned_calls(
    plan: Plan, order: list[RolePlan], methods: dict[str, str], rank: int
) -> tuple[list[GroupCall], dict[str, int]] | None:
    """The new_group calls this rank will make, in order, up to its last local role.

    Returns the calls and, per local role, the index of its call; None when a role before the last
    local one is made by split_group (torch names those groups on another path).
    """
    calls: list[GroupCall] = []
    local_calls: dict[str, int] = {}
    last_local = max(i for i, role in enumerate(order) if methods.get(role.name) == "local")
    for role in order[: last_local + 1]:
        method = methods.get(role.name)
        if method == "local":
            ranks = plan.ranks_of(role, rank)
            if ranks is None:  # not regular after all: never predict a group we will not create
                return None
            local_calls[role.name] = len(calls)
            calls.append(GroupCall(tuple(ranks), local=True, member=True))
        elif method == "all_ranks":
            calls.extend(GroupCall(tuple(g), local=False, member=rank in g)
                         for g in plan.rank_groups(role))
        else:
            return None
    return calls, local_calls


def local_vote(
    plan: Plan, order: list[RolePlan], methods: dict[str, str], rank: int, world_size: int,
    single: Collection[str] = (),
) -> Ballot | None:
    """This rank's ballot on local creation of ``methods``' local roles; None when there are none.

    torch names a member-only group by hashing its ranks with a per-process counter, so every member
    must compute the same name and the name must be new. Rather than re-implement torch's private
    naming rule (2.14 changed it), this asks torch (see
    :func:`commgroups.torch_internals.predict_group_names`): local creation is kept only when (1)
    every rank's naming state is the same now (torch's own hash of a probe group: the ballot's
    ``state``), (2) torch's own naming code predicts each local group's name, and (3) no rank has had
    torch create one of those names before (a name reused after ``destroy_process_group`` meets its
    predecessor's stale rendezvous keys in the store: a hang on gloo) nor holds a live group by that
    name; (2) and (3) are this rank's ``veto``. Where torch's names never repeat (2.14+: the counter
    grows with every group), a layout re-created after ``close()`` therefore stays local. The
    ballot travels in the agreement's one store round (:func:`commgroups.creation.agreement.agree`);
    :func:`decide_local` reads its verdict.

    ``single``: local roles whose groups have one member each (single-rank groups, local by their
    backend: ``created_by_members``). Where they are the only local roles (``auto`` made every
    other group on every rank), nobody else computes their names and their backend keeps no
    rendezvous keys, so only (3)'s live-group check concerns them (torch refuses a name a live
    group holds: "already been created", as a rebuild's groups are made while the last
    generation's live), and that is this rank's alone: the ballot is cast without the name
    history's two store requests (4 gloo ranks, ``dp_shard x cp x pp=1``: 7 requests a rank
    instead of 9).
    """
    if "local" not in methods.values():
        return None
    only_single = all(role in single for role, method in methods.items() if method == "local")
    state = "single-rank" if only_single else group_naming_state(world_size)
    planned = _planned_calls(plan, order, methods, rank)
    names = None if planned is None else predict_group_names(planned[0], world_size)
    if state is None or planned is None or names is None:
        # torch changed its naming internals: the names are unknown, so do not risk a hang.
        if rank == 0:
            logger.info("torch %s: commgroups cannot predict member-only group names here; "
                        "creating local roles on every rank (all_ranks)", torch.__version__)
        return Ballot("unknown", veto=True)
    live = registered_group_names() or set()
    wanted = [names[index] for index in planned[1].values()]
    if only_single:
        return Ballot(state, veto=any(name in live for name in wanted))
    # This rank's history of hashed names (only this rank writes its key): read it, creating it
    # empty when missing (a compare-and-set from "" reads without blocking), then extend it. Two
    # store calls whatever the number of local roles.
    history_key = f"{_CLAIM_PREFIX}{rank}"
    store = default_store()
    history = bytes(store.compare_set(history_key, "", "")).decode()
    used = set(history.split(",")) if history else set()
    unsafe = any(name in live or name in used for name in wanted)
    fresh = [name for name in wanted if name not in used]
    if fresh:
        store.set(history_key, ",".join(filter(None, [history, *fresh])))
    return Ballot(state, veto=unsafe)


def decide_local(methods: dict[str, str], ballot: Ballot | None, verdict: Verdict,
                 rank: int) -> dict[str, str]:
    """``methods`` with every local role kept local only if the ballot carried on every rank;
    else all_ranks, on every rank alike (the verdict is the same everywhere)."""
    if ballot is None or verdict.carried:
        return dict(methods)
    if rank == 0:
        logger.info("local creation not safe (%s); creating those roles on every rank",
                    verdict.reason)
    return {role: ("all_ranks" if method == "local" else method) for role, method in methods.items()}


def _new_group(
    ranks: tuple[int, ...],
    adapter: BackendAdapter,
    options: RoleOptions,
    timeout_s: float | None,
    desc: str,
    *,
    local: bool,
) -> dist.ProcessGroup:
    # A fresh options object per group: new_group mutates it (timeout, name, split fields).
    args = adapter.group_args(options, timeout_s)
    # torch >= 2.14 types this ProcessGroup | NON_GROUP_MEMBER; callers keep member groups only.
    group: dist.ProcessGroup = dist.new_group(  # type: ignore[assignment]
        list(ranks),
        timeout=args.timeout,
        backend=args.backend,
        pg_options=args.pg_options,
        use_local_synchronization=local,
        group_desc=desc,
    )
    return group


def split_role_group(
    split_ranks: list[list[int]],
    adapter: BackendAdapter,
    options: RoleOptions,
    timeout_s: float | None,
    group_desc: str,
    parent: dist.ProcessGroup | None = None,
) -> CreatedRole:
    """One ``split_group`` (ncclCommSplit) for all of a role's groups; this rank's group.

    ``split_ranks`` are in ``parent``'s group ranks (the default group's: global ranks, when
    ``parent`` is None). ``split_share`` (from the role's ``options.nccl``) rides in
    ``pg_options.config``.
    """
    args = adapter.group_args(options, timeout_s)
    split = dist.split_group(
        parent_pg=parent,
        split_ranks=split_ranks,
        timeout=args.timeout,
        pg_options=args.pg_options,
        group_desc=group_desc,
    )
    # torch >= 2.14 types it ProcessGroup | NON_GROUP_MEMBER; a regular role has every rank.
    made: dist.ProcessGroup | None = split  # type: ignore[assignment]
    return CreatedRole(group=made, method="split", adapter=adapter,
                       owned=[made] if made is not None else [])


def create_role_group(
    plan: Plan,
    role: RolePlan,
    adapter: BackendAdapter,
    options: RoleOptions,
    timeout_s: float | None,
    rank: int,
    method: str,
    group_desc: str,
) -> CreatedRole:
    """Create ``role``'s groups by ``method`` and return this rank's. Collective over all ranks.

    ``local`` is collective over this rank's group only; ``split`` and ``all_ranks`` over all ranks.
    """
    if method == "local":
        mine = plan.ranks_of(role, rank)
        assert mine is not None, "choose_method picks local for regular roles only"
        group = _new_group(mine, adapter, options, timeout_s, group_desc, local=True)
        return CreatedRole(group=group, method="local", adapter=adapter, owned=[group])
    if method == "split":
        # The default group is the parent, so its ranks are global ranks.
        return split_role_group([list(ranks) for ranks in plan.rank_groups(role)], adapter, options,
                                timeout_s, group_desc)
    assert method == "all_ranks", method
    found: dist.ProcessGroup | None = None
    my_index = plan.group_index(role, rank)
    for index, ranks in enumerate(plan.rank_groups(role)):
        group = _new_group(ranks, adapter, options, timeout_s, group_desc, local=False)
        if index == my_index:
            found = group
    return CreatedRole(group=found, method="all_ranks", adapter=adapter,
                       owned=[found] if found is not None else [])
