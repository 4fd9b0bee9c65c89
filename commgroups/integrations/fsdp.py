"""FSDP2 on the registry's fsdp role: ``fully_shard`` over a mesh built from the role's own group.

With plain ``init_device_mesh``, FSDP over ``dp_shard x cp`` is ``mesh["dp_shard", "cp"]._flatten()``,
which is the *default* group whenever the product spans the world; FSDP's ``async_op=True``
collectives then share a communicator with everything else on the default group. The registry's
``device_mesh("fsdp")`` is a 1-D mesh on the fsdp role's dedicated group instead::

    from commgroups.integrations.fsdp import fully_shard_on_role
    for block in model.blocks:
        fully_shard_on_role(block, registry)
    fully_shard_on_role(model, registry)

This is ``fully_shard(module, mesh=registry.device_mesh("fsdp"), **kwargs)`` plus async-and-wait:
FSDP2 (torch 2.13) issues its all-gathers and reduce-scatters with ``async_op=False`` on its own
all-gather and reduce-scatter streams, so on NCCL/RCCL (torch >= 2.8) it drives one communicator
from two streams with no fence between them. With the role's ``async_and_wait`` on, the module gets
FSDP2's public custom-comm hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) set to
comms that issue ``async_op=True`` and wait at once, so every FSDP collective runs on the group's own
stream, without patching torch.distributed. HSDP: ``replicate="dp_replicate"`` gives a 2-D mesh of
two dedicated groups, ``registry.device_mesh(["dp_replicate", "fsdp"])``.

HSDP's replica all-reduce is the exception: FSDP2 (torch 2.13 to 2.15) issues it as a plain blocking
``dist.all_reduce`` on the replicate group and has no hook for it (``set_all_reduce_hook`` runs
*after* it). Only :func:`commgroups.async_and_wait_scope` around the backward reaches it (the
torchtitan trainer opens one around each forward/backward); :func:`fully_shard_on_role` cannot, so
it warns once per role (:data:`HSDP_ALL_REDUCE_WHY`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from commgroups import torch_internals
from commgroups.collectives.async_wait import issue_and_wait_on
from commgroups.integrations.common import role_group

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from commgroups.registry import GroupRegistry

__all__ = [
    "FSDP_ROLE",
    "HSDP_ALL_REDUCE_WHY",
    "async_and_wait_comms",
    "fsdp_mesh",
    "fully_shard_on_role",
    "install_async_and_wait_comms",
]

logger = logging.getLogger(__name__)

FSDP_ROLE = "fsdp"
"""The role FSDP2 shards over in the built-in roles (dp_shard x cp, following torchtitan)."""

ModuleT = TypeVar("ModuleT", bound="nn.Module | list[nn.Module]")

HSDP_ALL_REDUCE_WHY = (
    "FSDP2 issues HSDP's replica all-reduce as a blocking dist.all_reduce and has no hook for it"
)
"""Why the replicate role's HSDP all-reduce stays blocking outside an async-and-wait scope."""


def warn_hsdp_all_reduce_blocking(role: str) -> None:
    """Say (once per role: :mod:`warnings` de-duplicates the text) that ``role``'s calls block.

    For HSDP on a replicate role that asks for async-and-wait where no scope covers the backward.
    """
    warnings.warn(
        f"role {role!r} asks for async_and_wait, but its HSDP all-reduce stays blocking: "
        f"{HSDP_ALL_REDUCE_WHY}; fix: run the backward inside commgroups.async_and_wait_scope()",
        # Attributed to fully_shard_on_role's own line, whoever calls it: warnings' "default"
        # filter then says each role's text once per process (no state of ours to keep).
        stacklevel=2,
    )


def fsdp_mesh(
    registry: GroupRegistry, role: str = FSDP_ROLE, replicate: str | None = None
) -> DeviceMesh:
    """The DeviceMesh FSDP2 shards over: 1-D on ``role``'s group, or 2-D (HSDP) with ``replicate``.

    ``replicate`` names the dim or role FSDP2 replicates over (e.g. ``dp_replicate``); the mesh is then
    ``registry.device_mesh([replicate, role])``, two dedicated groups. Missing roles are a clear error.
    """
    role_group(registry, role, "FSDP2 through the registry",
               f'[[roles]] name = "{role}", dims = ["dp_shard", "cp"]')
    return registry.device_mesh(role if replicate is None else [replicate, role])


def async_and_wait_comms() -> tuple[Any, Any] | None:
    """FSDP2 all-gather and reduce-scatter comms that issue ``async_op=True`` and wait at once.

    Returns ``(all_gather, reduce_scatter)`` for ``FSDPModule.set_custom_all_gather`` and
    ``set_custom_reduce_scatter``, or None where this torch lacks the hooks (they arrived after 2.8).
    """
    classes = torch_internals.fsdp_default_comm_classes()
    if classes is None:
        return None
    DefaultAllGather, DefaultReduceScatter = classes

    class AsyncWaitAllGather(DefaultAllGather):  # type: ignore[misc,valid-type]
        """FSDP2's default all-gather, issued async_op=True and waited at once."""

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                     async_op: bool = False) -> Any:
            # The caller's (all-gather) stream waits on the group's stream.
            work = issue_and_wait_on(group, super().__call__, output_tensor, input_tensor, group,
                                     async_op=async_op, flight_op="fsdp.all_gather")
            return work if async_op else None

    class AsyncWaitReduceScatter(DefaultReduceScatter):  # type: ignore[misc,valid-type]
        """FSDP2's default reduce-scatter, issued async_op=True and waited at once."""

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            work = issue_and_wait_on(group, super().__call__, output_tensor, input_tensor, group,
                                     op, async_op=async_op, flight_op="fsdp.reduce_scatter")
            return work if async_op else None

    return AsyncWaitAllGather(), AsyncWaitReduceScatter()


def fully_shard_on_role(
    module: ModuleT,
    registry: GroupRegistry,
    role: str = FSDP_ROLE,
    *,
    replicate: str | None = None,
    async_and_wait: bool | None = None,
    **kwargs: Any,
) -> ModuleT:
    """``fully_shard(module, mesh=<role's mesh>, **kwargs)``; returns the (now FSDP) module.

    ``kwargs`` are fully_shard's own (``reshard_after_forward``, ``mp_policy``, ...); ``mesh`` is not
    accepted because the role decides it. ``module`` may be a list of modules, as fully_shard
    takes (one group sharded together); each of them gets the comms below. ``replicate`` (a dim or
    role, e.g. ``dp_replicate``) makes it HSDP on ``registry.device_mesh([replicate, role])``.
    ``async_and_wait`` (default: the role's own setting) installs :func:`async_and_wait_comms` so
    FSDP2's collectives are issued async-and-wait (:func:`install_async_and_wait_comms`): a module
    that FSDP2 refuses custom comms for (``shard_placement_fn`` putting parameters on several
    meshes) stays sharded on FSDP2's own comms, with a logged warning.
    HSDP's replica all-reduce is not among them (see the module docs): with ``replicate`` a role
    asking for async-and-wait, a warning says so once per role; run the backward inside
    :func:`commgroups.async_and_wait_scope` to cover it.
    """
    from torch.distributed.fsdp import fully_shard

    if "mesh" in kwargs:
        raise TypeError(
            "fully_shard_on_role: do not pass mesh=; the role decides it (fix: pass role=<name>, or "
            "call torch.distributed.fsdp.fully_shard(module, mesh=...) yourself)"
        )
    # cast: fully_shard's overloads take a module or a list, not ModuleT's union of both.
    fully_shard(cast(Any, module), mesh=fsdp_mesh(registry, role, replicate), **kwargs)
    if registry.spec(role).async_and_wait if async_and_wait is None else async_and_wait:
        install_async_and_wait_comms(module, recurse=False)
    if (replicate is not None and replicate in registry.role_names
            and registry.spec(replicate).async_and_wait and len(registry.ranks(replicate)) > 1):
        warn_hsdp_all_reduce_blocking(replicate)
    return module


def install_async_and_wait_comms(module: nn.Module | Sequence[nn.Module], *,
                                 recurse: bool = True) -> int:
    """Give FSDP2 modules someone else sharded the async-and-wait all-gather and reduce-scatter.

    For frameworks that call ``fully_shard`` themselves (torchtitan): after they have sharded the
    model, this sets FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on
    every FSDP module of ``module`` (itself included) to :func:`async_and_wait_comms`' comms, so each
    FSDP collective is issued ``async_op=True`` and waited at once on the group it already uses.

    FSDP2 refuses custom comms on a module whose parameters it shards over several meshes
    (``shard_placement_fn`` returning per-parameter meshes: MoE experts on efsdp next to dense
    parameters on fsdp). Such modules are skipped (their collectives stay as FSDP2 issues them),
    left out of the count and named in one logged warning per call; every other module still
    gets the comms.

    Args:
        module: a model (or submodule) that ``fully_shard`` was applied to, somewhere inside; or a
            list of them (each is handled as one ``module``).
        recurse: also the FSDP modules below ``module`` (default); False: ``module`` only (one
            that is no FSDP module is then said in a logged warning).

    Returns:
        How many FSDP modules got the comms (0 where this torch lacks the hooks: logged as a
        warning, the collectives then stay as FSDP2 issues them).

    Example::

        trainer = Trainer(config)                        # fully_shard called inside
        install_async_and_wait_comms(trainer.model_parts[0])
    """
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    given = [module] if isinstance(module, nn.Module) else list(module)
    targets = []
    for each in given:
        if recurse:
            targets += [m for m in each.modules() if isinstance(m, FSDPModule)]
        elif isinstance(each, FSDPModule):
            targets.append(each)
        else:
            # Said rather than returning 0 in silence: the caller asked for this module's comms.
            logger.warning("install_async_and_wait_comms(recurse=False): %s is not an FSDP module "
                           "(fully_shard was not applied to it); nothing installed on it",
                           type(each).__name__)
    comms = async_and_wait_comms()
    if comms is None or not all(hasattr(m, "set_custom_all_gather") for m in targets):
        logger.warning(
            "this torch has no FSDP2 custom-comm hooks: FSDP's collectives stay as FSDP2 issues "
            "them; wrap training in commgroups.async_and_wait_scope() instead"
        )
        return 0
    installed, refused = 0, []
    for target in targets:
        try:
            # FSDP2 checks for several parameter groups before changing anything, and both
            # setters check the same: a refused module keeps both of its own comms.
            target.set_custom_all_gather(comms[0])
        except ValueError:
            refused.append(type(target).__name__)
            continue
        target.set_custom_reduce_scatter(comms[1])
        installed += 1
    if refused:
        logger.warning(
            "%d FSDP modules (%s) shard over several meshes (per-parameter meshes from "
            "shard_placement_fn, e.g. MoE experts with ep > 1); FSDP2 takes no custom comms there, "
            "so their collectives stay as FSDP2 issues them", len(refused),
            ", ".join(sorted(set(refused))))
    return installed
