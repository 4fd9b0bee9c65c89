"""commgroups.generation on a real 4-rank gloo world: no getter makes a group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import commgroups as cg
from commgroups.errors import MeshNotPlannedError
from tests.test_generation import _every_getter, _fsdp_only, _group_count
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _gloo_getters(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with cg.GroupRegistry(_fsdp_only(), create_timeout_s=60) as registry:
        before = _group_count()
        _every_getter(registry, [])
        try:
            registry.device_mesh(["dp_shard", "cp"])
        except MeshNotPlannedError as error:
            out["refused"] = str(error)
        out["new_groups"] = _group_count() - before
        total = torch.ones(1)
        registry.collectives("fsdp").all_reduce(total)  # the groups still work, nobody hung
        out["sum"] = float(total.item())
    return out


def test_no_getter_makes_a_group_on_gloo() -> None:
    for result in run_world(_gloo_getters, 4, timeout=120):
        assert result["new_groups"] == 0
        assert "fix: declare the mesh" in result["refused"]
        assert result["sum"] == 4.0
