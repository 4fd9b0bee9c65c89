"""Views: other factorizations of the same world (torchtitan's MoE mesh efsdp x ep over dp_shard x cp).

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_views.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

import commgroups as cg
from tests import torch_private
from tests.test_views import MOE
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _moe_world(rank: int, world_size: int) -> dict[str, Any]:
    default = torch_private.default_group()
    with cg.GroupRegistry(MOE, meshes=[["dp_shard", "cp"]]) as registry:
        sparse = registry.device_mesh(["efsdp", "ep"])
        dense = registry.device_mesh(["dp_shard", "cp"])
        groups = {
            "sparse.efsdp": sparse.get_group("efsdp"), "sparse.ep": sparse.get_group("ep"),
            "dense.dp_shard": dense.get_group("dp_shard"), "dense.cp": dense.get_group("cp"),
        }
        out: dict[str, Any] = {
            "ranks": {k: dist.get_process_group_ranks(g) for k, g in groups.items()},
            "default": [k for k, g in groups.items() if g.group_name == default.group_name],
            "ep_is_role": groups["sparse.ep"] is registry.group("ep"),
            "cp_is_role": groups["dense.cp"] is registry.group("cp"),
        }
        try:
            registry.device_mesh(["ep", "efsdp"])
        except cg.errors.LayoutError as error:
            out["transposed"] = str(error)
        before = len(torch_private.group_names())
        flat = torch_private.flatten(dense["dp_shard", "cp"])  # torch's default name: dp_shard_cp
        out["flatten"] = {
            "default_name": flat.get_group() is registry.group("fsdp"),
            "role_name": torch_private.flatten(dense["dp_shard", "cp"], "fsdp").get_group()
            is registry.group("fsdp"),
            "sliced": dense["fsdp"].get_group() is registry.group("fsdp"),
            "names": flat.mesh_dim_names,
            "new_groups": len(torch_private.group_names()) - before,
        }
        ep = registry.collectives("ep")
        import torch

        t = torch.tensor([float(rank)])
        ep.all_reduce(t)
        out["ep_sum"] = float(t)
    return out


def test_view_meshes_on_four_gloo_ranks() -> None:
    results = run_world(_moe_world, 4, timeout=180)
    for rank, out in enumerate(results):
        assert out["ranks"]["sparse.ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["ranks"]["sparse.efsdp"] == [rank % 2, rank % 2 + 2]
        assert out["ranks"]["dense.dp_shard"] == [rank % 2, rank % 2 + 2]
        assert out["default"] == [] and out["ep_is_role"] and out["cp_is_role"]
        assert "layout order" in out["transposed"]
        assert out["flatten"] == {"default_name": True, "role_name": True, "sliced": True,
                                  "names": ("dp_shard_cp",), "new_groups": 0}
        assert out["ep_sum"] == float(2 * (rank - rank % 2) + 1)
