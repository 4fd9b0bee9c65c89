"""Integrations: hand the registry's role groups to FSDP2, spmd_types, DCP, torchtitan and
Megatron-Core.

Each integration uses only the registry's public API (``group``, ``device_mesh``, ``spec``), and
imports its third-party library lazily, so ``import commgroups`` never needs spmd_types.

- :mod:`commgroups.integrations.fsdp`: ``fully_shard_on_role(module, registry)``.
- :mod:`commgroups.integrations.spmd`: ``activate(registry, mesh_dims=[...])``.
- :mod:`commgroups.integrations.dcp`: ``save``, ``load`` and ``async_save`` with ``registry=``.
- :mod:`commgroups.integrations.torchtitan`: ``with_registry(config)`` for torchtitan's trainer.
- :mod:`commgroups.integrations.megatron`: ``process_group_collection(registry)`` and the rest
  of Megatron-Core's whole job.
"""

from __future__ import annotations

from commgroups.integrations.common import MissingRoleError

__all__ = ["MissingRoleError", "dcp", "fsdp", "megatron", "spmd", "torchtitan"]


def __getattr__(name: str) -> object:
    # Submodules load on first use: `cg.integrations.spmd` must not import spmd_types (or DCP) for
    # users who never touch them.
    if name in ("dcp", "fsdp", "megatron", "spmd", "torchtitan"):
        import importlib

        return importlib.import_module(f"commgroups.integrations.{name}")
    raise AttributeError(f"module 'commgroups.integrations' has no attribute {name!r}")
