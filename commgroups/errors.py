"""Exceptions raised by commgroups: every exception class of the package is defined here.

Every error about a layout is a :class:`LayoutError`; a bad argument to a registry method or a
command is an :class:`ArgumentError`. Layout errors are raised before any
communicator exists, and their message names the offending field and how to fix it. Each subclass
means what its name says; its docstring lists the inputs that raise it. Because every
rank validates the same layout with the same code, every rank raises the same error; where ranks hold
*different* layouts, :class:`LayoutMismatchError` is raised on every rank after they compare
fingerprints, so nothing hangs.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AgreementTimeoutError",
    "ArgumentError",
    "AttemptClosed",
    "AuditFileError",
    "BackendUnavailableError",
    "BenchDependencyError",
    "CheckpointExistsError",
    "CommGroupsError",
    "ConcurrentRoleUseError",
    "DimOrderError",
    "DimsOrRanksError",
    "DuplicateRoleError",
    "EmptyDimsError",
    "FlightDumpError",
    "GroupCreationError",
    "IncompleteCheckpointError",
    "InvalidAutoDimError",
    "InvalidNameError",
    "InvalidElasticError",
    "InvalidOptionError",
    "InvalidRanksError",
    "InvalidSizeError",
    "InvalidViewError",
    "LayoutError",
    "LeftOutError",
    "LossInterruptedError",
    "LayoutFileError",
    "LayoutMismatchError",
    "MegatronUnavailableError",
    "MeshNotPlannedError",
    "MeshRequestError",
    "MissingRoleError",
    "NotAMemberError",
    "RebuildError",
    "RegistryClosedError",
    "RegistryNotCreatedError",
    "RegistryStateError",
    "ReplanError",
    "RoleCollectiveError",
    "RoleHangError",
    "RoleTimeoutError",
    "StaleGenerationError",
    "StoreUnreachableError",
    "SurvivorLostError",
    "TitanSeamError",
    "TorchVersionError",
    "UnknownBackendError",
    "UnknownDimError",
    "UnknownFieldError",
    "WorldFailed",
    "WorldInitError",
    "WorldSizeMismatchError",
]


class CommGroupsError(Exception):
    """Base class of every error commgroups raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields (role, op, seq, field, ...) that pickle's default
        # (``cls(*args)``) drops: an error raised in a worker process must reach its parent whole.
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def _rebuilt(cls: type[CommGroupsError], args: tuple[Any, ...],
             state: dict[str, Any]) -> CommGroupsError:
    fields = inspect.signature(cls.__init__).parameters.values()
    error = cls(*args, **{p.name: state[p.name] for p in fields
                          if p.kind is p.KEYWORD_ONLY and p.name in state})
    error.__dict__.update(state)
    return error


class LayoutError(CommGroupsError, ValueError):
    """A layout or role spec is invalid; raised before any communicator exists.

    Catch this to catch every problem with the layout (its dims, views, roles and their options,
    the elastic section, the layout file, and the layout against the running job); the subclasses
    below name the kind of problem, and ``field`` names where it is. Input beyond the bounds of
    :mod:`commgroups.layout.limits` (world size, dims, nesting, YAML alias expansion) is refused the
    same way. ``LayoutError`` itself is raised for a required field that is missing (a role without
    ``name``), a value of the wrong type or out of range outside dims, ranks and options
    (``timeout_s = -1``, ``timeout_s = true``, ``async_and_wait = "yes"``), and input nested too
    deep or too large. A bad argument to the registry or a command is an :class:`ArgumentError`
    instead, not a LayoutError.

    Attributes:
        field: dotted path of the offending field (``roles[1].dims``), or ``None``.
        problems: ``(class, field, message)`` of every problem found; the exception's class and
            ``field`` are those of the first.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        # (class, field, message) of every problem found; set when built from a validation error.
        self.problems: list[tuple[type[LayoutError], str, str]] = [(type(self), field or "", message)]


class ArgumentError(CommGroupsError, ValueError):
    """A bad argument to a registry method or a command, not a problem of the layout.

    Raised for ``GroupRegistry(creation_mode=..., create_timeout_s=...)``, ``set_timeout`` and
    ``rebuild(timeout=...)`` outside the timeout bounds, ``device_mesh`` / ``meshes=`` given
    something that is not a name or a list of names, and command-line options (``--rank``,
    ``--measured``, ``--kill-rank``, ``--steps``, ...). It is a ``ValueError``, like LayoutError.

    Attributes:
        field: the argument's name (``creation_mode``, ``--rank``), or ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class LayoutFileError(LayoutError):
    """A layout file cannot be read or parsed.

    Raised by :func:`~commgroups.load_layout` / :func:`~commgroups.parse_layout` for a missing or
    unreadable file, a suffix other than .toml/.yaml/.yml/.json, bad syntax, or a file whose top
    level is not a mapping.
    """


class LayoutMismatchError(LayoutError):
    """Ranks built different layouts; raised on every rank, naming the ranks and fields that differ."""


class WorldSizeMismatchError(LayoutError):
    """The layout's world size (product of dims) differs from the running job's world size.

    Also raised by :meth:`commgroups.AutoLayout.resolve` (and so by ``GroupRegistry`` on an auto
    layout) when the world size is not a multiple of the fixed dims' product, or gives the
    ``"auto"`` dim a size below its elastic minimum.
    """


class InvalidNameError(LayoutError):
    """A dim or role name is not allowed.

    Raised for ``dims = {"1cp": 2}``, the reserved dim name ``"world"``, a view named ``"dims"``,
    or a role named ``"bad name"``: names start with a letter and use letters, digits, ``_`` or
    ``-``; and, in a layout without roles, for a dim named like a built-in role that is not its
    own (``checkpoint-metadata``, or ``fsdp`` beside dp, dp_shard or cp).
    """


class InvalidSizeError(LayoutError):
    """A dim size (in ``dims`` or a view) is not a whole number >= 1 (``cp = 0``, ``cp = "4"``)."""


class EmptyDimsError(LayoutError):
    """A layout or a view has no dims (``dims = {}``), or a role lists none (``dims = []``)."""


class UnknownDimError(LayoutError):
    """A name that must be a layout dim is not one.

    Raised for a role whose ``dims`` names a dim the layout lacks, by ``Layout.with_dims`` for a
    name that is not a dim, and by ``registry.device_mesh`` for an axis name that is neither a dim
    nor a role.
    """


class DimOrderError(LayoutError):
    """Dims are not listed once each in the order of one factorization (``dims`` or one view).

    Raised for a role with ``dims = ["a", "a"]`` or ``dims = ["b", "a"]`` when the layout's dims are
    ``{a, b}``, for a role that mixes dims of ``dims`` and a view (no order holds them), for a
    role's ``dims`` given as a set (no order at all: each process would read its own), and by
    ``registry.device_mesh`` for axes that overlap or are out of layout order.
    """


class InvalidViewError(LayoutError):
    """A layout view is not another factorization of the same ranks.

    Raised when a view's sizes multiply to another world size than ``dims``, or a dim name it shares
    with ``dims`` (or another view) groups other ranks there. A view's bad names and sizes raise
    :class:`InvalidNameError` / :class:`InvalidSizeError`, an empty view :class:`EmptyDimsError`.
    """


class DimsOrRanksError(LayoutError):
    """A role sets both ``dims`` and ``ranks``, or neither; it needs exactly one."""


class InvalidRanksError(LayoutError):
    """A role's explicit rank groups (``ranks``) are not valid.

    Raised for an empty list or an empty group, a negative rank, a rank outside the world size,
    a rank in two groups of the same role, or a rank that is not an integer.
    """


class DuplicateRoleError(LayoutError):
    """Two roles share a name."""


class UnknownBackendError(LayoutError):
    """A role asks for a backend commgroups does not know (``backend = "mpi"``)."""


class UnknownFieldError(LayoutError):
    """A spec has a field it does not know (a typo such as ``timeout`` for ``timeout_s``).

    Raised for unknown keys at any level: the layout, a role, ``options`` (``options.mpi``) or an
    option section (``options.nccl.bogus``). The message lists the known fields.
    """


class InvalidOptionError(LayoutError):
    """A known backend option has a value or combination that is not valid.

    Raised for an option out of range or of the wrong type (``cga_cluster_size = 9``),
    ``min_ctas > max_ctas``, an ``options.hccl.config`` key that has a typed field
    (``hccl_buffer_size``), or an option section the role's backend does not use (``options.nccl``
    on a gloo role).
    """


class InvalidElasticError(LayoutError):
    """The layout's ``elastic`` section cannot work.

    Raised for an elastic dim the layout's ``dims`` lack, a dim that may never shrink (``pp``,
    ``cp``, ``tp``, ``ep``: their shards cannot be redistributed among survivors), a minimum size
    above the dim's size, an elastic dim missing from a view (the view could not shrink with it),
    and roles with explicit ``ranks`` (they cannot be re-derived on a smaller world).
    """


class InvalidAutoDimError(LayoutError):
    """A dim size is ``"auto"`` where the world size cannot decide it.

    Raised for ``"auto"`` in :class:`commgroups.Layout` (which needs sizes; use
    :class:`commgroups.AutoLayout`), more than one ``"auto"`` dim, no ``"auto"`` dim in an
    AutoLayout, an ``"auto"`` dim the ``elastic`` section does not name, and a view that lacks the
    ``"auto"`` dim or gives another dim ``"auto"``.
    """


class ReplanError(CommGroupsError, ValueError):
    """The surviving ranks cannot form the layout on a smaller world.

    Raised by :func:`commgroups.rank_loss.replan` when a lost rank sits in a group of a dim that may not
    shrink (``"cp group [4, 5, 6, 7] lost rank 5; cp may not shrink"``), when shrinking would take an
    elastic dim below its minimum, and for survivor lists that name ranks outside the world. The
    message names the dim, the group and the lost ranks.
    """


class AgreementTimeoutError(CommGroupsError, TimeoutError):
    """Not every rank reached the fingerprint agreement in time (a rank died or never called create)."""


class LossInterruptedError(CommGroupsError, RuntimeError):
    """A wait for every rank (torchtitan's timeout switch) ended because a rank-loss report
    interrupted the registry's generation: a rank that died before arriving never will. Fails as
    the generation's collectives do, in about a second rather than after the wait's timeout."""


class SurvivorLostError(LossInterruptedError):
    """A survivor died during ``rebuild()``, after the survivors were decided: a peer on its host
    saw its process gone while the others waited for it in the next generation's agreement, and
    every survivor stopped the attempt at once. ``rebuild()`` rebuilds without it by itself
    (:data:`~commgroups.registry.REBUILD_RETRIES` times at most); this is raised where that ran
    out.

    Attributes:
        lost: the global ranks seen dead.
    """

    def __init__(self, message: str, *, lost: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.lost = tuple(lost)


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


class RegistryNotCreatedError(RegistryStateError, ValueError):
    """A registry was used before :meth:`~commgroups.GroupRegistry.create` made its groups.

    One class wherever a created registry is needed: the registry's lookups, the audit
    (``cg.audit.record(registry)``) and the torchtitan integration. Both a ``RuntimeError``
    (as :class:`RegistryStateError`) and a ``ValueError`` (what the audit raised before), so
    callers catching either keep working.
    """


class RegistryClosedError(RegistryStateError):
    """A registry was used after :meth:`~commgroups.GroupRegistry.close`."""


class StaleGenerationError(RegistryStateError):
    """A group of a retired generation was used through the registry; names the role and generation.

    :meth:`~commgroups.GroupRegistry.rebuild` retires every group of generation ``g`` (they hold a
    dead rank) and creates generation ``g + 1``. A ``registry.collectives(role)`` handle taken
    before raises this on its next call, and so does the registry while a rebuild failed half-way
    (generation ``g`` retired, ``g + 1`` not made): take the handle again after a successful
    rebuild. A retired group is never silently reused.
    """

    def __init__(self, message: str, *, role: str | None, generation: int) -> None:
        super().__init__(message)
        self.role = role
        self.generation = generation


class RebuildError(CommGroupsError, RuntimeError):
    """:meth:`~commgroups.GroupRegistry.rebuild` cannot give this rank a rebuilt registry.

    Raised when this rank checked in after the survivors were decided without it (it counts as
    lost), when ``alive`` is malformed (not global ranks of the old generation, or missing this
    rank), when a role's backend cannot be rebuilt in place here (an NCCL group split from a bound
    default group that still holds the dead rank, where no world role can be shrunk instead: see
    :mod:`commgroups.creation.shrink`), and when the registry is not in a state to
    rebuild (never created, closed, or this rank was left out as a spare). Rebuilding that fails
    while creating raises :class:`GroupCreationError` instead; calling ``rebuild()`` again on every
    survivor starts a fresh attempt.
    """



class LeftOutError(RebuildError):
    """This rank reached :meth:`~commgroups.GroupRegistry.rebuild`'s check-in after the survivors
    were decided without it. It is out of the job for good: its registry is ``dropped`` and a
    retry raises again, so it can never form a world of its own beside the survivors'."""

class NotAMemberError(CommGroupsError, LookupError):
    """This rank belongs to no group of the role (only roles with explicit rank groups allow that)."""


class RoleCollectiveError(CommGroupsError, RuntimeError):
    """A collective issued through ``registry.collectives(role)`` failed (e.g. a peer died).

    Names the role, the op and the call's sequence number on that role.
    """

    def __init__(self, message: str, *, role: str, op: str, seq: int,
                 flight: dict[str, Any] | None = None, cause: str = "") -> None:
        super().__init__(message)
        self.role = role
        self.op = op
        self.seq = seq
        self.cause = cause
        """The first line of the backend's own error (kept when the text is rewritten)."""
        self.flight = flight
        """With the flight recorder on: every rank of the role compared with this call (behind,
        ahead, mismatch, silent: :class:`commgroups.flight_recorder.diagnosis.Diagnosis`)."""


class RoleTimeoutError(RoleCollectiveError, TimeoutError):
    """A collective on a role's group timed out; names the role, the op and the sequence number."""


class RoleHangError(RoleTimeoutError):
    """A role's collective timed out and the flight recorder names why: the ranks that did not
    reach it (what each last issued on the role, and where it is now), ranks that issued another
    op at the same sequence number (both call sites), ranks with no fresh status (dead or frozen)
    and ranks ahead. The text is short; ``flight`` holds every rank's details and ``flight["dump"]``
    the file this rank's recorder was written to.
    """


class ConcurrentRoleUseError(CommGroupsError, RuntimeError):
    """A second thread issued on a role another live thread issues on; names the role, both threads
    and both call sites.

    Ranks pair a group's collectives by issue order, and two threads interleave differently on each
    rank, so their calls would silently meet the wrong peers' data (wrong sums, no error). A
    ``registry.collectives(role)`` handle belongs to the first thread that issues on it (or the one
    that calls ``adopt()``); other threads are refused before anything is issued. Give each thread
    its own role.
    """

    def __init__(self, message: str, *, role: str, op: str) -> None:
        super().__init__(message)
        self.role = role
        self.op = op


class StoreUnreachableError(CommGroupsError, ConnectionError):
    """The default group's store stopped answering (its host died); names the host and what waited.

    Raised during agreement and creation instead of a timeout when the store itself fails, which
    happens at once rather than after ``create_timeout_s``: the rank hosting a TCPStore (rank 0 under
    ``init_process_group``'s env:// rendezvous) died or its network went away.
    """


class MeshRequestError(LayoutError):
    """``registry.device_mesh`` was asked for a mesh its layout cannot give.

    A checkpoint (non-compute) role as an axis, a role with explicit rank groups, or axes on
    different device types. An argument that is not a name or a list of names is an
    :class:`ArgumentError`.
    """


class MeshNotPlannedError(MeshRequestError):
    """A mesh axis is a dim that no role covers and no declared mesh planned a group for.

    Lookups never create groups (the guide, 'Creation happens in create() and rebuild()'):
    declare the mesh, ``GroupRegistry(layout, meshes=[[...]])``, or add a role over the dim.
    """


class FlightDumpError(CommGroupsError, ValueError):
    """A directory holds no readable flight-recorder dump (``commgroups flight merge DIR``)."""


class AuditFileError(CommGroupsError, ValueError):
    """An audit directory or file cannot be read as commgroups audit output."""


class MissingRoleError(CommGroupsError, LookupError):
    """An integration needs a role the registry's layout does not declare."""


class IncompleteCheckpointError(CommGroupsError, FileNotFoundError):
    """A checkpoint directory has no ``.metadata``: its save did not finish."""


class CheckpointExistsError(CommGroupsError, FileExistsError):
    """``save`` would write over a complete checkpoint without ``overwrite=True``."""


class MegatronUnavailableError(CommGroupsError, ImportError):
    """Megatron-Core cannot be imported; the message names ``pip install 'commgroups[megatron]'``."""


class TitanSeamError(CommGroupsError, RuntimeError):
    """The installed torchtitan differs from what commgroups was checked on (see the message)."""


class BenchDependencyError(CommGroupsError):
    """An optional dependency of ``commgroups bench`` is missing."""


class AttemptClosed(Exception):  # a signal between two functions, not an error
    """A rank checked in to a rebuild's check-in attempt that was closed (decided, then its
    generation failed to be made): :func:`commgroups.rank_loss.check_in.check_in_at_open_attempt`
    catches it and checks in at the open attempt. It never reaches the user; deliberately not a
    :class:`CommGroupsError` (nor a ``RuntimeError``, which the store's guard would take for the
    store failing)."""


class WorldInitError(RuntimeError):
    """A peer failed to join a local world, so this rank did not run the function.

    Raised by :func:`commgroups.util.local_world.run_local_world`. Like :class:`WorldFailed`, a
    report of the process harness (it carries what a crashed process said), not an error about
    commgroups' input, so deliberately not a :class:`CommGroupsError`.
    """


class WorldFailed(RuntimeError):
    """A benchmark rank raised, crashed or did not finish in time; holds each rank's traceback.

    Raised by :func:`commgroups.bench.world.run_world`; not a :class:`CommGroupsError` (see
    :class:`WorldInitError`).
    """
