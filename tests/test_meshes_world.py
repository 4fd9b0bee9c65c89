"""Meshes whose axes are dims or whole roles: HSDP (dp_replicate x fsdp) on dedicated groups.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_meshes.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commgroups as cg
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world


HSDP = cg.Layout(dims={"dp_replicate": 2, "dp_shard": 1, "cp": 2})


def _train(shard: Callable[[nn.Module], Any], rank: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer)  # on a 2-D mesh: replicate on dim 0, shard on dim 1 (HSDP)
    shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _hsdp(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commgroups.integrations.fsdp import fully_shard_on_role

    default = torch_private.default_group()
    with cg.GroupRegistry(HSDP) as registry:
        mesh = registry.device_mesh(["dp_replicate", "fsdp"])
        out: dict[str, Any] = {
            "shape": tuple(mesh.shape),
            "names": mesh.mesh_dim_names,
            "replicate_is_role": mesh.get_group("dp_replicate") is registry.group("dp_replicate"),
            "shard_is_role": mesh.get_group("fsdp") is registry.group("fsdp"),
            "rows": [dist.get_process_group_ranks(mesh.get_group(n)) for n in ("dp_replicate", "fsdp")],
            "default_used": any(mesh.get_group(n).group_name == default.group_name
                                for n in ("dp_replicate", "fsdp")),
            "losses": _train(
                lambda m: fully_shard_on_role(m, registry, replicate="dp_replicate"), rank),
        }
        for bad in (["fsdp", "dp_replicate"], ["fsdp", "cp"], ["nope"]):
            try:
                registry.device_mesh(bad)
                out[f"bad:{bad}"] = None
            except cg.errors.LayoutError as error:
                out[f"bad:{bad}"] = str(error)
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    out["plain_losses"] = _train(lambda m: fully_shard(m, mesh=plain), rank)
    return out


@pytest.fixture(scope="module")
def hsdp_results() -> list[dict[str, Any]]:
    return run_world(_hsdp, 4, timeout=180)


def test_hsdp_mesh_uses_the_role_groups(hsdp_results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(hsdp_results):
        assert out["shape"] == (2, 2) and out["names"] == ("dp_replicate", "fsdp")
        assert out["replicate_is_role"] and out["shard_is_role"] and not out["default_used"]
        assert out["rows"] == [[rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1]]


def test_hsdp_trains_like_a_plain_mesh(hsdp_results: list[dict[str, Any]]) -> None:
    for out in hsdp_results:
        assert out["losses"] == out["plain_losses"]


def test_bad_mesh_axes_name_the_fix(hsdp_results: list[dict[str, Any]]) -> None:
    for out in hsdp_results:
        assert "layout order" in out["bad:['fsdp', 'dp_replicate']"]
        assert "distinct" in out["bad:['fsdp', 'cp']"]  # fsdp already spans cp
        assert "neither a dim nor a role" in out["bad:['nope']"]
