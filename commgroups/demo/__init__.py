"""The main job, ``commgroups demo``: a small transformer trained through the registry's groups.

FSDP2 shards it over the fsdp role, the sequence is sharded over cp with K/V gathered through
spmd_types on the registry's cp group (inside :func:`commgroups.integrations.spmd.activate`), the
audit records every collective, and a DCP save through the checkpoint-metadata group is loaded into a
fresh model and compared exactly. ``--baseline devicemesh`` runs the same on plain
``init_device_mesh`` groups. See :func:`commgroups.demo.launch.launch`.
"""

from __future__ import annotations

from .config import DemoConfig, seed_layout

__all__ = ["DemoConfig", "seed_layout"]
