"""FSDP2 on the registry's fsdp role: ``fully_shard`` over a mesh built from the role's own group.

With plain ``init_device_mesh``, FSDP over ``dp_shard x cp`` is ``mesh["dp_shard", "cp"]._flatten()``,
which is the *default* group whenever the product spans the world; FSDP's ``async_op=True``
collectives then share a communicator with everything else on the default group. The registry's
``device_mesh("fsdp")`` is a 1-D mesh on the fsdp role's dedicated group instead::

    from commgroups.integrations.fsdp import fully_shard_on_role
    for block in model.blocks:
        fully_shard_on_role(block, registry)
    fully_shard_on_role(model, registry)

This is exactly ``fully_shard(module, mesh=registry.device_mesh("fsdp"), **kwargs)``; use that form
directly if you prefer. HSDP (a 2-D replicate x shard mesh) is not covered here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from commgroups.integrations.common import role_group

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from commgroups.registry import GroupRegistry

__all__ = ["FSDP_ROLE", "fsdp_mesh", "fully_shard_on_role"]

FSDP_ROLE = "fsdp"
"""The role FSDP2 shards over in the built-in roles (dp_shard x cp, following torchtitan)."""

ModuleT = TypeVar("ModuleT", bound="nn.Module")


def fsdp_mesh(registry: GroupRegistry, role: str = FSDP_ROLE) -> DeviceMesh:
    """The 1-D DeviceMesh on ``role``'s dedicated group (a clear error when the role is missing)."""
    role_group(registry, role, "FSDP2 through the registry",
               f'[[roles]] name = "{role}", dims = ["dp_shard", "cp"]')
    return registry.device_mesh(role)


def fully_shard_on_role(
    module: ModuleT, registry: GroupRegistry, role: str = FSDP_ROLE, **kwargs: Any
) -> ModuleT:
    """``fully_shard(module, mesh=<role's mesh>, **kwargs)``; returns the (now FSDP) module.

    ``kwargs`` are fully_shard's own (``reshard_after_forward``, ``mp_policy``, ...); ``mesh`` is not
    accepted because the role decides it.
    """
    from torch.distributed.fsdp import fully_shard

    if "mesh" in kwargs:
        raise TypeError(
            "fully_shard_on_role: do not pass mesh=; the role decides it (fix: pass role=<name>, or "
            "call torch.distributed.fsdp.fully_shard(module, mesh=...) yourself)"
        )
    fully_shard(module, mesh=fsdp_mesh(registry, role), **kwargs)
    return module
