"""Exceptions raised by commgroups.

Every error about a layout is a :class:`LayoutError`. Layout errors are raised before any
communicator exists, and their message names the offending field and how to fix it. Because every
rank validates the same layout with the same code, every rank raises the same error; where ranks hold
*different* layouts, :class:`LayoutMismatchError` is raised on every rank after they compare
fingerprints, so nothing hangs.
"""

from __future__ import annotations

__all__ = [
    "AgreementTimeoutError",
    "BackendUnavailableError",
    "CommGroupsError",
    "DuplicateRoleError",
    "EmptyDimsError",
    "GroupCreationError",
    "InvalidNameError",
    "InvalidSizeError",
    "LayoutError",
    "LayoutFileError",
    "LayoutMismatchError",
    "NotAMemberError",
    "RegistryClosedError",
    "RegistryStateError",
    "RoleCollectiveError",
    "RoleTimeoutError",
    "TorchVersionError",
    "UnknownBackendError",
    "UnknownDimError",
    "UnknownOptionError",
    "WorldSizeMismatchError",
]


class CommGroupsError(Exception):
    """Base class of every error commgroups raises on purpose."""


class LayoutError(CommGroupsError, ValueError):
    """A layout or role spec is invalid; raised before any communicator is created.

    ``field`` is the dotted path of the offending field (``roles[1].dims``) when one applies.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        # (class, field, message) of every problem found; set when built from a validation error.
        self.problems: list[tuple[type[LayoutError], str, str]] = [(type(self), field or "", message)]


class UnknownDimError(LayoutError):
    """A role names a dim that the layout does not have."""


class DuplicateRoleError(LayoutError):
    """Two roles share a name."""


class InvalidSizeError(LayoutError):
    """A dim size is not a whole number >= 1."""


class EmptyDimsError(LayoutError):
    """A layout has no dims, or a role lists none."""


class InvalidNameError(LayoutError):
    """A dim or role name is empty, reserved, or has characters that cannot appear in a group name."""


class UnknownBackendError(LayoutError):
    """A role asks for a backend commgroups does not know."""


class UnknownOptionError(LayoutError):
    """A role sets an option its backend does not have, or options for another backend."""


class WorldSizeMismatchError(LayoutError):
    """The layout's world size (product of dims) differs from the running job's world size."""


class LayoutFileError(LayoutError):
    """A layout file cannot be read or parsed (missing, unknown suffix, bad syntax)."""


class LayoutMismatchError(LayoutError):
    """Ranks built different layouts; raised on every rank, naming the ranks that differ."""


class AgreementTimeoutError(CommGroupsError, TimeoutError):
    """Not every rank reached the fingerprint agreement in time (a rank died or never called create)."""


class BackendUnavailableError(CommGroupsError, RuntimeError):
    """A role's backend cannot be used on this machine (NCCL without CUDA, HCCL without torch_npu)."""


class TorchVersionError(CommGroupsError, RuntimeError):
    """A feature needs a newer torch than the one running; names the version and why."""


class GroupCreationError(CommGroupsError, RuntimeError):
    """Creating a role's group failed after agreement (a peer died, a backend refused); names the role.

    The registry destroys the groups it had already made on this rank before raising.
    """


class RegistryStateError(CommGroupsError, RuntimeError):
    """A registry was used in the wrong state (not created yet, created twice)."""


class RegistryClosedError(RegistryStateError):
    """A registry was used after :meth:`~commgroups.GroupRegistry.close`."""


class NotAMemberError(CommGroupsError, LookupError):
    """This rank belongs to no group of the role (only roles with explicit rank groups allow that)."""


class RoleCollectiveError(CommGroupsError, RuntimeError):
    """A collective issued through ``registry.collectives(role)`` failed (e.g. a peer died).

    Names the role, the op and the call's sequence number on that role.
    """

    def __init__(self, message: str, *, role: str, op: str, seq: int) -> None:
        super().__init__(message)
        self.role = role
        self.op = op
        self.seq = seq


class RoleTimeoutError(RoleCollectiveError, TimeoutError):
    """A collective on a role's group timed out; names the role, the op and the sequence number."""
