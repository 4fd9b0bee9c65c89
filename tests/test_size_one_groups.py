"""Size-1 dims and roles through the registry: single-rank groups, no communicator, exact results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world

# torchtitan-like: pp and tp are 1 here, but a trainer still asks for their meshes.
LAYOUT = cg.Layout(
    dims={"pp": 1, "dp_shard": 2, "cp": 2, "tp": 1},
    roles=[
        cg.RoleSpec(name="tp", dims=["tp"]),
        cg.RoleSpec(name="cp", dims=["cp"]),
        cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo"),
    ],
)


def _size_one(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    before = set(torch_private.group_names().values())
    with cg.GroupRegistry(LAYOUT, meshes=[["pp", "dp_shard", "cp", "tp"]]) as registry:
        out["backend"] = {r: registry.backend(r) for r in registry.role_names}
        out["method"] = registry.creation_method("tp")
        mesh = registry.device_mesh(["pp", "dp_shard", "cp", "tp"])
        groups = {name: mesh.get_group(name) for name in ("pp", "dp_shard", "cp", "tp")}
        out["torch_backend"] = {n: dist.get_backend(g) for n, g in groups.items()}
        out["sizes"] = {n: g.size() for n, g in groups.items()}
        out["tp_is_role"] = groups["tp"] is registry.group("tp")
        tp = registry.collectives("tp")
        x = torch.arange(4.0) + 10 * rank
        gathered = torch.empty(4)
        tp.all_gather_into_tensor(gathered, x)
        reduced = x.clone()
        tp.all_reduce(reduced)
        scattered = torch.empty(4)
        tp.reduce_scatter_tensor(scattered, x)
        out["values"] = (gathered.tolist(), reduced.tolist(), scattered.tolist(), x.tolist())
        # DTensor over the 2-D (cp, tp) mesh: a shard over the size-1 tp dim gathers to the same
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        sub = registry.device_mesh(["cp", "tp"])
        full = torch.arange(8.0).reshape(2, 4)
        dt = distribute_tensor(full, sub, [Replicate(), Shard(1)])
        out["dtensor"] = dt.redistribute(sub, [Replicate(), Replicate()]).to_local().tolist()
        made = set(torch_private.group_names().values()) - before
        out["real_groups"] = sorted(
            dist.get_backend(g) for g, name in torch_private.group_names().items()
            if name in made and dist.get_backend(g) != "cg_single")
    return out


def test_size_one_dims_and_roles_get_single_rank_groups() -> None:
    for rank, out in enumerate(run_world(_size_one, 4, timeout=180)):
        assert out["backend"] == {"tp": "single", "cp": "gloo", "fsdp": "gloo",
                                  "checkpoint-metadata": "gloo"}
        assert out["method"] == "local"
        assert out["torch_backend"]["pp"] == out["torch_backend"]["tp"] == "cg_single"
        assert out["sizes"] == {"pp": 1, "dp_shard": 2, "cp": 2, "tp": 1}
        assert out["tp_is_role"]
        gathered, reduced, scattered, x = out["values"]
        assert gathered == reduced == scattered == x  # a 1-rank group: output equals input
        assert out["dtensor"] == torch.arange(8.0).reshape(2, 4).tolist()
        # communicators: cp, fsdp, checkpoint-metadata and the mesh's dp_shard dim; none for pp/tp
        assert out["real_groups"] == ["gloo"] * 4, (rank, out["real_groups"])
