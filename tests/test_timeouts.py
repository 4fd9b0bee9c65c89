"""Per-role timeouts reach their groups; set_timeout changes one role's timeout on a live job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _backend_timeout(group: dist.ProcessGroup) -> timedelta:
    return torch_private.options_timeout(group)


def _timeouts(rank: int, world_size: int) -> dict[str, Any]:
    layout = cg.Layout(dims={"dp_shard": 2, "cp": 2}, roles=[
        cg.RoleSpec(name="cp", dims=["cp"], timeout_s=7),
        cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"], timeout_s=11.5),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo"),
    ])
    out: dict[str, Any] = {}
    with cg.GroupRegistry(layout, meshes=[["dp_shard", "cp"]]) as registry:
        out["created"] = {r: _backend_timeout(registry.group(r)).total_seconds() for r in registry.role_names}
        out["reported"] = {r: registry.timeout(r).total_seconds() for r in registry.role_names}
        registry.set_timeout(3, role="cp")
        out["after_set"] = {r: _backend_timeout(registry.group(r)).total_seconds()
                            for r in registry.role_names}
        out["reported_after"] = registry.timeout("cp").total_seconds()
        value = torch.ones(1)
        dist.all_reduce(value, group=registry.group("cp"))  # still works after the change
        out["sum"] = value.item()
        try:
            registry.set_timeout(0, role="cp")
        except cg.errors.ArgumentError as error:
            out["bad"] = str(error)
        dp_shard = registry.device_mesh(["dp_shard", "cp"]).get_group("dp_shard")  # a mesh-dim group
        registry.set_timeout(timedelta(seconds=42))  # every group, no barrier on any group
        out["after_all"] = {r: _backend_timeout(registry.group(r)).total_seconds()
                            for r in registry.role_names}
        out["after_all"]["mesh-dp_shard"] = _backend_timeout(dp_shard).total_seconds()
        out["reported_all"] = {r: registry.timeout(r).total_seconds() for r in registry.role_names}
    return out


def test_role_timeouts_reach_groups_and_can_change() -> None:
    for out in run_world(_timeouts, 4):
        assert out["created"] == {"cp": 7.0, "fsdp": 11.5, "checkpoint-metadata": 1800.0}
        assert out["reported"] == out["created"]
        assert out["after_set"] == {"cp": 3.0, "fsdp": 11.5, "checkpoint-metadata": 1800.0}
        assert out["reported_after"] == 3.0
        assert out["sum"] == 2.0
        assert out["bad"].startswith("timeout:") and "fix" in out["bad"]
        assert set(out["after_all"].values()) == {42.0}
        assert set(out["reported_all"].values()) == {42.0}
