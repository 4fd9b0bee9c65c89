"""Which recorder a group's calls go to, for calls that reach commgroups with only a group in
hand (torch.distributed's entry points under :func:`~commgroups.async_and_wait_scope`,
:class:`~commgroups.AsyncWaitDist` for spmd_types, FSDP2's comms, DCP).

The index is process-wide, because those entry points are: like the async-and-wait patch's own
state, it lives on ``torch.distributed.distributed_c10d`` (next to torch's own group registry)
rather than in a module global of ours. Keys are c10d group names, unique per process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed.distributed_c10d as c10d

from commgroups.flight_recorder.recorder import RoleRecorder

__all__ = ["lookup", "register", "unregister"]

_ATTR = "__commgroups_flight_index__"


def _index() -> dict[str, RoleRecorder]:
    # dict.setdefault is atomic under the GIL: two threads get the same dict.
    index: dict[str, RoleRecorder] = vars(c10d).setdefault(_ATTR, {})
    return index


def register(recorders: Iterable[RoleRecorder]) -> None:
    """Send the calls on each recorder's group to it."""
    index = _index()
    for recorder in recorders:
        index[recorder.group_name] = recorder


def unregister(recorders: Iterable[RoleRecorder]) -> None:
    """Forget the recorders (their generation ended); a newer one of the same group stays."""
    index = _index()
    for recorder in recorders:
        if index.get(recorder.group_name) is recorder:
            del index[recorder.group_name]


def lookup(group: Any) -> RoleRecorder | None:
    """The recorder of ``group`` (a ProcessGroup), or None (not a recorded registry group, or
    None: the default group, which no role owns)."""
    if group is None:
        return None
    index = vars(c10d).get(_ATTR)
    if not index:
        return None
    name = getattr(group, "group_name", None)
    return index.get(name) if name is not None else None
