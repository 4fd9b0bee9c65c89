"""The small interface every communicator backend adapter implements.

An adapter turns a backend's option section and a timeout into ``new_group`` arguments. Adapters know
nothing of roles, layouts or registries: they only speak torch.distributed.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from torch.distributed import constants

from commgroups.layout.specs import RoleOptions

__all__ = ["BackendAdapter", "GroupArgs"]


@dataclass(frozen=True)
class GroupArgs:
    """Arguments for ``torch.distributed.new_group`` (and ``split_group``) for one group."""

    backend: str
    pg_options: Any | None
    timeout: timedelta


class BackendAdapter(ABC):
    """How one backend creates groups: its torch name, device type, options and capabilities."""

    name: ClassVar[str]
    """commgroups' name: gloo, nccl, rccl, hccl, fake or single (a one-rank group)."""
    torch_backend: ClassVar[str]
    """The name torch.distributed knows (RCCL is "nccl" there)."""
    device_type: ClassVar[str]
    """DeviceMesh device type for groups of this backend."""
    supports_split: ClassVar[bool] = False
    """Whether ``split_group`` (ncclCommSplit) can create its groups."""
    supports_local_creation: ClassVar[bool] = True
    """Whether member-only creation (``use_local_synchronization=True``) is safe."""
    created_by_members: ClassVar[bool] = False
    """Whether each group is always created by its members alone (never all-ranks or split)."""
    serves_every_device: ClassVar[bool] = False
    """Whether the group runs collectives on tensors of any device (``device_type`` is nominal)."""
    has_timeout: ClassVar[bool] = True
    """Whether the group's collectives can time out (and take a new timeout in place)."""
    connects_on_create: ClassVar[bool] = False
    """Whether creating a group rendezvouses with its peers under the group's own timeout (gloo;
    NCCL with eager init), so that creation must be bounded by the registry's create timeout."""

    aborts: ClassVar[bool] = False
    """Whether :meth:`abort` frees a group whose peer died (gloo's abort does not free a blocked
    collective: its groups are severed instead, see ``severs``). True for NCCL/RCCL
    (``ncclCommAbort``) and HCCL (``ProcessGroupHCCL::abort``)."""

    severs: ClassVar[bool] = False
    """Whether the group's TCP sockets can be shut down to free its blocked collectives, on this
    rank and its peers (:mod:`commgroups.creation.sockets`): gloo, whose ``abort()`` frees nothing."""

    # Shrinking (torch.distributed.shrink_group: a group's survivors get a new communicator without
    # the dead ranks, no rendezvous with them) is not a class constant: it depends on the torch and
    # NCCL a job runs (NCCL >= 2.27), so it is asked of a live group: shrink_blocker() / shrinks().

    def check_available(self) -> None:
        """Raise BackendUnavailableError when this backend cannot run on this machine."""

    def abort(self, group: Any) -> None:
        """Free ``group``'s communicator after a rank loss, without talking to its peers.

        Called by ``registry.rebuild()`` on the retired generation. The default does nothing: the
        group stays referenced (never destroyed: destroying a group with a dead peer may block).
        """

    def shrink_blocker(self, group: Any) -> str | None:
        """Why ``group`` cannot be shrunk to its survivors here, or None when it can.

        Decided at run time, on a live group: ``torch.distributed.shrink_group`` must exist and
        the group's backend must report ``supports_shrinking``. The default: this backend never
        shrinks (torch's shrink_group serves NCCL only; gloo's backend reports False).
        """
        return f"backend {self.name} cannot shrink a group (torch's shrink_group serves NCCL only)"

    def shrinks(self, group: Any) -> bool:
        """Whether ``group`` can be shrunk to its survivors here (:meth:`shrink_blocker` is None)."""
        return self.shrink_blocker(group) is None

    def default_timeout(self) -> timedelta:
        """torch's default collective timeout for this backend: its general process-group default
        (30 minutes) unless the backend has its own."""
        return constants.default_pg_timeout

    def make_options(self, options: RoleOptions, timeout: timedelta) -> Any | None:
        """A fresh backend options object (never shared between groups), or None."""
        return None

    def group_args(self, options: RoleOptions, timeout_s: float | None) -> GroupArgs:
        """``new_group`` arguments; the timeout is always explicit (c10d overwrites Options' own)."""
        timeout = self.default_timeout() if timeout_s is None else timedelta(seconds=timeout_s)
        return GroupArgs(
            backend=self.torch_backend,
            pg_options=self.make_options(options, timeout),
            timeout=timeout,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
