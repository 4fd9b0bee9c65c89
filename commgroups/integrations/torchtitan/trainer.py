"""torchtitan's Trainer with every communicator from a GroupRegistry (see :func:`with_registry`).

:class:`RegistryTrainer` subclasses torchtitan's public extension points only:

- ``init_distributed()`` builds a :class:`~commgroups.GroupRegistry` for the job's parallelism (or
  the layout given to ``with_registry``) and returns a :class:`RegistryParallelDims`, so every mesh
  torchtitan asks for by name is a registry group (never the default group);
- after torchtitan has built and sharded the model: FSDP2's collectives on every FSDP module and
  spmd_types' raw collectives are issued async-and-wait (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` and ``spmd_types.set_dist(AsyncWaitDist())``; torchtitan owns
  spmd_types' current mesh), and the checkpoint manager gets the registry's gloo group;
- ``forward_backward_step()``: with HSDP (or replication) on a ``dp_replicate`` role that asks for
  async-and-wait, runs inside :func:`~commgroups.async_and_wait_scope`, so FSDP2's replica
  all-reduce (a blocking ``dist.all_reduce`` FSDP2 has no hook for) is issued async-and-wait too;
- ``train()``: torchtitan's timeout change after the first step goes to the groups of its meshes
  (compute roles without a ``timeout_s`` of their own, mesh dims' groups) and the default group,
  synchronised through the store instead of a default-group barrier;
- ``close()`` closes the registry after torchtitan's own clean-up.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, cast

import torch
import torch.distributed as dist

from commgroups.audit.records import AUDIT_DIR_ENV
from commgroups.collectives.async_wait import AsyncWaitDist, async_and_wait_scope
from commgroups.errors import MeshRequestError, NotAMemberError
from commgroups.integrations.fsdp import async_and_wait_comms, install_async_and_wait_comms
from commgroups.integrations.spmd import current_dist
from commgroups.integrations.torchtitan.checkpoint import RegistryCheckpointManager
from commgroups.integrations.torchtitan.layout import LayoutArg, TitanDegrees, fit_titan_layout
from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
from commgroups.integrations.torchtitan.titan_internals import (
    CLI_HIDDEN,
    CheckpointManager,
    ParallelDims,
    Trainer,
    replaced_set_pg_timeouts,
)
from commgroups.layout.specs import Layout
from commgroups.registry import GroupRegistry
from commgroups.torch_internals import default_group, default_store, set_group_timeout

__all__ = ["DEFAULT_AUDIT_FOLDER", "RegistryTrainer", "agree_on_seed", "audit_directory",
           "with_registry"]

logger = logging.getLogger(__name__)

AuditArg = str | Path | bool | None
DEFAULT_AUDIT_FOLDER = "commgroups-audit"
"""``with_registry(audit=True)`` writes the per-rank audit files here, under the dump folder."""


def _spmd_types() -> Any:
    return importlib.import_module("spmd_types")


class RegistryTrainer(Trainer):
    """torchtitan's ``Trainer`` whose meshes, FSDP2, spmd_types and DCP go through a GroupRegistry.

    Build it from a config made by :func:`with_registry` (``config.build()``, as
    ``torchtitan.train`` does); ``trainer.registry`` is the created registry.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """``Trainer.Config`` plus commgroups' settings (set by :func:`with_registry`; not
        command-line options)."""

        commgroups_layout: Annotated[dict[str, Any] | str | None, CLI_HIDDEN] = None
        """A layout (as a dict) or layout file; None: derived from ``parallelism``."""

        commgroups_async_and_wait: Annotated[bool, CLI_HIDDEN] = True
        """False turns async-and-wait off for every role (the layout's settings included)."""

        commgroups_audit: Annotated[str | bool | None, CLI_HIDDEN] = None
        """Audit directory for the per-rank files; True: ``<dump_folder>/commgroups-audit``;
        None: ``COMMGROUPS_AUDIT_DIR`` if set, else no audit."""

    registry: GroupRegistry

    # ------------------------------------------------------------------------------ building
    def __init__(self, config: Config) -> None:
        self._spmd_dist_before: Any = None
        self._spmd_dist_set = False
        self.fsdp_async_wait_modules = 0
        self.fsdp_async_wait_refused = 0
        self.replica_all_reduce_scoped = False
        """True when each forward/backward runs in an async-and-wait scope for HSDP's replica
        all-reduce (see :meth:`forward_backward_step`)."""
        super().__init__(config)
        self._install_async_and_wait()
        if isinstance(self.checkpointer, RegistryCheckpointManager):
            self.checkpointer.attach_registry(self.registry)
        elif getattr(self.checkpointer, "enable", False):
            logger.warning("checkpoint manager %s is not commgroups': its DCP exchange keeps its "
                           "own group", type(self.checkpointer).__name__)

    def _layout(self, degrees: TitanDegrees) -> Layout:
        config = self.config
        return fit_titan_layout(getattr(config, "commgroups_layout", None), degrees,
                                async_and_wait=getattr(config, "commgroups_async_and_wait", True))

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
        """Without ``--debug.seed`` torchtitan broadcasts rank 0's seed on the default group;
        here every rank takes rank 0's seed through the store (:func:`agree_on_seed`)."""
        debug = self.config.debug
        if debug.seed is not None or dist.get_world_size() == 1:
            return
        debug.seed = agree_on_seed(self.registry)

    def _install_async_and_wait(self) -> None:
        roles = self.registry.layout.roles
        wanted = any(r.async_and_wait for r in roles if r.name in ("fsdp", "efsdp", "dp_replicate"))
        if wanted and async_and_wait_comms() is None:
            # Said once per trainer (install_async_and_wait_comms would say it per module).
            logger.warning("this torch has no FSDP2 custom-comm hooks: FSDP's collectives stay as "
                           "FSDP2 issues them")
        elif wanted:
            from torch.distributed.fsdp import FSDPModule

            sharded = sum(isinstance(module, FSDPModule)
                          for part in self.model_parts for module in part.modules())
            # One call over every part: FSDP2 refuses custom comms on modules with several
            # parameter groups (MoE experts on efsdp next to dense on fsdp); they are skipped,
            # said in one warning, and left out of the count.
            self.fsdp_async_wait_modules = install_async_and_wait_comms(list(self.model_parts))
            self.fsdp_async_wait_refused = sharded - self.fsdp_async_wait_modules
        self.replica_all_reduce_scoped = self._wants_replica_scope()
        # Compute roles only: the checkpoint role (async_and_wait on by default) carries no
        # spmd_types traffic, and counting it kept AsyncWaitDist with every compute role off.
        if self.parallel_dims.spmd_backend == "spmd_types" and any(
                r.async_and_wait for r in roles if r.purpose == "compute"):
            # Dist only: torchtitan sets spmd_types' current mesh itself (to registry meshes).
            self._spmd_dist_before = current_dist()
            _spmd_types().set_dist(AsyncWaitDist())
            self._spmd_dist_set = True

    def _wants_replica_scope(self) -> bool:
        """HSDP (or FSDP2's replicate) all-reduces over dp_replicate, and that role asks for
        async-and-wait: FSDP2 issues that all-reduce blocking, with no hook (torch 2.13-2.15)."""
        layout = self.registry.layout
        if ("dp_replicate" not in layout.role_names
                or not layout.role("dp_replicate").async_and_wait
                or self.parallel_dims.dp_replicate < 2):
            return False
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for part in self.model_parts for m in part.modules())

    # ------------------------------------------------------------------------------ training
    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """torchtitan's forward/backward; with HSDP on an async-and-wait ``dp_replicate`` role,
        inside :func:`~commgroups.async_and_wait_scope`.

        FSDP2 issues HSDP's replica all-reduce as a blocking ``dist.all_reduce`` and offers no hook
        for it (torch 2.13 to 2.15); the scope, process-wide while the backward runs, makes it (and
        any other blocking torch.distributed call there) async-and-wait. Elsewhere: unchanged.
        """
        if not self.replica_all_reduce_scoped:
            return cast(torch.Tensor, super().forward_backward_step(**kwargs))
        with async_and_wait_scope():
            return cast(torch.Tensor, super().forward_backward_step(**kwargs))

    def _set_pg_timeouts(self, timeout: timedelta, parallel_dims: ParallelDims) -> None:
        """torchtitan's ``set_pg_timeouts`` for registry groups: no default-group barrier.

        Like stock, every rank first reaches this point (so none times out under the shorter
        timeout while a slow peer still runs under the long one), here through the store
        (:meth:`~commgroups.GroupRegistry.store_barrier`). A rank lost before it arrived never
        will: the loss report ends the wait within milliseconds, where stock waits out its
        barrier's timeout (``comm.init_timeout_seconds``, 300 s by default).

        The groups changed are stock's: those of torchtitan's one-dimensional meshes
        (``parallel_dims.get_all_one_dimensional_meshes()``) and the default group. Of those, a
        role's group keeps its timeout where the layout set the role's ``timeout_s`` or the role
        is not a compute role; roles no mesh uses are left alone, ``checkpoint-metadata`` among
        them (stock never shortens its own checkpoint group: an async save's exchange there
        waits for the slowest rank's writes).
        """
        registry = self.registry
        registry.store_barrier("set_pg_timeouts")
        pending: dict[int, dist.ProcessGroup] = {}
        for one in parallel_dims.get_all_one_dimensional_meshes().values():
            try:
                group = one.get_group()
            except MeshRequestError:  # a placeholder (no group): nothing runs on it
                continue
            pending[id(group)] = group
        for name in registry.role_names:
            spec = registry.spec(name)
            try:
                group = registry.group(name)
            except NotAMemberError:
                continue
            if pending.pop(id(group), None) is None:
                continue
            if spec.purpose == "compute" and spec.timeout_s is None:
                # Through the registry, not the group: the timeout outlives a rebuild.
                registry.set_timeout(timeout, role=name)
        for group in pending.values():  # a mesh dim that no role covers: the dim's own group
            set_group_timeout(group, timeout)
        set_group_timeout(default_group(), timeout)

    def audit_dir(self) -> Path | None:
        """Where this run's per-rank audit files go, or None (see :func:`audit_directory`)."""
        return audit_directory(getattr(self.config, "commgroups_audit", None),
                               self.config.dump_folder, os.environ)

    @contextlib.contextmanager
    def _audited(self) -> Iterator[None]:
        directory = self.audit_dir()
        if directory is None:
            yield
            return
        from commgroups.audit.recorder import from_env

        if dist.get_rank() == 0:
            logger.info("commgroups audit: recording every collective of training; per-rank files "
                        "in %s (merge: commgroups audit %s)", directory, directory)
        with from_env(self.registry, environ={AUDIT_DIR_ENV: str(directory)}):
            yield

    def train(self) -> None:
        """torchtitan's training loop, with the timeout change applied to the registry's groups
        (and the run audited when asked, see :meth:`audit_dir`)."""
        with replaced_set_pg_timeouts(self._set_pg_timeouts), self._audited():
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


def agree_on_seed(registry: GroupRegistry) -> int:
    """The first member's seed (from its RNG state, as torchtitan takes it) on every member of
    ``registry``'s current generation, through the job's store.

    No collective at all, so no group carries traffic that is not its role's (torchtitan
    broadcasts it on the default group). The n-th call on every rank meets under the same key (no
    process-wide counter: each rank counts its own calls in the store). The wait is
    :meth:`GroupRegistry.store_barrier`'s: a member lost before it published ends it with
    :class:`~commgroups.errors.LossInterruptedError`, a member that never comes with
    :class:`~commgroups.errors.AgreementTimeoutError` after ``create_timeout_s``, not a read
    that waits out the store's own timeout on the job's shared connection.
    """
    store, rank = default_store(), dist.get_rank()
    number = store.add(f"commgroups/torchtitan/seed/generation/{rank}", 1)
    key = f"commgroups/torchtitan/seed/{number}"
    if rank == registry.members[0]:
        seed = torch.get_rng_state()[:8].clone()
        store.set(key, str(int(seed.view(torch.uint64).item())))
    registry.store_barrier("torchtitan-seed")  # the first member's set is in before it arrives
    return int(store.get(key).decode())


def audit_directory(audit: str | bool | None, dump_folder: str,
                    environ: Mapping[str, str]) -> Path | None:
    """Where a run's per-rank audit files go, or None for no audit.

    ``audit`` is ``with_registry(audit=...)``: a directory; True for
    ``<dump_folder>/commgroups-audit``; False for none; None for ``COMMGROUPS_AUDIT_DIR`` from
    ``environ`` when set and not empty (read, never written), else none.

    Example::

        audit_directory(None, "./outputs", {"COMMGROUPS_AUDIT_DIR": "/tmp/audit"})  # /tmp/audit
        audit_directory(True, "./outputs", {})      # outputs/commgroups-audit
    """
    if audit is True:
        return Path(dump_folder) / DEFAULT_AUDIT_FOLDER
    if isinstance(audit, str) and audit:
        return Path(audit)
    if audit is None and environ.get(AUDIT_DIR_ENV, ""):
        return Path(environ[AUDIT_DIR_ENV])
    return None


def _layout_value(layout: LayoutArg) -> dict[str, Any] | str | None:
    if layout is None:
        return None
    if isinstance(layout, Layout):
        return layout.model_dump(mode="json")
    if isinstance(layout, Mapping):
        return copy.deepcopy(dict(layout))
    if isinstance(layout, (str, Path)):
        from commgroups.layout.layout_io import load_layout_data

        # An unreadable file or bad syntax is an error now, not on every rank at launch; the
        # layout itself is checked against the degrees (size-1 dims added) by the trainer.
        load_layout_data(layout)
        return str(layout)
    raise TypeError(
        f"with_registry(layout=...) takes a commgroups.Layout, a dict or a layout file path, got "
        f"{type(layout).__name__}"
    )


def _audit_value(audit: AuditArg) -> str | bool | None:
    if audit is None or isinstance(audit, bool):
        return audit
    if isinstance(audit, (str, Path)):
        return str(audit)
    raise TypeError(f"with_registry(audit=...) takes a directory, True or None, got "
                    f"{type(audit).__name__}")


def with_registry(config: Trainer.Config, *, layout: LayoutArg = None, audit: AuditArg = None,
                  async_and_wait: bool = True) -> RegistryTrainer.Config:
    """A torchtitan config with the same field values whose trainer runs through a GroupRegistry.

    Args:
        config: a torchtitan ``Trainer.Config`` (e.g. ``llama3_debugmodel()``); left untouched:
            the result shares no sub-config object with it.
        layout: None (derive the layout from ``config.parallelism``), or a
            :class:`~commgroups.Layout`, a dict in the layout-file shape, or a layout file (TOML,
            YAML, JSON) that may set per-role backend, options and timeouts. Dims of size 1 may be
            left out (also when a role names them). It must agree with the parallelism degrees,
            else the trainer raises a LayoutError showing both factorizations, on every rank,
            before any group exists.
        audit: record every collective of training (``cg.audit``) and write one file per rank to
            this directory; True: ``<dump_folder>/commgroups-audit``; None: the directory in
            ``COMMGROUPS_AUDIT_DIR`` when set, else no audit; False: no audit even then. Merge the
            files with ``commgroups audit DIR``.
        async_and_wait: False turns async-and-wait off for every role (FSDP2's custom comms and
            spmd_types' dist are then left as torchtitan sets them), whatever the layout says.

    Returns:
        A ``RegistryTrainer.Config`` (a ``Trainer.Config`` subclass) with every field of ``config``
        (deep copies); its ``checkpoint`` is a ``RegistryCheckpointManager.Config`` with the same
        values.

    Example::

        # my_configs.py, then: torchrun ... -m torchtitan.train --module my_configs --config llama3
        from torchtitan.models.llama3.config_registry import llama3_debugmodel
        from commgroups.integrations.torchtitan import with_registry

        def llama3():
            return with_registry(llama3_debugmodel(), audit=True)
    """
    if not isinstance(config, Trainer.Config):
        raise TypeError(f"with_registry takes a torchtitan Trainer.Config, got "
                        f"{type(config).__name__}")
    if type(config) not in (Trainer.Config, RegistryTrainer.Config):
        raise TypeError(
            f"with_registry supports torchtitan's Trainer.Config; {type(config).__qualname__} "
            "belongs to another trainer; fix: subclass RegistryTrainer for it"
        )
    values = {f.name: copy.deepcopy(getattr(config, f.name)) for f in fields(config)}
    checkpoint = values["checkpoint"]
    if type(checkpoint) is CheckpointManager.Config:
        values["checkpoint"] = _retyped(RegistryCheckpointManager.Config, {
            f.name: getattr(checkpoint, f.name) for f in fields(checkpoint)})
    elif not isinstance(checkpoint, RegistryCheckpointManager.Config):
        logger.warning("with_registry: checkpoint config %s is not torchtitan's CheckpointManager's; "
                       "its DCP exchange keeps its own group", type(checkpoint).__qualname__)
    if layout is not None or "commgroups_layout" not in values:
        values["commgroups_layout"] = _layout_value(layout)
    if audit is not None or "commgroups_audit" not in values:
        values["commgroups_audit"] = _audit_value(audit)
    values["commgroups_async_and_wait"] = (async_and_wait
                                           and values.get("commgroups_async_and_wait", True))
    config_out: RegistryTrainer.Config = _retyped(RegistryTrainer.Config, values)
    return config_out


def _retyped(cls: type[Any], values: dict[str, Any]) -> Any:
    """An instance of the dataclass ``cls`` holding ``values`` (every field), built without running
    its ``__post_init__`` again: the values come from a config torchtitan already validated, and
    validating again would log its warnings (``initial_load_model_only=True has no effect ...``)
    a second time for one config."""
    instance = object.__new__(cls)
    for f in fields(cls):
        object.__setattr__(instance, f.name, values[f.name])
    return instance
