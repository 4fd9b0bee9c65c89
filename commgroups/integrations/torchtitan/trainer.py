"""torchtitan's Trainer with every communicator from a GroupRegistry (see :func:`with_registry`).

:class:`RegistryTrainer` subclasses torchtitan's public extension points only:

- ``init_distributed()`` builds a :class:`~commgroups.GroupRegistry` for the job's parallelism (or
  the layout given to ``with_registry``) and returns a :class:`RegistryParallelDims`, so every mesh
  torchtitan asks for by name is a registry group (never the default group);
- after torchtitan has built and sharded the model: FSDP2's collectives on every FSDP module and
  spmd_types' raw collectives are issued async-and-wait (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` and ``spmd_types.set_dist(AsyncWaitDist())``; torchtitan owns
  spmd_types' current mesh), and the checkpoint manager gets the registry's gloo group;
- ``train()``: torchtitan's timeout change after the first step goes to every registry group (and
  the default group's own timeout), synchronised through the store instead of a default-group
  barrier;
- ``close()`` closes the registry after torchtitan's own clean-up.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, cast

import torch
import torch.distributed as dist
import tyro
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.trainer import Trainer

from commgroups.agreement import store_barrier
from commgroups.async_wait import AsyncWaitDist
from commgroups.integrations.fsdp import install_async_and_wait_comms
from commgroups.integrations.spmd import current_dist
from commgroups.integrations.torchtitan.checkpoint import RegistryCheckpointManager
from commgroups.integrations.torchtitan.layout import TitanDegrees, resolve_layout
from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
from commgroups.registry import GroupRegistry
from commgroups.specs import CHECKPOINT_ROLE, Layout
from commgroups.torch_internals import default_group, default_store, set_group_timeout

__all__ = ["RegistryTrainer", "with_registry"]

logger = logging.getLogger(__name__)

LayoutArg = Layout | str | Path | None


def _spmd_types() -> Any:
    return importlib.import_module("spmd_types")


class RegistryTrainer(Trainer):
    """torchtitan's ``Trainer`` whose meshes, FSDP2, spmd_types and DCP go through a GroupRegistry.

    Build it from a config made by :func:`with_registry` (``config.build()``, as
    ``torchtitan.train`` does); ``trainer.registry`` is the created registry.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """``Trainer.Config`` plus the commgroups layout (not a command-line option)."""

        commgroups_layout: Annotated[dict[str, Any] | str | None, tyro.conf.Suppress] = None
        """A layout (as a dict) or layout file; None: derived from ``parallelism``."""

    registry: GroupRegistry

    # ------------------------------------------------------------------------------ building
    def __init__(self, config: Config) -> None:
        self._spmd_dist_before: Any = None
        self._spmd_dist_set = False
        self.fsdp_async_wait_modules = 0
        self.fsdp_async_wait_refused = 0
        super().__init__(config)
        self._install_async_and_wait()
        if isinstance(self.checkpointer, RegistryCheckpointManager):
            self.checkpointer.attach_registry(self.registry)
        elif getattr(self.checkpointer, "enable", False):
            logger.warning("checkpoint manager %s is not commgroups': its DCP exchange keeps its "
                           "own group", type(self.checkpointer).__name__)

    def _layout(self, degrees: TitanDegrees) -> Layout:
        given = getattr(self.config, "commgroups_layout", None)
        layout: LayoutArg = Layout.model_validate(given) if isinstance(given, dict) else given
        return resolve_layout(layout, degrees)

    def init_distributed(self) -> ParallelDims:
        """torchtitan's distributed init, then a created registry and a RegistryParallelDims."""
        stock = super().init_distributed()
        degrees = TitanDegrees(pp=stock.pp, dp_replicate=stock.dp_replicate,
                               dp_shard=stock.dp_shard, cp=stock.cp, tp=stock.tp, ep=stock.ep,
                               spmd_backend=stock.spmd_backend)
        self.registry = GroupRegistry(self._layout(degrees)).create()
        self._agree_on_seed()
        return RegistryParallelDims(
            dp_replicate=stock.dp_replicate, dp_shard=stock.dp_shard, cp=stock.cp, tp=stock.tp,
            pp=stock.pp, ep=stock.ep, world_size=stock.world_size,
            spmd_backend=stock.spmd_backend, registry=self.registry,
        )

    def _agree_on_seed(self) -> None:
        """Without ``--debug.seed`` torchtitan broadcasts rank 0's seed on the default group.

        Do the same on the registry's checkpoint-metadata gloo group instead (rank 0's RNG state,
        as stock), and hand torchtitan the agreed seed.
        """
        debug = self.config.debug
        if debug.seed is not None or dist.get_world_size() == 1:
            return
        seed = torch.get_rng_state()[:8].clone()
        dist.broadcast(seed, group=self.registry.group(CHECKPOINT_ROLE), group_src=0)
        debug.seed = int(seed.view(torch.uint64).item())

    def _install_async_and_wait(self) -> None:
        roles = self.registry.layout.roles
        if any(r.async_and_wait for r in roles if r.name in ("fsdp", "efsdp", "dp_replicate")):
            from torch.distributed.fsdp import FSDPModule

            refused = 0
            for part in self.model_parts:
                for module in part.modules():
                    if not isinstance(module, FSDPModule):
                        continue
                    try:
                        self.fsdp_async_wait_modules += install_async_and_wait_comms(
                            cast(torch.nn.Module, module), recurse=False)
                    except ValueError:
                        # FSDP2 refuses custom comms on a module with several parameter groups
                        # (per-parameter meshes: MoE experts on efsdp next to dense on fsdp).
                        refused += 1
            if refused:
                logger.warning(
                    "%d FSDP modules shard over several meshes (MoE experts with ep > 1); FSDP2 "
                    "takes no custom comms there, so their collectives stay as FSDP2 issues them",
                    refused)
            self.fsdp_async_wait_refused = refused
        if self.parallel_dims.spmd_backend == "spmd_types" and any(r.async_and_wait for r in roles):
            # Dist only: torchtitan sets spmd_types' current mesh itself (to registry meshes).
            self._spmd_dist_before = current_dist()
            _spmd_types().set_dist(AsyncWaitDist())
            self._spmd_dist_set = True

    # ------------------------------------------------------------------------------ training
    def _set_pg_timeouts(self, timeout: timedelta, parallel_dims: ParallelDims) -> None:
        """torchtitan's ``set_pg_timeouts`` for registry groups: no default-group barrier.

        Like stock, every rank first reaches this point (so none times out under the shorter
        timeout while a slow peer still runs under the long one), here through the store.
        """
        store = default_store()
        rank = dist.get_rank()
        # The n-th call on every rank meets under the same key (no process-wide counter).
        generation = store.add(f"commgroups/torchtitan/timeouts/generation/{rank}", 1)
        store_barrier(store, f"commgroups/torchtitan/timeouts/{generation}",
                      rank, dist.get_world_size(),
                      timedelta(seconds=self.registry.create_timeout_s), "set_pg_timeouts")
        self.registry.set_timeout(timeout)
        set_group_timeout(default_group(), timeout)

    @contextlib.contextmanager
    def _registry_timeouts(self) -> Iterator[None]:
        # torchtitan's train() calls dist_utils.set_pg_timeouts with no hook; stand in for it
        # while this trainer trains (the module attribute, looked up at call time).
        import torchtitan.distributed.utils as dist_utils

        previous = dist_utils.set_pg_timeouts
        dist_utils.set_pg_timeouts = self._set_pg_timeouts
        try:
            yield
        finally:
            dist_utils.set_pg_timeouts = previous

    def train(self) -> None:
        """torchtitan's training loop, with the timeout change applied to the registry's groups."""
        with self._registry_timeouts():
            super().train()

    def close(self) -> None:
        """torchtitan's clean-up, then spmd_types' dist restored and the registry closed."""
        try:
            super().close()
        finally:
            if self._spmd_dist_set:
                _spmd_types().set_dist(self._spmd_dist_before)
                self._spmd_dist_set = False
            registry = getattr(self, "registry", None)
            if registry is not None:
                registry.close()


def _layout_value(layout: LayoutArg) -> dict[str, Any] | str | None:
    if layout is None:
        return None
    if isinstance(layout, Layout):
        return layout.model_dump(mode="json")
    if isinstance(layout, (str, Path)):
        from commgroups.layout_io import load_layout

        load_layout(layout)  # a bad file is an error now, not on every rank at launch
        return str(layout)
    raise TypeError(
        f"with_registry(layout=...) takes a commgroups.Layout or a layout file path, got "
        f"{type(layout).__name__}"
    )


def with_registry(config: Trainer.Config, *, layout: LayoutArg = None) -> RegistryTrainer.Config:
    """A torchtitan config with the same field values whose trainer runs through a GroupRegistry.

    Args:
        config: a torchtitan ``Trainer.Config`` (e.g. ``llama3_debugmodel()``).
        layout: None (derive the layout from ``config.parallelism``), or a
            :class:`~commgroups.Layout` / layout file (TOML, YAML, JSON) that may set per-role
            backend, options and timeouts; it must agree with the parallelism degrees, else the
            trainer raises a LayoutError naming both, on every rank, before any group exists.

    Returns:
        A ``RegistryTrainer.Config`` (a ``Trainer.Config`` subclass) with every field of ``config``;
        its ``checkpoint`` is a ``RegistryCheckpointManager.Config`` with the same values.

    Example::

        # my_configs.py, then: torchrun ... -m torchtitan.train --module my_configs --config llama3
        from torchtitan.models.llama3.config_registry import llama3_debugmodel
        from commgroups.integrations.torchtitan import with_registry

        def llama3():
            return with_registry(llama3_debugmodel())
    """
    if not isinstance(config, Trainer.Config):
        raise TypeError(f"with_registry takes a torchtitan Trainer.Config, got "
                        f"{type(config).__name__}")
    if type(config) not in (Trainer.Config, RegistryTrainer.Config):
        raise TypeError(
            f"with_registry supports torchtitan's Trainer.Config; {type(config).__qualname__} "
            "belongs to another trainer; fix: subclass RegistryTrainer for it"
        )
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    checkpoint = values["checkpoint"]
    if type(checkpoint) is CheckpointManager.Config:
        values["checkpoint"] = RegistryCheckpointManager.Config(
            **{f.name: getattr(checkpoint, f.name) for f in fields(checkpoint) if f.init})
    elif not isinstance(checkpoint, RegistryCheckpointManager.Config):
        logger.warning("with_registry: checkpoint config %s is not torchtitan's CheckpointManager's; "
                       "its DCP exchange keeps its own group", type(checkpoint).__qualname__)
    if layout is not None or "commgroups_layout" not in values:
        values["commgroups_layout"] = _layout_value(layout)
    return RegistryTrainer.Config(**values)
