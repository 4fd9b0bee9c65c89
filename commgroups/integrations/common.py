"""What the integrations share: looking a role up on a registry with an error that names the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from commgroups.errors import MissingRoleError  # defined there; importable from here as before

if TYPE_CHECKING:
    from commgroups.registry import GroupRegistry

__all__ = ["MissingRoleError", "role_group"]


def role_group(registry: GroupRegistry, role: str, purpose: str, example: str) -> dist.ProcessGroup:
    """``registry.group(role)``, or a :class:`MissingRoleError` naming the role and how to add it.

    ``purpose`` says what the integration needs the role for; ``example`` is a layout snippet that adds
    it (both go into the message).
    """
    if role not in registry.role_names:
        raise MissingRoleError(
            f"{purpose} needs the role {role!r}, but the registry's layout declares only "
            f"{', '.join(registry.role_names) or 'no roles'}; fix: add it to the layout, e.g. "
            f"{example}, or pass role=<an existing role>"
        )
    return registry.group(role)
