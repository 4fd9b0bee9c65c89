"""Rebuilding NCCL roles after a rank loss when the default group is bound: ``shrink_group``.

With ``init_process_group(device_id=...)`` every NCCL group is made by ncclCommSplit of the default
communicator (``split_group``, and ``new_group``, whose non-members join a no-color split of it).
After a rank loss that communicator still holds the dead rank, so no new NCCL group can come from
it: a split waits for the dead rank forever. ``torch.distributed.shrink_group`` (torch >= 2.10,
ncclCommShrink: NCCL >= 2.27) is the only way to a communicator without it, from the survivors
alone.

The decision (where this module shrinks, and why there):

- **Never the default group.** torch makes a shrunk default group the new default, renumbers every
  rank (the registry's layouts are in global ranks, ``Plan(members=...)``) and destroys every other
  group, the gloo roles and the checkpoint group included (``_finalize_shrunk_group`` in 2.10-2.15).
- **A non-default world communicator the registry already owns: the spine.** At the first
  rebuild it is the group of the first device-backend role that spans the world (e.g. fsdp over
  ``dp_shard x cp`` when those are every dim, or a role with ``dims="world"``). The survivors shrink
  it with ``shrink_group(its group ranks of every rank not in the new layout, group=spine,
  shrink_flags=SHRINK_ABORT)``; the result (a non-default group over exactly the new members, in
  ascending global order) is the spine of the next generation. A job without such a role gets
  the refusal it had before, naming this fix; commgroups does not add a world communicator to
  every job (hundreds of MB of device memory each) for a rank loss that may never come.
- **Every device-backend role of generation g+1 is split from the spine** (``split_group(
  parent_pg=spine, split_ranks=...)``, one ncclCommSplit per role; ``split_ranks`` are group ranks
  *of the spine*, which is what split_group expects), with its own options, timeout and name; the
  world role too, so a role's group is always made for its generation and the spine carries no
  traffic. Mesh-dim groups made later come from the spine as well. The cost: from the first
  rebuild on, the job holds one world communicator more (the spine); a role's
  ``options.nccl.split_share`` lets its split share the spine's resources.
- Ranks the new layout has no place for (spares, dropped) are excluded from the shrink like the
  dead ones (``shrink_group`` must not be called by an excluded rank): they abort their copy of
  the spine and hold nothing.
- The spine is shrunk lazily, at the first device role of generation g+1 (after the survivors'
  agreement, like any creation); roles made locally (gloo) are created before it, so torch's
  naming of member-only groups is not disturbed by the splits (see
  :func:`commgroups.creation.role_groups.local_vote`). Any other creation of a group with non-members while
  the spine is in use would send torch's no-color split to the dead default communicator: it is
  refused instead (a role with explicit rank groups, before anything is retired; a local role
  that fell back to every-ranks creation, at its creation).

Capability flags: the adapter's ``supports_split`` (its groups come from a split of the default
group) selects this path; :meth:`~commgroups.backends.BackendAdapter.shrink_blocker` (torch's
``shrink_group``, ``SHRINK_ABORT``, the spine's backend ``supports_shrinking``) gates it.

What was run: nothing of this on a GPU. CI runs it with NCCL mocked (``shrink_group`` and
``split_group`` replaced by recorders that make fake-backend groups, in
``tests/test_shrink.py``); ``tests/test_gpu_rebuild.py`` has a one-GPU check of the
split-from-spine half (a one-rank world loses nobody, so nothing is shrunk), never run so far.
Not known from a run: whether torch's shrink_group, which destroys the parent (``destroy_process_group``
on a communicator with a dead peer, after NCCL aborted its work), returns promptly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.backends import BackendAdapter
from commgroups.creation.role_groups import CreatedRole, CreationContext, create_role_group, split_role_group
from commgroups.errors import GroupCreationError, RebuildError
from commgroups.layout.specs import RoleOptions
from commgroups.planning.plan import Plan, RolePlan
from commgroups.util.error_text import listed
from commgroups.util.text_table import format_ranks

__all__ = ["Spine", "prepare_spine", "splits_from_default"]

logger = logging.getLogger(__name__)

RoleCreator = Callable[..., CreatedRole]
"""The signature of :func:`commgroups.creation.role_groups.create_role_group`."""

_FIX = "use restart mode (torchrun elastic), or init_process_group without device_id"


def splits_from_default(adapter: BackendAdapter, context: CreationContext) -> bool:
    """Whether ``adapter``'s groups in this job come from the bound default group's communicator.

    True for NCCL/RCCL when the default group is bound to a device and runs the same torch backend
    (``supports_split``): every new group of it, ``new_group`` included, is an ncclCommSplit of
    the default communicator, which a rank loss leaves holding the dead rank.
    """
    return (context.device_bound and adapter.supports_split
            and context.default_backend == adapter.torch_backend)


@dataclass
class Spine:
    """The non-default world communicator the device roles are split from after a rank loss.

    Held by the registry from its first rebuild that needs it (see the module docstring). While
    its ``owner`` (the role whose group it is, generation 0) still lists it, it is that role's
    group and nothing routes through the spine; :meth:`retarget` takes it over.
    """

    group: dist.ProcessGroup
    """The communicator: a world role's group, then each shrink's result. Never the default group."""
    ranks: tuple[int, ...]
    """Its global ranks, ascending: group rank ``i`` is ``ranks[i]`` (torch's order for
    ``new_group``, ``split_group`` and ``shrink_group`` alike)."""
    adapter: BackendAdapter
    """The backend of the roles it serves (NCCL or RCCL)."""
    source: str
    """What it was made as, for messages: ``role 'fsdp'``, or ``shrink_group of ...``."""
    owner: CreatedRole | None = None
    """The role that still owns the group (generation 0, before any rebuild took it over)."""
    target: tuple[int, ...] | None = None
    """The global ranks the next generation needs it over (set by :meth:`retarget`)."""
    broken: str | None = None
    """Why it cannot serve any more (a shrink_group that failed), or None."""

    @property
    def active(self) -> bool:
        """Whether device groups are made from it (it was taken over from its role)."""
        return self.owner is None

    def serves(self, adapter: BackendAdapter) -> bool:
        """Whether groups of ``adapter`` are made from this spine (same torch backend)."""
        return adapter.supports_split and adapter.torch_backend == self.adapter.torch_backend

    # ------------------------------------------------------------------------------- rebuild
    def retarget(self, members: Sequence[int], rank: int) -> Spine | None:
        """Take the spine over for the generation over ``members``; None where ``rank`` is not one.

        Called by ``rebuild()`` after the new layout is known and before the old generation is
        retired. The group leaves its role's owned groups (the retire step would abort it: the
        shrink needs it alive, and torch's shrink_group destroys it). A rank without a place in
        the new layout never calls shrink_group (torch forbids an excluded rank to): it aborts its
        copy of the communicator and keeps no spine.
        """
        if self.owner is not None:
            self.owner.owned[:] = [g for g in self.owner.owned if g is not self.group]
            self.owner = None
        if rank not in members:
            self.adapter.abort(self.group)
            return None
        self.target = tuple(sorted(members))
        return self

    def parent(self) -> dist.ProcessGroup:
        """The spine over the target ranks: shrunk (collective over them) on first use.

        Raises:
            RebuildError: a previous shrink failed, or the target holds a rank the spine lacks.
            GroupCreationError: shrink_group failed or gave a group over other ranks; the spine
                is then broken and the next ``rebuild()`` refuses, naming restart mode.
        """
        if self.broken is not None:
            raise RebuildError(f"the NCCL spine ({self.source}) cannot serve: {self.broken}; "
                               f"fix: {_FIX}")
        target = self.ranks if self.target is None else self.target
        if target == self.ranks:
            return self.group  # nobody to leave out (a rebuild that lost no rank)
        keep = set(target)
        outside = sorted(keep.difference(self.ranks))
        if outside:
            raise RebuildError(
                f"the NCCL spine ({self.source}) spans {format_ranks(self.ranks)}, without "
                f"{format_ranks(outside)} of the new layout: shrink_group cannot add ranks; "
                f"fix: {_FIX}")
        if self.group is torch_internals.default_group():
            raise RebuildError("refusing to shrink the default group (torch would renumber every "
                               f"rank and destroy every other group); fix: {_FIX}")
        excluded = [index for index, rank in enumerate(self.ranks) if rank not in keep]
        flag = torch_internals.shrink_abort_flag()
        default = torch_internals.default_group()
        device = getattr(default, "bound_device_id", None) or torch.device("cuda")
        # The shrunk spine takes the default group's options, so a role without options.nccl
        # gets by its split what it got at create() by a split of the default group.
        options = torch_internals.backend_options_copy(default, device)
        logger.info("shrinking the NCCL spine (%s) from %d to %d ranks (excluding group ranks %s)",
                    self.source, len(self.ranks), len(target), format_ranks(excluded))
        try:
            # SHRINK_ABORT: NCCL first aborts the parent's work, which may hang on the dead peer.
            shrunk = dist.shrink_group(excluded, group=self.group,
                                       shrink_flags=0 if flag is None else flag,
                                       pg_options=options)
        except Exception as error:
            self.broken = f"shrink_group failed: {error}"
            raise
        got = tuple(dist.get_process_group_ranks(shrunk))
        if got != target:
            self.broken = (f"shrink_group gave a group over {format_ranks(got)}, not "
                           f"{format_ranks(target)}")
            raise GroupCreationError(f"the NCCL spine ({self.source}): {self.broken}; fix: {_FIX}")
        self.source = f"shrink_group of {self.source}"
        self.group, self.ranks, self.target = shrunk, target, None
        return shrunk

    # ------------------------------------------------------------------------------ creation
    def arrange(self, order: list[RolePlan], methods: dict[str, str],
                adapters: dict[str, BackendAdapter]) -> tuple[list[RolePlan], dict[str, str]]:
        """The creation order and methods of a generation made from this spine.

        Roles it serves are ``split`` (from the spine) and come last: every other role is created
        first, as before, so member-only creation's naming vote sees only its own calls.
        """
        served = {name for name, adapter in adapters.items() if self.serves(adapter)}
        arranged = [r for r in order if r.name not in served] + [r for r in order if r.name in served]
        return arranged, {name: ("split" if name in served else method)
                          for name, method in methods.items()}

    def creator(self, adapter: BackendAdapter) -> RoleCreator:
        """How a group of ``adapter`` is made while this spine is in use (same signature as
        :func:`~commgroups.creation.role_groups.create_role_group`)."""
        if not self.active:
            return create_role_group
        return self.split if self.serves(adapter) else self._guarded

    def split(self, plan: Plan, role: RolePlan, adapter: BackendAdapter, options: RoleOptions,
              timeout_s: float | None, rank: int, method: str, group_desc: str) -> CreatedRole:
        """``role``'s groups by one ``split_group`` of the spine; this rank's group.

        Collective over the spine's ranks (every member of the new generation). ``split_ranks``
        are the role's groups in the spine's group ranks (its global ranks' positions in
        :attr:`ranks`); a role's ``options.nccl`` rides in ``pg_options`` (None: torch copies the
        spine's, i.e. the default group's).
        """
        parent = self.parent()
        position = {global_rank: index for index, global_rank in enumerate(self.ranks)}
        groups = plan.rank_groups(role)
        outside = sorted({r for ranks in groups for r in ranks}.difference(position))
        if outside:
            raise GroupCreationError(
                f"role {role.name!r}: its groups hold {format_ranks(outside)}, which the NCCL "
                f"spine ({self.source}) does not; fix: {_FIX}")
        return split_role_group([[position[r] for r in ranks] for ranks in groups], adapter,
                                options, timeout_s, group_desc, parent=parent)

    def _guarded(self, plan: Plan, role: RolePlan, adapter: BackendAdapter, options: RoleOptions,
                 timeout_s: float | None, rank: int, method: str, group_desc: str) -> CreatedRole:
        """:func:`create_role_group`, refusing every-ranks creation of a group with non-members:
        torch sends those to a no-color split of the default communicator, which holds the dead
        rank (``_new_process_group_helper``, torch 2.10-2.15), so it would hang."""
        if method == "all_ranks" and not role.spans_world:
            raise GroupCreationError(
                f"role {role.name!r} ({adapter.name}) would be created by every rank, through a "
                "split of the bound default group, which holds the lost rank; fix: let its "
                f"members create it (creation_mode 'auto' or 'local'), or {_FIX}")
        return create_role_group(plan, role, adapter, options, timeout_s, rank, method,
                                 group_desc=group_desc)

    def close(self) -> None:
        """Destroy the spine where the registry owns it (no role does). Local; never raises."""
        if not self.active or not (dist.is_available() and dist.is_initialized()):
            return
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError) as error:  # destroyed already (a shrink took it)
            logger.debug("destroying the NCCL spine: %s", error)


def prepare_spine(roles: dict[str, CreatedRole], plan: Plan, spine: Spine | None,
                  context: CreationContext) -> Spine | None:
    """The spine a rebuild of ``roles`` needs, or None when no role needs one; else the refusal.

    Called before the check-in, so a refusal leaves everything as it was, the same on every rank
    (it reads only the layout, the backends and what torch and NCCL can do).

    Args:
        roles: the generation being rebuilt from (this rank's created roles).
        plan: that generation's plan.
        spine: the spine kept from an earlier rebuild, or None.
        context: the job's creation facts (is the default group bound, to which backend).

    Raises:
        RebuildError: a role's groups come from the bound default communicator and this job
            cannot shrink (the capability it lacks is named), or no device role spans the world
            (the message says which role to add), or a role has explicit rank groups.
    """
    bound = [name for name, created in roles.items()
             if splits_from_default(created.adapter, context)]
    if not bound:
        return spine
    first, adapter = bound[0], roles[bound[0]].adapter
    where = (f"role {first!r}: its {adapter.name} groups are ncclCommSplit of the bound default "
             "group, which holds the lost rank")
    if spine is not None and spine.broken is not None:
        raise RebuildError(f"{where}; the NCCL spine commgroups shrinks instead cannot serve "
                           f"({spine.broken}). fix: {_FIX}")
    if spine is None:
        world = [name for name in bound
                 if plan.role(name).spans_world and roles[name].group is not None]
        if world:
            created = roles[world[0]]
            assert created.group is not None
            spine = Spine(group=created.group, ranks=tuple(sorted(plan.rank_groups(world[0])[0])),
                          adapter=created.adapter, source=f"role {world[0]!r}", owner=created)
    probe = spine.group if spine is not None else torch_internals.default_group()
    blocker = adapter.shrink_blocker(probe)
    if blocker is not None:
        raise RebuildError(f"{where}; rebuilding in place needs shrink_group, which this job "
                           f"lacks: {blocker}. fix: {_FIX}")
    if spine is None:
        raise RebuildError(
            f"{where}; torch can shrink, but not the default group (renumbering every rank), "
            f"and no role here spans the world on {adapter.name}. fix: add "
            "cg.RoleSpec(name='world', dims='world'); or " + _FIX)
    irregular = [name for name in plan.role_names if not plan.role(name).regular
                 and not roles[name].adapter.created_by_members]
    if irregular:
        raise RebuildError(
            f"{where}; roles {listed(irregular, 60)} have explicit rank groups, which every rank "
            "would create through the dead default communicator. fix: give them dims; or " + _FIX)
    return spine
