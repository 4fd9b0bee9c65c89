"""Megatron-Core's ``parallel_state`` answering from a :class:`~commgroups.GroupRegistry`.

Megatron-Core still reads most process groups through ``megatron.core.parallel_state``'s getters
(schedules, optimizers, MoE, checkpointing helpers; Megatron-LM #6307), which read module globals
that only ``initialize_model_parallel`` writes. :func:`install_parallel_state` writes those globals
from the registry's groups instead, so an existing script keeps every ``parallel_state.get_*()``
call and drops ``initialize_model_parallel``::

    layout = megatron_layout(tp=2, dp=4)
    registry = cg.GroupRegistry(layout).create()
    handle = install_parallel_state(registry)     # was: initialize_model_parallel(2)
    ...                                           # every getter: the registry's groups
    parallel_state.destroy_model_parallel()       # uninstalls and closes the registry

Which global holds which role's group: :data:`STATE_ROLES` (groups) and :data:`RANK_LISTS` (the
global-rank lists some getters read); every getter ``initialize_model_parallel`` serves reads
them (:data:`COVERED_GETTERS`). Getters with no registry counterpart are replaced on the module,
while installed, by a function raising :class:`~commgroups.errors.MissingRoleError` that names
the getter and the fix (:data:`REFUSED_GETTERS`).

Ownership. The registry owns every group; ``parallel_state`` only points at them. While installed,
``parallel_state.destroy_model_parallel`` is replaced: it first takes the registry's gloo groups
out of the globals (Megatron's own destroy calls ``destroy_process_group`` on its gloo globals, and
would destroy the registry's behind its back), runs Megatron's destroy for the rest of its
teardown, resets every global this handle wrote, puts the original functions back and, with
``on_destroy="close"`` (the default), closes the registry, which destroys its groups: a cycle of
create, install and destroy leaves no group behind (Megatron's own cycle leaks about 20 each
time, #6897). ``registry.close()`` alone also destroys every group; the globals then point at
destroyed groups (collectives on them fail) until ``destroy_model_parallel()`` or
:meth:`ParallelStateHandle.uninstall` clears them.

After a rank loss, ``registry.rebuild()`` (or :meth:`ParallelStateHandle.rebuild`, the same)
points every global at the new generation's groups: the handle follows the registry through
:meth:`GroupRegistry.on_rebuilt <commgroups.GroupRegistry.on_rebuilt>`, and a rank the rebuild
leaves out is uninstalled (its globals back to None).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from commgroups.errors import (
    ArgumentError,
    MissingRoleError,
    NotAMemberError,
    RegistryStateError,
)
from commgroups.integrations.megatron import megatron_internals as internals

if TYPE_CHECKING:
    from commgroups.rank_loss import RebuildReport
    from commgroups.registry import GroupRegistry

__all__ = [
    "COVERED_GETTERS",
    "GLOO_GLOBALS",
    "MEMBER_ONLY_ROLES",
    "RANK_LISTS",
    "REFUSED_GETTERS",
    "STATE_ROLES",
    "ParallelStateHandle",
    "install_parallel_state",
]

logger = logging.getLogger(__name__)

STATE_ROLES: dict[str, str | None] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_GTP_WEIGHT_REMAT_GROUP": "gtp_remat",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": "dp-gloo",
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "dp",  # = dp with gtp_remat_size 1, as Megatron
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp-gloo",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",  # one distributed-optimizer instance
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp-gloo",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "dp_cp",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": "expt_gtp_remat",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp_ep_pp_with_egtp_remat",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp-gloo",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp-gloo",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expt_dp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
    # None as initialize_model_parallel leaves them with one optimizer instance and no
    # hierarchical cp: written anyway, so an uninstall resets every group global it could hold.
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
}
"""``parallel_state`` global -> the registry role whose group it holds (None: stays None)."""

RANK_LISTS: dict[str, str] = {
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "gtp_remat",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "expt_gtp_remat",
}
"""``parallel_state`` global -> the role whose group's global ranks (a list) it holds."""

MEMBER_ONLY_ROLES = frozenset({"embd", "pos_embd"})
"""Roles only some ranks belong to: the globals stay None elsewhere, as Megatron leaves them."""

GLOO_GLOBALS = ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO")
"""Globals Megatron's ``destroy_model_parallel`` passes to ``destroy_process_group``."""

_INITIALIZED = ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                "_MODEL_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GROUP", "_EXPERT_MODEL_PARALLEL_GROUP")
"""Globals that say parallel_state holds groups (Megatron's destroy resets them; it leaves a few
others, such as the intra-partial dp groups, set: those are overwritten, not refused)."""

_VIRTUAL = ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE")

COVERED_GETTERS = (
    "get_amax_reduction_group", "get_context_parallel_global_ranks", "get_context_parallel_group",
    "get_context_parallel_rank", "get_context_parallel_world_size", "get_data_parallel_group",
    "get_data_parallel_group_gloo", "get_data_parallel_rank", "get_data_parallel_src_rank",
    "get_data_parallel_world_size", "get_embedding_group", "get_expert_data_parallel_group",
    "get_expert_data_parallel_group_gloo", "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size", "get_expert_gtp_weight_remat_global_ranks",
    "get_expert_gtp_weight_remat_group", "get_expert_gtp_weight_remat_rank",
    "get_expert_gtp_weight_remat_world_size", "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank", "get_expert_model_parallel_src_rank",
    "get_expert_model_parallel_world_size", "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_rank", "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group", "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "get_global_memory_buffer", "get_gtp_weight_remat_global_ranks", "get_gtp_weight_remat_group",
    "get_gtp_weight_remat_rank", "get_gtp_weight_remat_world_size",
    "get_intra_distributed_optimizer_instance_group", "get_model_parallel_group",
    "get_model_parallel_src_rank", "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group", "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank", "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group", "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size", "get_all_ranks", "is_initialized",
    "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group", "model_parallel_is_initialized",
)
"""``parallel_state`` getters (0.19.2) that answer from the registry's groups once installed."""

REFUSED_GETTERS: dict[str, str] = {
    "get_hierarchical_context_parallel_groups":
        "hierarchical context-parallel groups need hierarchical_context_parallel_sizes, which "
        "megatron_layout does not take; fix: leave hierarchical cp off (a2a+p2p cp_comm_type "
        "off), or build those groups with HyperCommGrid yourself",
    "get_hybrid_data_context_parallel_groups":
        "hybrid context-parallel groups (hybrid_context_parallel=True) of a size other than dp*cp "
        "have no registry role; fix: turn hybrid_context_parallel off, or ask for "
        "group_size = dp*cp (the dp_cp role's group)",
    "get_inter_distributed_optimizer_instance_group":
        "there is no inter-instance group with one distributed-optimizer instance (megatron_layout "
        "builds one; initialize_model_parallel asserts here too); fix: "
        "num_distributed_optimizer_instances=1 and do not ask for it",
}
"""``parallel_state`` getters with no registry counterpart: replaced while installed by a function
that raises :class:`~commgroups.errors.MissingRoleError` with this reason."""

ON_DESTROY = ("close", "uninstall")


def _refusal(name: str, why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise MissingRoleError(
            f"parallel_state.{name}() has no counterpart in the commgroups registry installed by "
            f"install_parallel_state: {why}")

    refuse.__name__ = name
    refuse.__doc__ = f"Refused while a commgroups registry is installed: {why}"
    return refuse


def _hybrid_getter(handle: ParallelStateHandle, original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's own answer where the registry has one (group_size = dp*cp), else a refusal."""
    refuse = _refusal("get_hybrid_data_context_parallel_groups",
                      REFUSED_GETTERS["get_hybrid_data_context_parallel_groups"])

    def get_hybrid_data_context_parallel_groups(check_initialized: bool = True,
                                                group_size: int | None = None) -> Any:
        if group_size == handle.registry.group("dp_cp").size():
            return original(check_initialized=check_initialized, group_size=group_size)
        return refuse()

    return get_hybrid_data_context_parallel_groups


class ParallelStateHandle:
    """The installation of one registry into ``parallel_state`` (from :func:`install_parallel_state`).

    Holds everything the installation changed, so nothing lives at module level: the globals it
    wrote, the functions it replaced and how to put them back.

    Attributes:
        registry: the registry whose groups ``parallel_state`` answers with.
        on_destroy: what ``parallel_state.destroy_model_parallel()`` does to the registry:
            ``"close"`` (close it) or ``"uninstall"`` (leave it created).
    """

    def __init__(self, registry: GroupRegistry, *, on_destroy: str,
                 virtual_pipeline_model_parallel_size: int | None) -> None:
        self.registry = registry
        self.on_destroy = on_destroy
        self._virtual = virtual_pipeline_model_parallel_size
        self._functions = contextlib.ExitStack()
        self._installed = False
        self._made_buffer = False  # the TP layers' buffer, made by this install: undone with it
        self._generation: int | None = None

    # ------------------------------------------------------------------------------ state
    @property
    def installed(self) -> bool:
        """True from install until uninstall, close or ``destroy_model_parallel()``."""
        return self._installed

    @property
    def generation(self) -> int | None:
        """The registry generation the globals point at (None when not installed)."""
        return self._generation if self._installed else None

    def _values(self) -> dict[str, Any]:
        """Every global's value from the registry's live generation; raises before any write."""
        registry = self.registry
        if not registry.created:
            raise RegistryStateError(
                f"install_parallel_state needs a created registry (this one is "
                f"{registry.state.value}); fix: call registry.create() (or rebuild()) first")
        roles = {role for role in (*STATE_ROLES.values(), *RANK_LISTS.values()) if role}
        missing = sorted(roles - set(registry.role_names))
        if missing:
            raise MissingRoleError(
                f"install_parallel_state needs the roles {', '.join(missing)}, which the registry's "
                "layout does not declare; fix: build the layout with "
                "commgroups.integrations.megatron.megatron_layout(...)")
        groups: dict[str, dist.ProcessGroup | None] = {}
        for role in sorted(roles):
            try:
                groups[role] = registry.group(role)
            except NotAMemberError:
                if role not in MEMBER_ONLY_ROLES:
                    raise
                groups[role] = None  # not an embedding stage: None, as Megatron leaves it
        values: dict[str, Any] = {name: None if role is None else groups[role]
                                  for name, role in STATE_ROLES.items()}
        for name, role in RANK_LISTS.items():
            group = groups[role]
            values[name] = None if group is None else list(dist.get_process_group_ranks(group))
        if self._virtual is not None:
            values.update(dict(zip(_VIRTUAL, (0, self._virtual))))
        return values

    def _write(self) -> None:
        values = self._values()
        internals.set_state(values)
        self._made_buffer |= internals.set_global_memory_buffer()
        self._generation = self.registry.generation

    def _install(self) -> None:
        """Check parallel_state is empty, write the globals, replace destroy and refused getters."""
        current = internals.read_state(_INITIALIZED)
        held = [name for name in _INITIALIZED if current[name] is not None]
        if held:
            raise RegistryStateError(
                f"install_parallel_state: parallel_state already holds groups ({', '.join(held[:4])}"
                f"{', ...' if len(held) > 4 else ''}), from initialize_model_parallel or another "
                "install; fix: call parallel_state.destroy_model_parallel() first, and drop "
                "initialize_model_parallel from the script (the registry replaces it)")
        values = self._values()  # every error before anything changes
        originals = internals.read_state(["get_hybrid_data_context_parallel_groups"])
        replacements: dict[str, Callable[..., Any]] = {
            name: _refusal(name, why) for name, why in REFUSED_GETTERS.items()}
        replacements["get_hybrid_data_context_parallel_groups"] = _hybrid_getter(
            self, originals["get_hybrid_data_context_parallel_groups"])
        replacements["destroy_model_parallel"] = self._destroy_model_parallel
        self._functions.enter_context(internals.replaced_functions(replacements))
        self._functions.callback(self.registry.on_rebuilt(self._rebuilt))  # off at uninstall
        internals.set_state(values)
        self._made_buffer = internals.set_global_memory_buffer()
        self._generation = self.registry.generation
        self._installed = True

    # ----------------------------------------------------------------------------- moving on
    def refresh(self) -> None:
        """Point every global at the registry's current generation (after ``registry.rebuild()``).

        Raises:
            RegistryStateError: not installed, or the registry holds no live generation on this
                rank (closed, or left out of the rebuild: then :meth:`uninstall`).
        """
        if not self._installed:
            raise RegistryStateError("refresh(): this handle is not installed; fix: call "
                                     "install_parallel_state(registry) again")
        self._write()

    def rebuild(self, alive: Iterable[int] | None = None, *,
                timeout: float | timedelta | None = None) -> RebuildReport:
        """``registry.rebuild(alive, timeout=timeout)``; collective. The globals follow by
        themselves (:meth:`_rebuilt`), as they do after a bare ``registry.rebuild()``.
        Raises what ``registry.rebuild`` raises.
        """
        return self.registry.rebuild(alive, timeout=timeout)

    def _rebuilt(self, report: RebuildReport) -> None:
        """The registry's ``on_rebuilt`` callback: every global to the new generation, or, on a
        rank the rebuild left without a place (``report.place != "member"``), uninstalled."""
        if not self._installed:
            return
        if report.place == "member":
            self._write()
        else:
            self.uninstall()

    # ------------------------------------------------------------------------------ teardown
    def uninstall(self) -> None:
        """Reset every global this handle wrote to None and put back the replaced functions.

        The registry is left as it is (its groups stay until ``registry.close()``). Idempotent.
        """
        if not self._installed:
            return
        self._installed = False
        self._functions.close()
        self._reset()

    def _reset(self) -> None:
        """Every global this handle wrote back to None (and the buffer it made gone)."""
        names = [*STATE_ROLES, *RANK_LISTS, *(_VIRTUAL if self._virtual is not None else ())]
        internals.set_state(dict.fromkeys(names))
        if self._made_buffer:
            internals.parallel_state().destroy_global_memory_buffer()
            self._made_buffer = False

    def close(self) -> None:
        """:meth:`uninstall`, then close the registry (which destroys its groups). Idempotent."""
        self.uninstall()
        self.registry.close()

    def _destroy_model_parallel(self) -> None:
        """What ``parallel_state.destroy_model_parallel()`` runs while installed."""
        if not self._installed:  # a stale reference to this function, after an uninstall
            internals.parallel_state().destroy_model_parallel()
            return
        # The registry owns the gloo groups: out of Megatron's reach before its destroy runs.
        internals.set_state(dict.fromkeys(GLOO_GLOBALS))
        self._functions.close()  # the originals back, destroy_model_parallel first
        self._installed = False
        try:
            internals.parallel_state().destroy_model_parallel()
        finally:
            self._reset()  # Megatron's destroy leaves some rank lists and intra-partial groups set
            if self.on_destroy == "close":
                self.registry.close()

    def __enter__(self) -> ParallelStateHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ParallelStateHandle(installed={self._installed}, generation={self.generation}, "
                f"on_destroy={self.on_destroy!r})")


def install_parallel_state(registry: GroupRegistry, *, on_destroy: str = "close",
                           virtual_pipeline_model_parallel_size: int | None = None,
                           ) -> ParallelStateHandle:
    """Make ``megatron.core.parallel_state`` answer from ``registry``'s groups. Local.

    Replaces ``parallel_state.initialize_model_parallel(...)`` in a script: every getter it would
    have served (:data:`COVERED_GETTERS`) returns the registry's group for the matching role (the
    same ranks as Megatron's for the same degrees and order; never the default group), or its ranks
    and sizes. Getters without a registry counterpart (:data:`REFUSED_GETTERS`) raise
    :class:`~commgroups.errors.MissingRoleError` naming themselves.

    Args:
        registry: a created registry over a :func:`~commgroups.integrations.megatron.megatron_layout`
            layout.
        on_destroy: ``"close"``: ``parallel_state.destroy_model_parallel()`` also closes the
            registry (no group survives it); ``"uninstall"``: it only clears ``parallel_state``.
        virtual_pipeline_model_parallel_size: as ``initialize_model_parallel``'s (interleaved
            pipeline stages per rank); None: no interleaving.

    Returns:
        The :class:`ParallelStateHandle` (``uninstall()``, ``close()``, ``refresh()``,
        ``rebuild()``; a context manager that closes).

    Raises:
        ArgumentError: ``on_destroy`` or ``virtual_pipeline_model_parallel_size`` is invalid.
        RegistryStateError: the registry is not created, or ``parallel_state`` already holds
            groups (``initialize_model_parallel`` ran, or another handle is installed).
        MissingRoleError: the layout lacks a role a global needs.
        MegatronUnavailableError: Megatron-Core is missing, or not a checked release.
    """
    if on_destroy not in ON_DESTROY:
        raise ArgumentError(f"install_parallel_state: on_destroy={on_destroy!r}; fix: use one of "
                            f"{', '.join(map(repr, ON_DESTROY))}", field="on_destroy")
    virtual = virtual_pipeline_model_parallel_size
    if virtual is not None and (isinstance(virtual, bool) or not isinstance(virtual, int)
                                or virtual < 1):
        raise ArgumentError(
            f"install_parallel_state: virtual_pipeline_model_parallel_size={virtual!r} is not a "
            "whole number >= 1; fix: pass the interleaved stages per rank, or None",
            field="virtual_pipeline_model_parallel_size")
    if virtual is not None and "pp" in registry.role_names and registry.plan.groups("pp") and len(
            registry.plan.groups("pp")[0]) < 2:
        raise ArgumentError(
            "install_parallel_state: virtual_pipeline_model_parallel_size needs pp > 1 (Megatron's "
            "interleaved schedule); fix: pass None, or build the layout with pp >= 2",
            field="virtual_pipeline_model_parallel_size")
    handle = ParallelStateHandle(registry, on_destroy=on_destroy,
                                 virtual_pipeline_model_parallel_size=virtual)
    handle._install()
    logger.info("parallel_state answers from the registry (generation %d)", registry.generation)
    return handle

