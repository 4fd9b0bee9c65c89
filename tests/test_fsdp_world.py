"""FSDP2 on the registry's fsdp role: same training as on a plain mesh (losses equal), on its own group.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_fsdp.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commgroups import GroupRegistry
from commgroups.demo.config import seed_layout
from commgroups.integrations.fsdp import (
    fsdp_mesh,
    fully_shard_on_role,
    install_async_and_wait_comms,
)
from tests import torch_private
from tests.test_dcp_world import C10dRecorder
from tests.worlds import run_world

pytestmark = pytest.mark.world


WORLD = 4
STEPS = 3


def _train(shard: Callable[[nn.Module], Any], rank: int,
           after: Callable[[nn.Module], Any] | None = None) -> tuple[list[float], Any]:
    from commgroups.demo.model import ModelConfig, TinyTransformer
    from commgroups.demo.train import batch_tokens

    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig(max_seq=16))
    for block in model.blocks:
        shard(block)
    shard(model)
    if after is not None:
        after(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    rec = C10dRecorder()
    with rec:
        for step in range(STEPS):
            tokens = batch_tokens(step, rank, 2, 16, 64)  # each rank its own data
            logits = model(tokens[:, :16])
            loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.detach()))
    return losses, (rec.ops, model.tok.weight.device_mesh.get_group().group_name)


def _fsdp_world(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    default = torch_private.default_group().group_name
    with GroupRegistry(seed_layout(world)) as registry:
        fsdp = registry.group("fsdp").group_name
        reg_losses, (reg_ops, reg_group) = _train(lambda m: fully_shard_on_role(m, registry), rank)
        # sharded by someone else (as torchtitan does), the comms installed afterwards
        installed: list[int] = []
        late_losses, (late_ops, _) = _train(
            lambda m: fully_shard(m, mesh=registry.device_mesh("fsdp")), rank,
            after=lambda m: installed.append(install_async_and_wait_comms(m)))
        try:
            fully_shard_on_role(nn.Linear(2, 2), registry, mesh=fsdp_mesh(registry))
            mesh_error = None
        except TypeError as error:
            mesh_error = str(error)
    # Not named "fsdp": torch compares DeviceMeshes by rank layout and dim names only, and DTensor's
    # sharding-propagation cache then hands out the registry's equal-looking mesh (whose groups are
    # closed by now) for this one.
    plain = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    plain_losses, (plain_ops, plain_group) = _train(lambda m: fully_shard(m, mesh=plain), rank)
    return {"default": default, "fsdp": fsdp, "reg_losses": reg_losses, "reg_ops": reg_ops,
            "reg_group": reg_group, "plain_losses": plain_losses, "plain_ops": plain_ops,
            "plain_group": plain_group, "mesh_error": mesh_error, "late_losses": late_losses,
            "late_ops": late_ops, "installed": installed}


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict[str, Any]]:
    """Both trainings, in one 4-rank world."""
    return run_world(_fsdp_world, WORLD, timeout=180)


def test_losses_equal_plain_mesh(fsdp_results: list[dict[str, Any]]) -> None:
    for out in fsdp_results:
        assert len(out["reg_losses"]) == STEPS
        assert out["reg_losses"] == out["plain_losses"]


def test_fsdp_runs_on_the_role_group_not_the_default(fsdp_results: list[dict[str, Any]]) -> None:
    for out in fsdp_results:
        assert out["reg_group"] == out["fsdp"] != out["default"]
        assert out["reg_ops"] and {op.group_name for op in out["reg_ops"]} == {out["fsdp"]}
        # async-and-wait reached FSDP2: every all-gather and reduce-scatter was issued async
        assert all(op.async_op for op in out["reg_ops"]), out["reg_ops"]
        # without it FSDP2 (torch 2.13) issues them blocking
        assert any(op.async_op is False for op in out["plain_ops"])
        # what commgroups avoids: a world-sized plain mesh dim *is* the default group
        assert out["plain_group"] == out["default"]
        assert {op.group_name for op in out["plain_ops"]} == {out["default"]}


def test_comms_installed_after_someone_else_sharded(fsdp_results: list[dict[str, Any]]) -> None:
    for out in fsdp_results:
        assert out["installed"] == [3]  # two blocks and the root
        assert out["late_losses"] == out["plain_losses"]
        assert out["late_ops"] and all(op.async_op for op in out["late_ops"]), out["late_ops"]
        assert {op.group_name for op in out["late_ops"]} == {out["fsdp"]}


def test_mesh_argument_is_refused(fsdp_results: list[dict[str, Any]]) -> None:
    for out in fsdp_results:
        assert out["mesh_error"] is not None and "mesh=" in out["mesh_error"]
