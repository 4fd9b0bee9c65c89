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

Staged roll-out: set ``COMMGROUPS_DCP_DEFAULT_GROUP=1`` in the job's environment and these calls pass
``process_group=None`` instead (DCP's own default: the default group), without a code change. The
library only reads the variable. Accepted values: 1/true/yes/on and 0/false/no/off (or unset).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from commgroups.integrations.common import role_group
from commgroups.specs import CHECKPOINT_ROLE

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch.distributed.checkpoint.metadata import Metadata

    from commgroups.registry import GroupRegistry

__all__ = ["DEFAULT_GROUP_ENV", "async_save", "checkpoint_group", "load", "save"]

logger = logging.getLogger(__name__)

DEFAULT_GROUP_ENV = "COMMGROUPS_DCP_DEFAULT_GROUP"
"""Environment switch: truthy means DCP uses the default group instead of the checkpoint role's."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


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
    raise ValueError(
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
        raise ValueError(
            f"commgroups.integrations.dcp.{fn}: got both registry= and process_group=; fix: pass "
            f"only registry= (role {role!r} is used) or call torch.distributed.checkpoint.{fn} directly"
        )
    return checkpoint_group(registry, role)


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    registry: GroupRegistry,
    role: str = CHECKPOINT_ROLE,
    **kwargs: Any,
) -> Metadata:
    """``torch.distributed.checkpoint.save`` with the plan/metadata exchange on ``role``'s group.

    Other keywords (``no_dist``, ``use_collectives``, ...) pass through to torch unchanged.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    group = _resolve(registry, role, process_group, "save")
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
    """``torch.distributed.checkpoint.load`` (in place) with the exchange on ``role``'s group."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    group = _resolve(registry, role, process_group, "load")
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
    **kwargs: Any,
) -> Any:
    """``torch.distributed.checkpoint.async_save`` with the exchange on ``role``'s group.

    Returns what torch returns (a Future, or an AsyncSaveResponse on newer torch). DCP requires a
    group with a CPU backend here: the default checkpoint role (gloo) is one.
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

    group = _resolve(registry, role, process_group, "async_save")
    return dcp_async_save(state_dict, checkpoint_id=checkpoint_id,
                          storage_writer=storage_writer, planner=planner, process_group=group,
                          **kwargs)
