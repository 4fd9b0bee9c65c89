"""What the audit records: one collective call, the per-rank file's format, and the op vocabulary.

Plain data and names, no torch import: the recorder (:mod:`commgroups.audit.recorder`) writes this
schema and the analysis (:mod:`commgroups.audit.hazards`, :mod:`commgroups.audit.merge`) reads it, so
the analysis runs wherever the JSON files are, torch or not.

A per-rank file (``rank00003.json``) is one JSON object::

    {"format": "commgroups-audit/1", "rank": 3, "world_size": 4, "default_group": "0",
     "groups": {"1": {"ranks": [0, 1, 2, 3], "backend": "gloo", "default": false, "roles": ["cp"]}},
     "roles": {"cp": "1"}, "role_ranks": {"cp": [0, 1, 2, 3]},
     "purposes": {"cp": "compute"}, "async_and_wait": {"cp": true}, "registry_groups": ["1"],
     "sequence": {"1": [0, 12]}, "records": [<CollectiveRecord.to_dict()>, ...]}

``purposes``, ``async_and_wait`` (role -> whether its spec asks for async-and-wait),
``registry_groups`` (null when no registry was given) and ``sequence`` (group ->
[the group's own collective count when first met, at the end]) may be missing in files written
before they existed; readers treat them as empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AUDIT_DIR_ENV",
    "CHECKPOINT_MODULES",
    "COLLECTIVE_NAMESPACES",
    "FILE_FORMAT",
    "NOT_COLLECTIVES",
    "P2P_OPS",
    "CollectiveRecord",
    "group_sort_key",
    "rank_file_name",
    "rank_span",
]

AUDIT_DIR_ENV = "COMMGROUPS_AUDIT_DIR"
"""The environment variable naming the directory a whole run's per-rank files go to."""

FILE_FORMAT = "commgroups-audit/1"
"""The ``format`` tag of a per-rank file; anything else is not read."""

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd",
                                   "c10d_functional"})
"""Dispatcher namespaces whose ops are collectives (``c10d_functional``: the legacy Python API)."""

NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "wait"})
"""Op names in those namespaces that move no data between ranks."""

CHECKPOINT_MODULES: tuple[str, ...] = ("torch.distributed.checkpoint",
                                       "megatron.core.dist_checkpointing",
                                       "commgroups.integrations.megatron.checkpoint")
"""Module prefixes whose frames mark a collective as checkpoint traffic: DCP's save, load and
async_save, whoever calls them (commgroups' DCP integration, torchtitan's checkpointer, a user),
and Megatron-Core's distributed checkpoint, through commgroups' wrapper of its save or not."""

P2P_OPS = frozenset({"c10d.send", "c10d.recv_", "c10d.recv_any_source_"})
"""Point-to-point ops: no async flag, and not part of a group's collective sequence."""


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    Args:
        index: position among this rank's records, from 0.
        op: ``namespace.name`` of the dispatcher op, e.g. ``c10d.allreduce_`` or
            ``_c10d_functional.all_gather_into_tensor``.
        group: the c10d group name (``"0"`` is the default group).
        group_seq: this rank's recorded calls on ``group`` so far, from 1.
        roles: the roles whose group this is (empty when no role maps to it).
        async_op: the flag as issued; None for point-to-point ops, which carry none.
        stream: the caller's current CUDA stream id at issue time, or ``"cpu"``.
        device: the device of the first tensor, e.g. ``"cuda:0"`` or ``"cpu"``.
        exec_stream: where the call executes under ProcessGroupNCCL's rule: blocking on the
            caller's stream (``"cuda:0/stream:7"``, ``"cpu"``), async on the group's own stream
            (``"group:<name>"``); None for point-to-point ops.
        shapes: the shape of every tensor argument, in argument order.
        dtypes: their dtypes without the ``torch.`` prefix.
        caller: ``path:line in function`` of the first frame outside the plumbing
            (see :mod:`commgroups.util.call_sites`).
        in_checkpoint: DCP issued it (a :data:`CHECKPOINT_MODULES` frame was on the stack).

    Example::

        >>> rec = CollectiveRecord(0, "c10d.allreduce_", "1", 1, ("cp",), False, "cpu", "cpu",
        ...                        "cpu", ((4,),), ("float32",), "train.py:12 in step")
        >>> rec.to_dict()["shapes"]
        [[4]]
    """

    index: int
    op: str
    group: str
    group_seq: int
    roles: tuple[str, ...]
    async_op: bool | None
    stream: int | str
    device: str
    exec_stream: str | None
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    caller: str
    in_checkpoint: bool = False

    def to_dict(self) -> dict[str, Any]:
        """This record as JSON-ready data.

        Returns:
            A dict with one key per field; tuples become lists.
        """
        data = dataclasses.asdict(self)
        data["roles"] = list(self.roles)
        data["shapes"] = [list(s) for s in self.shapes]
        data["dtypes"] = list(self.dtypes)
        return data


def rank_file_name(rank: int) -> str:
    """The name of one rank's file in an audit directory.

    Args:
        rank: the global rank.

    Returns:
        ``rank`` zero-padded to five digits, e.g. ``rank00003.json`` for rank 3.
    """
    return f"rank{rank:05d}.json"


def group_sort_key(name: str) -> tuple[int, str]:
    """Sort key for c10d group names: numeric names in numeric order, then the others by name.

    Args:
        name: a group name as recorded (``"0"``, ``"12"``, or a custom name).

    Returns:
        A key such that ``sorted(names, key=group_sort_key)`` gives ``["0", "2", "10", "x"]``.
    """
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def rank_span(ranks: Sequence[int]) -> str:
    """A short text for a set of ranks.

    Args:
        ranks: rank numbers, any order.

    Returns:
        ``"0..3"`` for three or more contiguous ranks, else the sorted ranks comma-separated
        (``"0,2"``, ``"3"``).
    """
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ",".join(map(str, ordered))
