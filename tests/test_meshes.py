"""Meshes whose axes are dims or whole roles: HSDP (dp_replicate x fsdp) on dedicated groups.

Its tests that start processes are in ``tests/test_meshes_world.py`` (marked ``world``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

import commgroups as cg


def test_role_axes_at_scale_on_a_fake_world(fake_world: Callable[..., None]) -> None:
    fake_world(4096, 1234)
    layout = cg.Layout(dims={"pp": 4, "dp_replicate": 2, "dp_shard": 64, "cp": 2, "tp": 4})
    plan = cg.plan(layout)
    with cg.GroupRegistry(layout) as registry:
        mesh = registry.device_mesh(["pp", "dp_replicate", "fsdp", "tp"])
        assert tuple(mesh.shape) == (4, 2, 128, 4)
        assert mesh.get_group("fsdp") is registry.group("fsdp")
        assert dist.get_process_group_ranks(mesh.get_group("fsdp")) == list(
            plan.group_of("fsdp", 1234) or ())
        assert mesh.get_group("tp") is registry.group("tp")
