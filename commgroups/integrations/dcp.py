"""DCP save, load and async_save whose plan and metadata exchange runs on the registry's gloo group.

``torch.distributed.checkpoint`` exchanges SavePlans and metadata with object collectives
(``gather_object``, ``scatter_object_list``, ``broadcast_object_list``, ``all_gather_object``). On the
default group of a device backend those stage pickled plans as device tensors; on HCCL at 256-512
ranks this deadlocked, and moving the exchange to a gloo group fixed it (and cut device memory during
save to zero). These wrappers take torch's signatures plus ``registry=`` and pass the registry's
checkpoint-metadata group as ``process_group``::

    from commgroups.integrations import dcp
    dcp.save(state_dict, checkpoint_id=path, registry=registry)
    dcp.load(state_dict, checkpoint_id=path, registry=registry)
    dcp.async_save(state_dict, checkpoint_id=path, registry=registry).result()

Nothing is lost: DCP marks a checkpoint complete by writing ``.metadata`` last, atomically, after
every rank has written its data, so a save that dies half-way leaves no ``.metadata``. :func:`load`
refuses such a directory (:class:`IncompleteCheckpointError`) and :func:`checkpoint_complete` tells.
:func:`save` refuses to write over a complete checkpoint unless ``overwrite=True`` (a half-written
overwrite would otherwise leave the old ``.metadata`` pointing at new, partial data files); with
``overwrite=True`` the coordinator removes the old ``.metadata`` before any rank writes, so a failed
overwrite is incomplete rather than corrupt. Save each step to a new ``checkpoint_id`` to always
keep the previous checkpoint loadable.

Staged roll-out: set ``COMMGROUPS_DCP_DEFAULT_GROUP=1`` in the job's environment and these calls pass
``process_group=None`` instead (DCP's own default: the default group), without a code change. The
library only reads the variable. Accepted values: 1/true/yes/on and 0/false/no/off (or unset).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from commgroups.errors import (  # the two checkpoint errors are importable from here as before
    ArgumentError,
    CheckpointExistsError,
    CommGroupsError,
    IncompleteCheckpointError,
    RoleCollectiveError,
    RoleTimeoutError,
)
from commgroups.flight_recorder import index as flight_index
from commgroups.integrations.common import role_group
from commgroups.layout.specs import CHECKPOINT_ROLE
from commgroups.util.error_text import fit_lines

if TYPE_CHECKING:

    from torch.distributed.checkpoint.metadata import Metadata

    from commgroups.registry import GroupRegistry

__all__ = [
    "DEFAULT_GROUP_ENV",
    "CheckpointExistsError",
    "IncompleteCheckpointError",
    "async_save",
    "checkpoint_complete",
    "checkpoint_group",
    "load",
    "save",
]

logger = logging.getLogger(__name__)

DEFAULT_GROUP_ENV = "COMMGROUPS_DCP_DEFAULT_GROUP"
"""Environment switch: truthy means DCP uses the default group instead of the checkpoint role's."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


METADATA_FILE = ".metadata"
"""DCP's marker of a complete checkpoint (written last, by rename, by the coordinator)."""


def checkpoint_complete(checkpoint_id: str | os.PathLike[str]) -> bool:
    """True when the DCP checkpoint directory ``checkpoint_id`` finished saving (has .metadata)."""
    return (Path(checkpoint_id) / METADATA_FILE).is_file()


def _path_of(checkpoint_id: Any, storage: Any) -> Path | None:
    """The filesystem directory of a save/load, when it is one commgroups can check."""
    if storage is not None or checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in str(checkpoint_id):
        return Path(checkpoint_id)
    return None


def _is_coordinator(group: dist.ProcessGroup | None, kwargs: Mapping[str, Any]) -> bool:
    """Whether this rank is DCP's coordinator: rank 0 of the exchange group (or alone)."""
    if kwargs.get("no_dist") or not dist.is_initialized():
        return True
    return dist.get_rank() == (0 if group is None else dist.get_global_rank(group, 0))


def use_default_group(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`DEFAULT_GROUP_ENV` asks for the default group (read from ``os.environ``).

    An unrecognised value is an error rather than a guess: a typo must not silently change which
    communicator a 512-rank save runs on.
    """
    value = (os.environ if environ is None else environ).get(DEFAULT_GROUP_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ArgumentError(
        f"{DEFAULT_GROUP_ENV}={value!r} is not understood; fix: set it to 1 (use the default group) "
        "or 0 / unset it (use the registry's checkpoint group)"
    )


def checkpoint_group(
    registry: GroupRegistry, role: str = CHECKPOINT_ROLE
) -> dist.ProcessGroup | None:
    """The group DCP should use: the ``role`` group, or None (DCP's default) under the fallback switch.

    Raises :class:`~commgroups.integrations.MissingRoleError` when the layout lacks ``role``, even when
    the switch is on, so a layout error does not hide until the switch is turned off.
    """
    group = role_group(
        registry,
        role,
        "DCP through the registry",
        f'[[roles]] name = "{role}", dims = "world", backend = "gloo"',
    )
    if use_default_group():
        logger.warning(
            "%s is set: DCP plan/metadata exchange runs on the default group, not role %r",
            DEFAULT_GROUP_ENV, role,
        )
        return None
    return group


def _resolve(
    registry: GroupRegistry, role: str, process_group: dist.ProcessGroup | None, fn: str
) -> dist.ProcessGroup | None:
    if process_group is not None:
        # Two sources for one choice: refuse rather than pick one behind the caller's back.
        raise ArgumentError(
            f"commgroups.integrations.dcp.{fn}: got both registry= and process_group=; fix: pass "
            f"only registry= (role {role!r} is used) or call torch.distributed.checkpoint.{fn} directly"
        )
    return checkpoint_group(registry, role)


def _guard_overwrite(
    checkpoint_id: Any,
    storage_writer: Any,
    overwrite: bool,
    group: dist.ProcessGroup | None,
    kwargs: Mapping[str, Any],
) -> None:
    """Refuse to write over a complete checkpoint, or (``overwrite``) un-complete it first."""
    path = _path_of(checkpoint_id, storage_writer)
    if path is None or not checkpoint_complete(path):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{path} already holds a complete checkpoint; fix: save each step to a new "
            "checkpoint_id (keeps the previous one loadable), or pass overwrite=True"
        )
    if _is_coordinator(group, kwargs):
        # Before any rank writes (they start after the coordinator's plan exchange), so a save that
        # fails from here on leaves an incomplete checkpoint, never a corrupt complete one.
        (path / METADATA_FILE).unlink(missing_ok=True)


@contextmanager
def _named(op: str, role: str, group: dist.ProcessGroup | None, checkpoint_id: Any) -> Iterator[None]:
    """Turn a failure of DCP's exchange (a peer died, a timeout) into an error naming the role.

    DCP raises what its collectives raised (a gloo ``RuntimeError``) or a ``CheckpointException``
    gathering every rank's failures; neither says which communicator failed. The sequence number
    is 0: DCP's own collectives are not counted.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    recorder = flight_index.lookup(group)  # one flight-recorder entry per save or load
    entry = (recorder.start(f"dcp.{op}", (), True, False, sys._getframe(1))
             if recorder is not None else None)
    failed: BaseException | None = None
    try:
        yield
    except CommGroupsError as error:
        failed = error
        raise
    except (RuntimeError, CheckpointException) as error:
        failed = error
        text = " ".join(str(error).split()) or repr(error)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        where = (f"group {group.group_name!r}" if group is not None else
                 f"the default group ({DEFAULT_GROUP_ENV} is set)")
        cls = RoleTimeoutError if timed_out else RoleCollectiveError
        # torch's own text gets what the bound leaves (the whole error stays the __cause__).
        head = f"role {role!r}: dcp.{op} of {checkpoint_id} failed on {where}: {type(error).__name__}: "
        tail = ("; fix: check that every rank of the role is alive and uses the same checkpoint "
                "(a failed save is never complete: load the previous one)")
        raise cls(fit_lines(head, [text], tail), role=role, op=f"dcp.{op}", seq=0) from error
    except BaseException as error:
        failed = error
        raise
    finally:
        if recorder is not None and entry is not None:
            recorder.end(entry, failed)


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    registry: GroupRegistry,
    role: str = CHECKPOINT_ROLE,
    overwrite: bool = False,
    **kwargs: Any,
) -> Metadata:
    """``torch.distributed.checkpoint.save`` with the plan/metadata exchange on ``role``'s group.

    Other keywords (``no_dist``, ``use_collectives``, ...) pass through to torch unchanged. Writing
    over a complete checkpoint directory needs ``overwrite=True`` (see the module docs).
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    group = _resolve(registry, role, process_group, "save")
    _guard_overwrite(checkpoint_id, storage_writer, overwrite, group, kwargs)
    with _named("save", role, group, checkpoint_id):
        metadata: Metadata = dcp_save(state_dict, checkpoint_id=checkpoint_id,
                                      storage_writer=storage_writer, planner=planner,
                                      process_group=group, **kwargs)
    return metadata


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    registry: GroupRegistry,
    role: str = CHECKPOINT_ROLE,
    **kwargs: Any,
) -> None:
    """``torch.distributed.checkpoint.load`` (in place) with the exchange on ``role``'s group.

    A checkpoint directory whose save did not finish raises :class:`IncompleteCheckpointError`.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    group = _resolve(registry, role, process_group, "load")
    path = _path_of(checkpoint_id, storage_reader)
    if path is not None and not checkpoint_complete(path):
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint (no {METADATA_FILE}: its save did not finish, or "
            "the path is wrong); fix: load the previous complete checkpoint"
        )
    with _named("load", role, group, checkpoint_id):
        dcp_load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                 planner=planner, process_group=group, **kwargs)


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    registry: GroupRegistry,
    role: str = CHECKPOINT_ROLE,
    overwrite: bool = False,
    **kwargs: Any,
) -> Any:
    """``torch.distributed.checkpoint.async_save`` with the exchange on ``role``'s group.

    Returns what torch returns (a Future, or an AsyncSaveResponse on newer torch). DCP requires a
    group with a CPU backend here: the default checkpoint role (gloo) is one. Writing over a
    complete checkpoint directory needs ``overwrite=True``, as for :func:`save`.
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

    group = _resolve(registry, role, process_group, "async_save")
    _guard_overwrite(checkpoint_id, storage_writer, overwrite, group, kwargs)
    with _named("async_save", role, group, checkpoint_id):
        return dcp_async_save(state_dict, checkpoint_id=checkpoint_id,
                              storage_writer=storage_writer, planner=planner,
                              process_group=group, **kwargs)
