"""HSDP's replica all-reduce: blocking under FSDP2 (no hook), said once per role, and counted by the
audit; async-and-wait inside ``async_and_wait_scope`` (issue 28 item 4).

FSDP2 (torch 2.13-2.15) issues HSDP's all-reduce over the replicate group as a plain
``dist.all_reduce``: the custom-comm hooks reach its all-gathers and reduce-scatters only.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import commgroups as cg
from commgroups import GroupRegistry
from commgroups.audit.merge import merge
from commgroups.integrations.fsdp import HSDP_ALL_REDUCE_WHY, fully_shard_on_role
from tests.worlds import run_world

pytestmark = pytest.mark.world

WORLD = 4


def _layout() -> cg.Layout:
    return cg.Layout(
        dims={"dp_replicate": 2, "dp_shard": 2},
        roles=[cg.RoleSpec(name="dp_replicate", dims=["dp_replicate"]),
               cg.RoleSpec(name="fsdp", dims=["dp_shard"]),
               cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")],
    )


def _step(model: torch.nn.Module, rank: int) -> float:
    torch.manual_seed(rank)
    x = torch.randn(4, 8)
    loss = F.mse_loss(model(x), torch.zeros(4, 8))
    loss.backward()
    return float(loss.detach())


def _hsdp_world(rank: int, world: int) -> dict[str, Any]:
    with GroupRegistry(_layout()) as registry:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for layer in model:
                fully_shard_on_role(layer, registry, replicate="dp_replicate")
            fully_shard_on_role(model, registry, replicate="dp_replicate")
        said = [str(w.message) for w in caught if "HSDP all-reduce" in str(w.message)]
        with cg.audit.record(registry) as plain:
            _step(model, rank)
        with cg.audit.record(registry) as scoped, cg.async_and_wait_scope():
            _step(model, rank)
        replica = registry.group("dp_replicate").group_name
        return {"said": said, "plain": plain.to_dict(), "scoped": scoped.to_dict(),
                "replica": replica}


@pytest.fixture(scope="module")
def hsdp_results() -> list[dict[str, Any]]:
    """One unscoped and one scoped HSDP step, each recorded, in one 4-rank world."""
    return run_world(_hsdp_world, WORLD, timeout=180)


def _replica_calls(data: dict[str, Any], replica: str) -> list[dict[str, Any]]:
    return [r for r in data["records"] if r["group"] == replica and "allreduce" in r["op"]]


def test_blocking_replica_all_reduce_is_said_once_per_role(
        hsdp_results: list[dict[str, Any]]) -> None:
    for result in hsdp_results:
        # Three fully_shard_on_role calls on one role, one warning, naming the role and why.
        assert len(result["said"]) == 1, result["said"]
        assert "'dp_replicate'" in result["said"][0]
        assert HSDP_ALL_REDUCE_WHY in result["said"][0]
        calls = _replica_calls(result["plain"], result["replica"])
        assert calls and all(r["async_op"] is False for r in calls)


def test_scope_issues_the_replica_all_reduce_async_and_wait(
        hsdp_results: list[dict[str, Any]]) -> None:
    for result in hsdp_results:
        calls = _replica_calls(result["scoped"], result["replica"])
        assert calls and all(r["async_op"] is True for r in calls)
        assert len(calls) == len(_replica_calls(result["plain"], result["replica"]))


def test_audit_summary_counts_blocking_calls_on_async_and_wait_roles(
        hsdp_results: list[dict[str, Any]]) -> None:
    replica = hsdp_results[0]["replica"]
    plain = merge([r["plain"] for r in hsdp_results])
    blocking = sum(len(_replica_calls(r["plain"], replica)) for r in hsdp_results)
    group = plain.summary["groups"][replica]
    assert group["blocking_async_roles"] == {"dp_replicate": blocking}
    assert f"blocking_on_async_and_wait_role=dp_replicate:{blocking}" in plain.render()
    scoped = merge([r["scoped"] for r in hsdp_results])
    assert "blocking_async_roles" not in scoped.summary["groups"][replica]
    assert "blocking_on_async_and_wait_role" not in scoped.render()
