"""Megatron-Core's distributed checkpoint (``dist_checkpointing``) on the registry's gloo group.

``megatron.core.dist_checkpointing.save()`` takes no process group: its sharding validation
(``all_gather_object``, ``broadcast_object_list``), its save-plan exchange (``gather_object``) and
its closing barriers all run on the default group (Megatron-LM #6092). That is the DCP plan
exchange that deadlocked on Ascend HCCL at 256-512 ranks, and MindSpeed is built on Megatron-Core.
Its sync save also stages the failure flag as a CUDA tensor, so it cannot finish without a GPU.
``load()`` does take ``process_group=``. These two functions run both on the registry's
``checkpoint-metadata`` role (gloo by default)::

    from commgroups.integrations.megatron import checkpoint

    checkpoint.save(model.sharded_state_dict(), path, registry=registry)
    state = checkpoint.load(model.sharded_state_dict(), path, registry=registry)

The checkpoint is Megatron's own ``torch_dist`` format: ``dist_checkpointing.load`` reads it, and
these read Megatron's, with any tp/dp layout on either side that Megatron's resharding allows.

Where Megatron gives no seam, and what is done instead:

- ``serialization.save`` (no ``process_group``): :func:`save` runs the same steps with the group
  passed (Megatron's ``save_preprocess`` without its validation, then its
  ``determine_global_metadata(process_group=)`` and ``validate_sharding_integrity``, the common
  state as a ``ShardedObject``, the strategy's save, ``save_config`` on the group's first rank, a
  barrier on the group).
- ``TorchDistSaveShardedStrategy.async_save`` hard-codes ``process_group=None`` and its finalize
  stages the failure flag on CUDA: :class:`CheckpointGroupSaveStrategy` runs Megatron's
  ``save_state_dict_async_plan`` (which takes ``process_group``) and gathers write results and the
  failure flag with object collectives on the group.
- ``_validate_common_state_dict`` broadcasts from global rank 0 on the default group: the
  common-state consistency check is done here on the group (a warning on a mismatch, as Megatron).

Sync save only: Megatron's async save (``async_sharded_save=True``) runs its finalize in
Megatron's async queue and is not offered. The private Megatron names used are in
:mod:`~commgroups.integrations.megatron.megatron_internals` (:data:`~.megatron_internals.SAVE_NAMES`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from commgroups.errors import ArgumentError
from commgroups.integrations.common import role_group
from commgroups.integrations.megatron import megatron_internals as internals
from commgroups.layout.specs import CHECKPOINT_ROLE

if TYPE_CHECKING:
    from commgroups.registry import GroupRegistry

__all__ = ["CheckpointGroupSaveStrategy", "checkpoint_group", "load", "save"]

logger = logging.getLogger(__name__)

_EXAMPLE = f'RoleSpec(name="{CHECKPOINT_ROLE}", dims="world", backend="gloo")'


def checkpoint_group(registry: GroupRegistry, role: str = CHECKPOINT_ROLE) -> dist.ProcessGroup:
    """The group Megatron's checkpoint metadata travels on: ``registry.group(role)``.

    Raises:
        MissingRoleError: the layout has no such role (the message shows how to add it).
    """
    return role_group(registry, role, "Megatron's distributed checkpoint", _EXAMPLE)


def _strategy_class() -> type[Any]:
    """:class:`CheckpointGroupSaveStrategy`'s Megatron base, imported on first use."""
    return internals.checkpoint_names()["save_strategy"]  # type: ignore[no-any-return]


class CheckpointGroupSaveStrategy:
    """Megatron's ``torch_dist`` save strategy with its plan exchange on one process group.

    Built by :func:`save` (``CheckpointGroupSaveStrategy.make(group)`` returns an instance of a
    subclass of Megatron's ``TorchDistSaveShardedStrategy``, so Megatron code that checks the type
    accepts it). Its :meth:`save` runs Megatron's ``save_state_dict_async_plan`` with
    ``process_group=group``, writes synchronously, and gathers the write results and the failure
    flag with object collectives on ``group`` (the coordinator is the group's first rank).
    """

    @staticmethod
    def make(group: dist.ProcessGroup, *, thread_count: int = 1) -> Any:
        """A ``TorchDistSaveShardedStrategy`` whose save runs every collective on ``group``."""
        base = _strategy_class()

        class _OnGroup(base):  # type: ignore[misc, valid-type]  # Megatron is untyped
            __doc__ = CheckpointGroupSaveStrategy.__doc__

            def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
                _save_on_group(self, group, sharded_state_dict, checkpoint_dir)

            def async_save(self, *args: Any, **kwargs: Any) -> Any:
                raise ArgumentError(
                    "CheckpointGroupSaveStrategy: async save is not offered (Megatron's async "
                    "finalize runs outside the checkpoint group); fix: save synchronously",
                    field="async_sharded_save")

        _OnGroup.__name__ = _OnGroup.__qualname__ = "CheckpointGroupSaveStrategy"
        return _OnGroup(thread_count=thread_count)


def _on_host(write_buckets: Any) -> bool:
    """Every tensor of Megatron's write buckets ``(path, name, (bytes, [(item, tensor)]))`` on CPU."""
    return all(tensor.device.type == "cpu"
               for _path, _name, (_bytes, tensors) in write_buckets for _item, tensor in tensors)


def _first_rank(group: dist.ProcessGroup) -> int:
    return dist.get_global_rank(group, 0)


def _save_on_group(strategy: Any, group: dist.ProcessGroup, sharded_state_dict: Any,
                   checkpoint_dir: Path) -> None:
    """``TorchDistSaveShardedStrategy.async_save`` + ``execute_sync``, on ``group`` (0.19.2)."""
    names = internals.checkpoint_names()
    sharded, _flat, _renames = names["replace_keys"](sharded_state_dict,
                                                     strategy.keep_only_main_replica)
    pyt_state_dict = names["to_pyt"](sharded, False)
    writer = names["writer"](checkpoint_dir, separation_hint=strategy.separation_hint,
                             thread_count=strategy.thread_count)
    coordinator = 0  # the group's first rank: a group rank, as torch's _DistWrapper reads it
    with internals.sync_write():  # no Manager process per rank; no psutil needed
        planned = names["plan"](
            pyt_state_dict, writer, group, coordinator,
            planner=names["planner"](dedup_replicated_tensors=not strategy.keep_only_main_replica,
                                     flatten_state_dict=False, flatten_sharded_tensors=False))
        (writer, global_metadata, _wrapper), _central, _local, _cached, _verified = planned
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        if save_fn is not None:  # None: nothing of this rank's to write
            args = list(save_args)
            if preload_fn is not None and not _on_host(args[1]):
                # device tensors staged to host, as AsyncRequest.execute_sync does (its preload
                # calls torch.cuda.synchronize() unconditionally: skipped for host tensors)
                args[1] = preload_fn()
            save_fn(*args)
        results = writer.retrieve_write_results()
    is_coordinator = group.rank() == coordinator
    gathered: list[Any] | None = [None] * group.size() if is_coordinator else None
    dist.gather_object(results, gathered, dst=_first_rank(group), group=group)
    failures: dict[int, str] = {}
    own: Exception | None = None
    if is_coordinator:
        assert gathered is not None
        failures = {rank: repr(result) for rank, result in enumerate(gathered)
                    if not isinstance(result, list)}  # Megatron wraps a writer's failure
        if not failures:
            try:
                writer.finish(global_metadata, gathered)  # writes .metadata
            except Exception as error:  # disk full, EIO: the others wait for the verdict below
                own = error
                failures = {coordinator: f"writing .metadata: {error!r}"}
    verdict: list[Any] = [failures]
    dist.broadcast_object_list(verdict, src=_first_rank(group), group=group)
    if verdict[0]:
        raise RuntimeError(f"Megatron checkpoint write failed on group ranks {verdict[0]} "
                           f"({checkpoint_dir})") from own


def _check_common_state(common_state_dict: Any, group: dist.ProcessGroup, diff: Any) -> None:
    """Megatron's common-state consistency check, on ``group``: a warning where a rank differs."""
    first: list[Any] = [common_state_dict if group.rank() == 0 else None]
    dist.broadcast_object_list(first, src=_first_rank(group), group=group)
    if group.rank() != 0:
        only_first, only_here, mismatch = diff(first[0], common_state_dict)
        if only_first or only_here or mismatch:
            logger.warning("rank %d: the common state dict differs from the checkpoint group's "
                           "first rank (only there: %s, only here: %s, mismatched: %s)",
                           dist.get_rank(), only_first, only_here, mismatch)


def save(sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str], *,
         registry: GroupRegistry, role: str = CHECKPOINT_ROLE,
         validate_access_integrity: bool = True, content_metadata: dict[str, Any] | None = None,
         thread_count: int = 1) -> None:
    """``megatron.core.dist_checkpointing.save`` with every collective on ``role``'s group.

    Same format and steps as Megatron's sync save (the module docs say what is rebuilt and why).
    Collective over the role's group; ``checkpoint_dir`` must exist on every rank.

    Args:
        sharded_state_dict: the model's (and optimizer's) ``sharded_state_dict()``.
        checkpoint_dir: the checkpoint directory (Megatron's ``checkpoint_dir``).
        registry: a created registry; its ``role`` group carries every exchange.
        role: the role, ``checkpoint-metadata`` by default (gloo in every layout).
        validate_access_integrity: Megatron's check that the main replicas of the shards cover
            every tensor exactly once, plus its common-state consistency check (on the group).
        content_metadata: as Megatron's ``content_metadata``.
        thread_count: writer threads per rank (files per rank), as Megatron's strategy.

    Raises:
        MissingRoleError: the layout has no ``role``.
        ArgumentError: ``checkpoint_dir`` is not a directory, ``thread_count`` < 1, or (on every
            rank) Megatron's validation finds shards that overlap or leave a tensor uncovered.
        MegatronUnavailableError: Megatron-Core is missing, or not a checked release.
    """
    if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
        raise ArgumentError(f"save: thread_count={thread_count!r}; fix: an int >= 1",
                            field="thread_count")
    if not Path(checkpoint_dir).is_dir():
        raise ArgumentError(f"save: checkpoint_dir {str(checkpoint_dir)!r} is not a directory; "
                            "fix: create it on every rank first (as Megatron expects)",
                            field="checkpoint_dir")
    group = checkpoint_group(registry, role)
    names = internals.checkpoint_names()
    if content_metadata is not None:
        sharded_state_dict[names["content_key"]] = content_metadata
    sharded, common = names["preprocess"](sharded_state_dict, False)  # validation: below, on group
    if validate_access_integrity:
        _check_common_state(common, group, names["diff"])
        _local, global_metadata = names["global_metadata"](sharded, process_group=group)
        # Megatron checks on global rank 0 only (a no-op elsewhere) and raises there alone, while
        # the others go on into the plan exchange and wait for it: its verdict goes to every rank.
        verdict: list[Any] = [None]
        if group.rank() == 0:
            try:
                names["validate"](global_metadata, common_state_dict=None)
            except Exception as error:  # Megatron's CheckpointingException, whatever its text
                verdict[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(verdict, src=_first_rank(group), group=group)
        if verdict[0] is not None:
            raise ArgumentError(f"save: the sharded state dict does not describe each tensor "
                                f"exactly once ({verdict[0]}); fix: give every shard one main "
                                "replica (replica_id 0) and cover every tensor",
                                field="sharded_state_dict")
    sharded["common_state"] = names["sharded_object"](
        key="common_state", data=common, global_shape=(1,), global_offset=(0,),
        replica_id=group.rank())  # the group's first rank writes it (Megatron: global rank 0)
    strategy = CheckpointGroupSaveStrategy.make(group, thread_count=thread_count)
    strategy.save(sharded, Path(checkpoint_dir))
    if group.rank() == 0:
        names["save_config"](names["config"](strategy.backend, strategy.version), str(checkpoint_dir))
    dist.barrier(group=group)  # nobody reads the checkpoint before its config is written


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str], *,
         registry: GroupRegistry, role: str = CHECKPOINT_ROLE, **kwargs: Any) -> Any:
    """``megatron.core.dist_checkpointing.load(..., process_group=<role's group>)``.

    Megatron's load takes the group: its metadata exchange (``determine_global_metadata``) runs
    there, and its tensor reads are local (``no_dist``). ``verify_integrity=True`` is refused: it
    broadcasts on the default group.

    Args:
        sharded_state_dict: the state dict to load into (ShardedTensors give the layout, which may
            differ from the saved one where Megatron reshards).
        checkpoint_dir: the checkpoint directory.
        registry: a created registry.
        role: the role whose group carries the exchange (``checkpoint-metadata``).
        **kwargs: Megatron's other ``load`` arguments (``strict``, ``sharded_strategy``,
            ``validate_access_integrity``); not ``process_group``.

    Returns:
        What Megatron's ``load`` returns (the loaded state dict; with some ``strict`` values, also
        the missing and unexpected keys).

    Raises:
        ArgumentError: ``process_group`` or ``verify_integrity=True`` passed.
        MissingRoleError: the layout has no ``role``.
    """
    if "process_group" in kwargs:
        raise ArgumentError("load: process_group comes from registry= (the role's group); fix: "
                            "drop process_group, or pass role=", field="process_group")
    if kwargs.get("verify_integrity"):
        raise ArgumentError("load: verify_integrity=True broadcasts on the default group "
                            "(Megatron takes no group for it); fix: verify_integrity=False",
                            field="verify_integrity")
    group = checkpoint_group(registry, role)
    return internals.checkpoint_names()["load"](sharded_state_dict, str(checkpoint_dir),
                                                process_group=group, **kwargs)
