"""Megatron-Core on registry groups: its ``ProcessGroupCollection`` filled from a :class:`GroupRegistry`.

Megatron-Core models, DDP and optimizers take ``pg_collection=`` (a
``megatron.core.process_groups_config.ProcessGroupCollection``) instead of reading
``parallel_state``'s globals. This module builds the commgroups layout of a Megatron job from its
degrees and order string, and fills Megatron's own collection with the registry's dedicated groups::

    import commgroups as cg
    from commgroups.integrations.megatron import megatron_layout, process_group_collection

    layout = megatron_layout(tp=2, pp=2, cp=1, dp=2, ep=2, expt_tp=1, order="tp-cp-ep-dp-pp")
    with cg.GroupRegistry(layout) as registry:
        pg_collection = process_group_collection(registry)
        model = GPTModel(config, ..., pg_collection=pg_collection)

Rank order. Megatron's ``RankGenerator`` reads ``order`` innermost first: with ``"tp-cp-ep-dp-pp"``
tp ranks are adjacent and pp has the largest stride. A commgroups layout lists dims outermost first,
so the dense dims are the order reversed (``pp, dp, cp, gtp_remat, tp``: Megatron's size-1
``gtp_remat`` axis sits right after tp) and the expert dims, a second factorization of the same ranks
(view :data:`EXPERT_VIEW`), are ``expt_pp, expt_dp, expt_gtp_remat, ep, expt_tp`` (Megatron's expert
``RankGenerator``: ``cp`` is 1 there, ``dp`` is ``world / (expt_tp * ep * pp)``). Every role's groups
are then the ranks Megatron's ``HyperCommGrid`` and ``parallel_state.initialize_model_parallel``
build for the same degrees and order.

Which registry role fills which ``ProcessGroupCollection`` field (:data:`FIELD_ROLES`); a field is
never the default group, and two fields share a group only where Megatron's ``parallel_state``
hands out one group object for both:

=============================  ===============================  ==================================
field                          role (dims, outermost first)      note
=============================  ===============================  ==================================
tp                             tp (tp)
pp                             pp (pp)
mp                             mp (pp, gtp_remat, tp)            tp-gtp_remat-pp
embd                           embd (explicit ranks)             first and last stage of each pp
                                                                 group; None on other stages
pos_embd                       pos_embd (explicit ranks)         first stage; None on others
cp                             cp (cp)
tp_cp                          tp_cp (cp, tp)
hcp                            not filled                        needs hierarchical cp sizes
ep                             ep (expert view: ep)
expt_tp                        expt_tp (expert view: expt_tp)
tp_ep                          tp_ep (ep, expt_tp)
tp_ep_pp                       tp_ep_pp (expt_pp, ep, expt_tp)
tp_ep_pp_with_egtp_remat       tp_ep_pp_with_egtp_remat          same ranks as tp_ep_pp, its own
                               (expt_pp, expt_gtp_remat, ep,     group (parallel_state makes two)
                               expt_tp)
tp_dp_cp                       tp_dp_cp (dp, cp, gtp_remat, tp)
dp                             dp (dp)
dp_cp                          dp_cp (dp, cp)
dp_cp_gtp_remat                = dp_cp                           parallel_state: the same group
                                                                 when gtp_remat_size == 1
dp_cp_ag                       dp_cp_ag (dp, cp)                 own group: all-gather overlapping
                                                                 dp_cp's reduce-scatter
gtp_remat                      gtp_remat (gtp_remat, size 1)     one rank per group
expt_gtp_remat                 expt_gtp_remat (size 1)           one rank per group
expt_dp                        expt_dp (expert view: expt_dp)
expt_dp_gtp_remat              = expt_dp                         same group when egtp size == 1
expt_dp_ag                     expt_dp_ag (expt_dp)              own group, as dp_cp_ag
intra_dp_cp                    = dp_cp                           same group with one distributed-
                                                                 optimizer instance
intra_expt_dp                  = expt_dp                         the same, for experts
intra_dist_opt                 intra_dist_opt (world)            one instance: every rank
inter_dist_opt                 not filled                        None with one instance
=============================  ===============================  ==================================

Roles that fill no field: ``tp_dp`` (tp, gtp_remat, dp: ``parallel_state``'s tensor-and-data
group without cp, the FP8 amax reduction group that :func:`install_parallel_state` installs),
``dp-gloo``, ``dp_cp-gloo`` and ``expt_dp-gloo`` (gloo twins of dp, dp_cp and expt_dp, as
``parallel_state`` makes them for the distributed optimizer's CPU-side state;
:func:`distributed_optimizer_gloo_groups` hands them out, since Megatron refuses
``use_gloo_process_groups=True`` together with ``pg_collection``), and ``checkpoint-metadata``
(gloo over the world, for the plan exchange of DCP and of Megatron's own distributed checkpoint,
:mod:`commgroups.integrations.megatron.checkpoint`).

The rest of a Megatron job: :func:`install_parallel_state` puts the registry's groups into
``megatron.core.parallel_state``'s globals (the code that still reads them: schedules, optimizers,
MoE, checkpointing helpers) and :mod:`~commgroups.integrations.megatron.checkpoint` runs
``dist_checkpointing`` save and load on the checkpoint-metadata group. Every Megatron name they
touch beyond the public API is in :mod:`~commgroups.integrations.megatron.megatron_internals`.

Megatron-Core is imported only when one of those functions runs (``pip install
'commgroups[megatron]'``); :func:`megatron_layout` is pure planning and needs neither Megatron nor
a process group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import commgroups as cg
from commgroups.errors import (  # MegatronUnavailableError is importable from here as before
    DimOrderError,
    InvalidSizeError,
    MegatronUnavailableError,
    UnknownDimError,
)

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "ALIASED_FIELDS",
    "DEFAULT_ORDER",
    "ParallelStateHandle",
    "EXPERT_VIEW",
    "FIELD_ROLES",
    "GLOO_ROLES",
    "UNFILLED_FIELDS",
    "MegatronUnavailableError",
    "distributed_optimizer_gloo_groups",
    "install_parallel_state",
    "megatron_layout",
    "process_group_collection",
]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""``initialize_model_parallel``'s default ``order`` (innermost first)."""

EXPERT_VIEW = "expert"
"""The layout view holding Megatron's expert factorization of the world."""

_TOKENS = ("tp", "cp", "ep", "dp", "pp")
_DENSE_NAMES = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}
_EXPERT_NAMES = {"tp": "expt_tp", "ep": "ep", "dp": "expt_dp", "pp": "expt_pp"}

# Role -> the dims it spans (any order; put into layout order when the layout is built). Dense
# roles use the layout's dims, expert roles the expert view's.
_DENSE_ROLES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "mp": ("tp", "gtp_remat", "pp"),
    "cp": ("cp",),
    "tp_cp": ("tp", "cp"),
    "tp_dp_cp": ("tp", "gtp_remat", "dp", "cp"),
    "tp_dp": ("tp", "gtp_remat", "dp"),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "dp_cp_ag": ("dp", "cp"),
    "gtp_remat": ("gtp_remat",),
}
_EXPERT_ROLES: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "expt_pp"),
    "tp_ep_pp_with_egtp_remat": ("expt_tp", "ep", "expt_gtp_remat", "expt_pp"),
    "expt_dp": ("expt_dp",),
    "expt_dp_ag": ("expt_dp",),
    "expt_gtp_remat": ("expt_gtp_remat",),
}

GLOO_ROLES: dict[str, tuple[str, ...]] = {
    "dp-gloo": ("dp",),
    "dp_cp-gloo": ("dp", "cp"),
    "expt_dp-gloo": ("expt_dp",),
}
"""The distributed optimizer's gloo groups (parallel_state's ``*_GLOO``): role -> dims."""

FIELD_ROLES: dict[str, str] = {
    "tp": "tp",
    "pp": "pp",
    "mp": "mp",
    "embd": "embd",
    "pos_embd": "pos_embd",
    "cp": "cp",
    "tp_cp": "tp_cp",
    "ep": "ep",
    "expt_tp": "expt_tp",
    "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp_with_egtp_remat",
    "tp_dp_cp": "tp_dp_cp",
    "dp": "dp",
    "dp_cp": "dp_cp",
    "dp_cp_gtp_remat": "dp_cp",
    "dp_cp_ag": "dp_cp_ag",
    "gtp_remat": "gtp_remat",
    "expt_gtp_remat": "expt_gtp_remat",
    "expt_dp": "expt_dp",
    "expt_dp_gtp_remat": "expt_dp",
    "expt_dp_ag": "expt_dp_ag",
    "intra_dp_cp": "dp_cp",
    "intra_expt_dp": "expt_dp",
    "intra_dist_opt": "intra_dist_opt",
}
"""``ProcessGroupCollection`` field -> the registry role whose group fills it (see the module table)."""

ALIASED_FIELDS: dict[str, str] = {
    "dp_cp_gtp_remat": "parallel_state returns the dp_cp group itself when gtp_remat_size == 1",
    "expt_dp_gtp_remat": "parallel_state returns the expt_dp group itself when egtp size == 1",
    "intra_dp_cp": "parallel_state returns the dp_cp group itself with one distributed-optimizer "
    "instance",
    "intra_expt_dp": "parallel_state returns the expt_dp group itself with one distributed-optimizer "
    "instance",
}
"""Fields that share another field's group, and the Megatron semantics that make them one group."""

UNFILLED_FIELDS: dict[str, str] = {
    "hcp": "hierarchical context-parallel groups exist only with hierarchical_context_parallel_sizes, "
    "which megatron_layout does not take; parallel_state leaves it None without them too",
    "inter_dist_opt": "None with one distributed-optimizer instance, as in parallel_state "
    "(num_distributed_optimizer_instances > 1 is not supported by megatron_layout)",
}
"""Fields :func:`process_group_collection` leaves unset (they read as None), and why."""


def _degree(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSizeError(
            f"megatron_layout: {field}={value!r} is not a whole number >= 1; fix: pass "
            f"{field}=<int >= 1> (1 turns that parallelism off)",
            field=field,
        )
    return value


def _order_tokens(order: str, sizes: Mapping[str, int]) -> list[str]:
    """Megatron's order string as tokens, innermost first, with unlisted size-1 dims appended."""
    if not isinstance(order, str):
        raise DimOrderError(
            f"megatron_layout: order={order!r} is not a string; fix: pass e.g. "
            f"order={DEFAULT_ORDER!r}", field="order",
        )
    tokens = [token.strip() for token in order.lower().split("-")]
    for token in tokens:
        if token not in _TOKENS:
            raise UnknownDimError(
                f"megatron_layout: order={order!r} names {token!r}, which is not one of "
                f"{'-'.join(_TOKENS)}; fix: list only those, innermost first (e.g. "
                f"{DEFAULT_ORDER!r})", field="order",
            )
    repeated = sorted({token for token in tokens if tokens.count(token) > 1})
    if repeated:
        raise DimOrderError(
            f"megatron_layout: order={order!r} lists {', '.join(repeated)} more than once; fix: "
            f"name each dim once (e.g. {DEFAULT_ORDER!r})", field="order",
        )
    for token in _TOKENS:
        if token not in tokens:
            if sizes[token] != 1:
                raise DimOrderError(
                    f"megatron_layout: {token}={sizes[token]} but order={order!r} does not list "
                    f"{token}; fix: add {token} to order (e.g. {DEFAULT_ORDER!r})", field="order",
                )
            tokens.append(token)
    return tokens


def _outermost_first(tokens: Sequence[str], names: Mapping[str, str], sizes: Mapping[str, int],
                     gtp_after: str, gtp_name: str) -> dict[str, int]:
    """The layout dims of one RankGenerator, outermost first; its size-1 gtp_remat axis after
    ``gtp_after`` (Megatron's ``_inject_gtp_remat_axis``)."""
    inner_first: list[tuple[str, int]] = []
    for token in tokens:
        if token in names:
            inner_first.append((names[token], sizes[token]))
            if token == gtp_after:
                inner_first.append((gtp_name, 1))
    return dict(reversed(inner_first))


def _stride(dims: Mapping[str, int], name: str) -> int:
    names = list(dims)
    return math.prod(list(dims.values())[names.index(name) + 1:])


def _groups_over(dims: Mapping[str, int], over: str) -> list[list[int]]:
    """The rank groups of the single dim ``over`` (ascending), as the planner makes them."""
    stride, size = _stride(dims, over), dims[over]
    world = math.prod(dims.values())
    starts = [r for r in range(world) if (r // stride) % size == 0]
    return [[start + i * stride for i in range(size)] for start in starts]


def _in_layout_order(dims: Sequence[str], order: Sequence[str]) -> list[str]:
    return sorted(dims, key=list(order).index)


def megatron_layout(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dp: int = 1,
    ep: int = 1,
    expt_tp: int | None = None,
    order: str = DEFAULT_ORDER,
    timeout_s: float | None = None,
    all_gather_groups: bool = True,
    elastic_dp: int | None = None,
) -> cg.Layout:
    """The commgroups layout of a Megatron-Core job: Megatron's rank order, one role per group it uses.

    Args:
        tp: tensor-parallel size (``tensor_model_parallel_size``).
        pp: pipeline-parallel size.
        cp: context-parallel size.
        dp: data-parallel size; the world size is ``tp * pp * cp * dp``.
        ep: expert-parallel size (``expert_model_parallel_size``).
        expt_tp: expert tensor-parallel size; None: ``tp`` (Megatron's default).
        order: Megatron's ``order`` string, innermost first (``"tp-cp-ep-dp-pp"``); dims of size 1
            may be left out, as ``RankGenerator`` allows.
        timeout_s: every role's collective timeout; None: the backend default.
        all_gather_groups: add ``dp_cp_ag`` and ``expt_dp_ag``, the separate all-gather groups of
            Megatron's AG/RS overlap (``parallel_state.create_all_gather_groups``); False leaves
            those fields None, as ``use_mpu_process_groups`` does without them.
        elastic_dp: the smallest dp a rank loss may shrink the job to (``registry.rebuild()``
            drops the lost rank's dp replica); None: nothing may shrink. Needs ``pp == 1`` (the
            embedding groups are then dims roles, which a smaller world re-derives) and expert
            layers whose data-parallel groups are the dense ones (``expt_tp * ep == tp * cp``,
            dp outside them in ``order``): the expert view then names that dim ``dp`` too, so
            it shrinks with it.

    Returns:
        A :class:`commgroups.Layout` with the dense dims, the :data:`EXPERT_VIEW` view, the roles of
        the module table, the gloo roles :data:`GLOO_ROLES` and ``checkpoint-metadata``.

    Raises:
        InvalidSizeError: a degree is not an int >= 1, or the world is not a multiple of
            ``expt_tp * ep * pp``.
        UnknownDimError: ``order`` names something other than tp, cp, ep, dp, pp.
        DimOrderError: ``order`` repeats a dim, leaves out a dim of size > 1, or (not ending in
            pp, with pp > 1) gives the expert layers another data-parallel size or other pipeline
            groups than the dense ones (Megatron asserts both).
        InvalidElasticError: ``elastic_dp`` is not an int in ``1..dp``, or the degrees do not
            allow dp to shrink (pp > 1, or expert data-parallel groups other than dp's).

    Example::

        >>> layout = megatron_layout(tp=2, cp=2, dp=2)
        >>> list(layout.dims)
        ['pp', 'dp', 'cp', 'gtp_remat', 'tp']
        >>> cg.plan(layout).rank_groups("cp")[:2]
        [(0, 2), (1, 3)]
    """
    sizes = {"tp": _degree("tp", tp), "pp": _degree("pp", pp), "cp": _degree("cp", cp),
             "dp": _degree("dp", dp), "ep": _degree("ep", ep)}
    expert_tp = _degree("expt_tp", sizes["tp"] if expt_tp is None else expt_tp)
    world = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"]
    expert_model = expert_tp * sizes["ep"] * sizes["pp"]
    if world % expert_model:
        raise InvalidSizeError(
            f"megatron_layout: the world (tp*pp*cp*dp = {world}) is not a multiple of "
            f"expt_tp*ep*pp = {expert_model}; fix: choose ep and expt_tp so that expt_tp*ep "
            f"divides tp*cp*dp = {world // sizes['pp']}", field="ep",
        )
    tokens = _order_tokens(order, sizes)
    dense = _outermost_first(tokens, _DENSE_NAMES, sizes, "tp", "gtp_remat")
    expert_sizes = {"tp": expert_tp, "ep": sizes["ep"], "dp": world // expert_model,
                    "pp": sizes["pp"]}
    expert = _outermost_first(tokens, _EXPERT_NAMES, expert_sizes, "ep", "expt_gtp_remat")
    if sizes["pp"] > 1 and not order.lower().endswith("pp"):  # Megatron's own test
        if expert_sizes["dp"] != sizes["dp"]:
            raise DimOrderError(
                f"megatron_layout: order={order!r} does not end in pp, and the expert layers' "
                f"data-parallel size ({expert_sizes['dp']}) differs from dp={sizes['dp']} "
                f"(Megatron refuses this); fix: end order in pp, or make expt_tp*ep == tp*cp",
                field="order",
            )
        if _stride(dense, "pp") != _stride(expert, "expt_pp"):
            raise DimOrderError(
                f"megatron_layout: order={order!r} gives the expert layers other pipeline groups "
                f"than the dense ones (Megatron asserts they are equal); fix: end order in pp",
                field="order",
            )

    elastic = _elastic_dp(elastic_dp, sizes, dense, expert)
    if elastic is not None:  # the expert view's data-parallel dim is dense dp: one name, one shrink
        expert = {("dp" if name == "expt_dp" else name): size for name, size in expert.items()}

    def spec(name: str, dims: Sequence[str] | None = None, *, backend: str = "device",
             ranks: list[list[int]] | None = None, view: Mapping[str, int] = dense) -> cg.RoleSpec:
        fields: dict[str, Any] = {"name": name, "backend": backend, "timeout_s": timeout_s}
        if ranks is not None:
            fields["ranks"] = ranks
        else:
            named = [("dp" if elastic is not None and d == "expt_dp" else d) for d in dims or ()]
            fields["dims"] = _in_layout_order(named, list(view))
        return cg.RoleSpec(**fields)

    pp_groups = _groups_over(dense, "pp")
    roles = [spec(name, dims) for name, dims in _DENSE_ROLES.items()
             if all_gather_groups or name != "dp_cp_ag"]
    if elastic is not None:  # pp == 1: each rank is its own first and last stage
        roles += [spec("embd", ["pp"]), spec("pos_embd", ["pp"])]
    else:
        roles += [
            spec("embd", ranks=[sorted({group[0], group[-1]}) for group in pp_groups]),
            spec("pos_embd", ranks=[[group[0]] for group in pp_groups]),
        ]
    roles += [spec(name, dims, view=expert) for name, dims in _EXPERT_ROLES.items()
              if all_gather_groups or name != "expt_dp_ag"]
    roles.append(cg.RoleSpec(name="intra_dist_opt", dims="world", timeout_s=timeout_s))
    roles += [spec(name, dims, backend="gloo", view=expert if name.startswith("expt") else dense)
              for name, dims in GLOO_ROLES.items()]
    roles.append(cg.RoleSpec(name=cg.CHECKPOINT_ROLE, dims="world", backend="gloo",
                             timeout_s=timeout_s))
    return cg.Layout(dims=dense, views={EXPERT_VIEW: expert}, roles=roles,
                     elastic=None if elastic is None else cg.ElasticSpec(dims={"dp": elastic}))


def _elastic_dp(value: Any, sizes: Mapping[str, int], dense: Mapping[str, int],
                expert: Mapping[str, int]) -> int | None:
    """``elastic_dp`` checked against the degrees (None: not elastic)."""
    from commgroups.errors import InvalidElasticError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= sizes["dp"]:
        raise InvalidElasticError(
            f"megatron_layout: elastic_dp={value!r} is not a whole number in 1..dp={sizes['dp']}; "
            f"fix: pass the smallest dp the job may shrink to, or None", field="elastic_dp")
    if sizes["pp"] != 1:
        raise InvalidElasticError(
            f"megatron_layout: elastic_dp needs pp == 1 (pp={sizes['pp']}): the embedding groups "
            "of a pipeline are explicit ranks, which a smaller world cannot re-derive; fix: "
            "pp=1, or elastic_dp=None", field="elastic_dp")
    if expert["expt_dp"] != dense["dp"] or _stride(dense, "dp") != _stride(expert, "expt_dp"):
        raise InvalidElasticError(
            f"megatron_layout: elastic_dp needs the expert layers' data-parallel groups to be dp's "
            f"(expert dp {expert['expt_dp']} vs dp {dense['dp']}); fix: make expt_tp*ep == tp*cp "
            "with dp outside tp, cp and ep in order (e.g. 'tp-cp-ep-dp-pp'), or elastic_dp=None",
            field="elastic_dp")
    return value


def _collection_class() -> Any:
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError as error:
        raise MegatronUnavailableError(
            f"commgroups.integrations.megatron needs Megatron-Core ({error}); fix: pip install "
            f"'commgroups[megatron]' (megatron-core 0.19, Python 3.12 wheels)"
        ) from error
    return ProcessGroupCollection


def _member_group(registry: cg.GroupRegistry, role: str) -> dist.ProcessGroup | None:
    from commgroups.errors import NotAMemberError
    from commgroups.integrations import MissingRoleError

    if role not in registry.role_names:
        raise MissingRoleError(
            f"process_group_collection needs the role {role!r}, but the registry's layout declares "
            f"only {', '.join(registry.role_names)}; fix: build the layout with "
            f"commgroups.integrations.megatron.megatron_layout(...)"
        )
    try:
        return registry.group(role)
    except NotAMemberError:
        return None  # embd / pos_embd on a stage that holds no embedding: None, as parallel_state


def process_group_collection(registry: cg.GroupRegistry) -> Any:
    """Megatron-Core's ``ProcessGroupCollection`` with every field it defines filled from ``registry``.

    ``registry`` must be created (``create()`` or ``with``) over a layout from
    :func:`megatron_layout`. Each field gets the group of its role in :data:`FIELD_ROLES` (the
    module table); fields in :data:`ALIASED_FIELDS` share their role's group as ``parallel_state``
    does; :data:`UNFILLED_FIELDS` (and ``dp_cp_ag`` / ``expt_dp_ag`` without
    ``all_gather_groups``) stay unset and read as None. ``embd`` and ``pos_embd`` are set to None on
    ranks outside every embedding group, as ``parallel_state`` leaves them.

    Returns:
        A ``megatron.core.process_groups_config.ProcessGroupCollection``.

    Raises:
        MegatronUnavailableError: Megatron-Core is not importable.
        MissingRoleError: the layout lacks a role a field needs (not a megatron_layout layout).
        RegistryStateError: the registry has not created its groups (RegistryNotCreatedError)
            or is closed (RegistryClosedError).
    """
    collection_class = _collection_class()
    from dataclasses import fields

    defined = {field.name for field in fields(collection_class)}
    values: dict[str, Any] = {}
    for field, role in FIELD_ROLES.items():
        if field not in defined:
            continue  # a field this Megatron release does not have
        if role in ("dp_cp_ag", "expt_dp_ag") and role not in registry.role_names:
            continue  # megatron_layout(all_gather_groups=False)
        values[field] = _member_group(registry, role)
    return collection_class(**values)


def distributed_optimizer_gloo_groups(registry: cg.GroupRegistry) -> dict[str, dist.ProcessGroup]:
    """The gloo groups Megatron's distributed optimizer keeps CPU-side state on, from ``registry``.

    Megatron refuses ``use_gloo_process_groups=True`` together with ``pg_collection``; a caller that
    wants them passes these to the optimizer it builds (``data_parallel_group_gloo=``). Keys are
    parallel_state's names: ``intra_dp_cp_group_gloo`` (role ``dp_cp-gloo``; one optimizer
    instance), ``intra_expt_dp_group_gloo`` (``expt_dp-gloo``) and ``dp_group_gloo`` (``dp-gloo``).

    Raises:
        MissingRoleError: the layout lacks one of :data:`GLOO_ROLES`.
    """
    result: dict[str, dist.ProcessGroup] = {}
    for key, role in (("intra_dp_cp_group_gloo", "dp_cp-gloo"),
                      ("intra_expt_dp_group_gloo", "expt_dp-gloo"), ("dp_group_gloo", "dp-gloo")):
        group = _member_group(registry, role)
        assert group is not None  # dims roles hold every rank
        result[key] = group
    return result


# After every name above: install imports this package's megatron_internals.
from commgroups.integrations.megatron.install import (  # noqa: E402
    ParallelStateHandle,
    install_parallel_state,
)
