"""torchtitan's DCP checkpoint manager with every plan/metadata exchange on the registry's gloo group.

Stock ``CheckpointManager`` passes no ``process_group`` to ``dcp.save`` and ``dcp.load`` (the default
group) and makes a world gloo group of its own for ``async_save``. :class:`RegistryCheckpointManager`
overrides only ``dcp_save`` / ``dcp_load`` and routes save, async save and load through
:mod:`commgroups.integrations.dcp` on the registry's ``checkpoint-metadata`` role; everything else
(intervals, step folders, purging, staging) is torchtitan's. Checkpoints are the same DCP format:
one saved through commgroups loads in stock torchtitan and vice versa.

The trainer attaches its registry after building the manager (:meth:`attach_registry`): torchtitan
constructs it with a fixed set of arguments.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from commgroups.integrations import dcp as cg_dcp
from commgroups.integrations.torchtitan.titan_internals import (
    DCP_LOAD_PARAMETERS,
    DCP_SAVE_PARAMETERS,
    MODEL,
    AsyncMode,
    CheckpointManager,
    GarbageCollection,
    require_parameters,
)

if TYPE_CHECKING:
    from commgroups.registry import GroupRegistry

__all__ = ["RegistryCheckpointManager"]

logger = logging.getLogger(__name__)

# The two methods below copy torchtitan's signatures: refuse to import on a torchtitan that changed
# them (an override with stale parameters would be called wrongly, or not at all).
require_parameters(CheckpointManager.dcp_save, DCP_SAVE_PARAMETERS, "CheckpointManager.dcp_save")
require_parameters(CheckpointManager.dcp_load, DCP_LOAD_PARAMETERS, "CheckpointManager.dcp_load")


class RegistryCheckpointManager(CheckpointManager):
    """``CheckpointManager`` whose DCP save, async save and load run on the registry's gloo group."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config`` (same fields) that builds a :class:`RegistryCheckpointManager`."""

    def __init__(self, config: CheckpointManager.Config, **kwargs: Any) -> None:
        # Stock makes a world gloo group of its own for async saves; the registry has one already.
        super().__init__(dataclasses.replace(config, async_mode="disabled"), **kwargs)
        if self.enable:
            self.async_mode = AsyncMode(config.async_mode)
        self.registry: GroupRegistry | None = None
        self.hf_warned = False  # the Hugging Face warnings are said once per manager, not per call

    def attach_registry(self, registry: GroupRegistry) -> None:
        """Use ``registry``'s checkpoint-metadata group for every DCP exchange from now on."""
        self.registry = registry
        if self.enable:
            # Kept for code that reads the manager's group (stock passes it to async_save).
            self.pg = cg_dcp.checkpoint_group(registry)

    def _warn_hf(self, message: str) -> None:
        if not self.hf_warned:
            logger.warning(message)
            self.hf_warned = True

    def _require_registry(self) -> GroupRegistry:
        if self.registry is None:
            raise RuntimeError(
                "RegistryCheckpointManager has no registry; fix: build it through "
                "commgroups.integrations.torchtitan.with_registry, whose trainer attaches one"
            )
        return self.registry

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Stock ``dcp_save`` with ``process_group`` = the registry's checkpoint-metadata group.

        The Hugging Face export (``to_hf``, torchtitan's ``last_save_in_hf``) stays stock: its writer
        and consolidation take no process group.
        """
        if to_hf:
            self._warn_hf("checkpoint.last_save_in_hf: the HF export's exchange runs on the "
                          "default group (torchtitan's HF writer takes no process group)")
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        registry = self._require_registry()
        # Step folders are torchtitan's to manage (it may rewrite one); commgroups' guard still
        # un-completes the old one first, so a failed rewrite is incomplete, never corrupt.
        if async_mode == AsyncMode.ASYNC:
            result = cg_dcp.async_save(state_dict, checkpoint_id=checkpoint_id, registry=registry,
                                       overwrite=True)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            result = cg_dcp.async_save(state_dict, checkpoint_id=checkpoint_id, registry=registry,
                                       overwrite=True,
                                       async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                       async_stager=self.stager)
        else:
            result = cg_dcp.save(state_dict, checkpoint_id=checkpoint_id, registry=registry,
                                 overwrite=True)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    @torch.no_grad()
    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Stock ``dcp_load`` with ``process_group`` = the registry's checkpoint-metadata group."""
        if from_hf:
            self._warn_hf("loading a Hugging Face checkpoint: its exchange runs on the default "
                          "group (torchtitan's HF reader takes no process group)")
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        cg_dcp.load(state_dict, checkpoint_id=checkpoint_id, registry=self._require_registry())
        # As stock: model states are flattened into state_dict, so load them into the model.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
