"""The GroupRegistry on real multi-process gloo worlds: dedicated groups, meshes, agreement, close.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_registry.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import errors
from tests import torch_private
from tests.worlds import run_world

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

pytestmark = pytest.mark.world


def _live(group: dist.ProcessGroup) -> bool:
    return group in torch_private.live_groups()


def _check_layout(layout: cg.Layout, rank: int) -> dict[str, Any]:
    """Create, check every role, build meshes, close; return what the parent asserts on."""
    default = torch_private.default_group()
    plan = cg.plan(layout)
    registry = cg.GroupRegistry(layout).create()
    seen: dict[str, Any] = {}
    groups = []
    for role in registry.role_names:
        group = registry.group(role)
        groups.append(group)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=group)
        seen[role] = {
            "default": group is default or group == dist.group.WORLD
            or group.group_name == default.group_name,
            "ranks": list(registry.ranks(role)),
            "actual_ranks": dist.get_process_group_ranks(group),
            "sum": value.item(),
            "expected_sum": float(sum(r + 1 for r in plan.group_of(role, rank) or ())),
            "backend": dist.get_backend(group),
            "desc": group.group_desc,
        }
    meshes: dict[str, Any] = {}
    dims = list(layout.dims)
    mesh = registry.device_mesh(dims)
    meshes["all_dims"] = {
        "shape": tuple(mesh.shape),
        "groups_are_registry": [
            any(mesh.get_group(d) is registry.group(r.name) for r in layout.roles if r.dims == [d])
            for d in dims
        ],
        "rows": [dist.get_process_group_ranks(mesh.get_group(d)) for d in dims],
        "no_default": all(mesh.get_group(d).group_name != default.group_name for d in dims),
    }
    if "fsdp" in registry.role_names:
        fsdp_mesh = registry.device_mesh("fsdp")
        meshes["fsdp_is_role_group"] = fsdp_mesh.get_group() is registry.group("fsdp")
    seen["_distinct"] = len({id(g) for g in groups}) == len(groups)
    seen["_meshes"] = meshes
    seen["_describe"] = registry.describe()
    registry.close()
    seen["_closed"] = [not _live(g) for g in groups]
    registry.close()  # idempotent
    try:
        registry.group(registry.role_names[0])
        seen["_after_close"] = None
    except errors.RegistryClosedError as error:
        seen["_after_close"] = str(error)
    return seen


def _many_layouts(rank: int, world_size: int) -> dict[str, Any]:
    results = {
        "seed": _check_layout(cg.load_layout(LAYOUTS / "seed_cp4.toml"), rank),
        "2x2": _check_layout(cg.Layout(dims={"dp_shard": 2, "cp": 2}), rank),
        "4x1": _check_layout(cg.Layout(dims={"dp_shard": 4, "cp": 1}), rank),
    }
    # two registries at once do not interfere
    with cg.GroupRegistry(cg.Layout(dims={"cp": 4})) as a, cg.GroupRegistry(
        cg.Layout(dims={"dp": 2, "tp": 2})
    ) as b:
        x = torch.ones(1)
        a.group("cp").allreduce([x]).wait()
        y = torch.ones(1)
        dist.all_reduce(y, group=b.group("tp"))
        results["two"] = (x.item(), y.item(), a.group("cp") is not b.group("tp"))
        try:
            a.group("tp")
        except KeyError as error:
            results["unknown_role"] = str(error)
    return results


def _layouts_then_disagreements(rank: int, world_size: int) -> dict[str, Any]:
    # Independent checks share one 4-rank world (starting one costs seconds on 2 cores).
    return {**_many_layouts(rank, world_size), "disagreements": _disagreements(rank, world_size)}


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict[str, Any]]:
    return run_world(_layouts_then_disagreements, 4, timeout=240)  # two checks: twice the default


@pytest.mark.parametrize("name", ["seed", "2x2", "4x1"])
def test_roles_are_dedicated_and_correct(four_rank_results: list[dict[str, Any]], name: str) -> None:
    for rank, result in enumerate(four_rank_results):
        seen = result[name]
        roles = [k for k in seen if not k.startswith("_")]
        assert roles
        for role in roles:
            info = seen[role]
            assert not info["default"], f"rank {rank}: role {role} aliases the default group"
            assert info["ranks"] == info["actual_ranks"]
            assert rank in info["ranks"]
            assert info["sum"] == info["expected_sum"]
            assert info["desc"] == role
        assert seen["_distinct"]
        assert seen["checkpoint-metadata"]["backend"] == "gloo"
        assert all(seen["_closed"]), "close() must destroy every group"
        assert "closed" in seen["_after_close"]
        assert "GroupRegistry: world 4" in seen["_describe"]


def test_seed_layout_cp_spans_world_yet_is_not_default(four_rank_results: list[dict[str, Any]]) -> None:
    for result in four_rank_results:
        seed = result["seed"]
        assert seed["cp"]["ranks"] == [0, 1, 2, 3]
        assert seed["fsdp"]["ranks"] == [0, 1, 2, 3]
        meshes = seed["_meshes"]
        assert meshes["all_dims"]["shape"] == (1, 4)
        assert meshes["all_dims"]["groups_are_registry"] == [False, True]  # dp_shard has no role
        assert meshes["all_dims"]["no_default"]
        assert meshes["fsdp_is_role_group"]


def test_meshes_match_plan_rows(four_rank_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(four_rank_results):
        mesh = result["2x2"]["_meshes"]["all_dims"]
        assert mesh["shape"] == (2, 2)
        assert mesh["groups_are_registry"] == [True, True]
        assert mesh["rows"][0] == [rank % 2, rank % 2 + 2]  # dp_shard column
        assert mesh["rows"][1] == [rank - rank % 2, rank - rank % 2 + 1]  # cp row


def test_two_registries_do_not_interfere(four_rank_results: list[dict[str, Any]]) -> None:
    for result in four_rank_results:
        assert result["two"] == (4.0, 2.0, True)
        assert "known roles: cp, fsdp, checkpoint-metadata" in result["unknown_role"]


def _disagreements(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}

    def attempt(name: str, layout: cg.Layout, **kwargs: Any) -> None:
        try:
            cg.GroupRegistry(layout, **kwargs).create()
            out[name] = "created"
        except errors.CommGroupsError as error:
            out[name] = f"{type(error).__name__}: {error}"
            if error.__cause__ is not None:  # the message cuts a long cause (gloo's) short
                out[f"{name}_cause"] = repr(error.__cause__)

    base = cg.Layout(dims={"dp_shard": 1, "cp": 4})
    timeout = base.model_copy(update={"roles": [
        r.model_copy(update={"timeout_s": 5.0}) if r.name == "cp" else r for r in base.roles]})
    attempt("timeout", timeout if rank == 3 else base)
    attempt("dims", cg.Layout(dims={"dp_shard": 2, "cp": 2}) if rank == 1 else base)
    attempt("backend", cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(
        name="cp", dims=["cp"], backend="gloo" if rank in (0, 2) else "device")]))
    attempt("world", cg.Layout(dims={"dp_shard": 2, "cp": 4}))
    attempt("nccl", cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"],
                                                                backend="nccl")]))
    attempt("after", base)  # the world is still usable after every failure above
    return out


def test_disagreement_is_an_error_on_every_rank(four_rank_results: list[dict[str, Any]]) -> None:
    results = [result["disagreements"] for result in four_rank_results]
    for out in results:
        assert out["timeout"].startswith("LayoutMismatchError: ranks [3]"), out["timeout"]
        assert "timeout_s" in out["timeout"] and "5.0" in out["timeout"]
        assert out["dims"].startswith("LayoutMismatchError: ranks [1]")
        assert "dims" in out["dims"]
        # a layout that differs on rank 0 itself: every other rank is named
        assert out["backend"].startswith("LayoutMismatchError: ranks [1, 3]"), out["backend"]
        assert out["world"].startswith("WorldSizeMismatchError"), out["world"]
        assert "8" in out["world"] and "fix" in out["world"]
        assert out["nccl"].startswith("BackendUnavailableError"), out["nccl"]
        assert out["after"] == "created", (out["after"], out.get("after_cause"))
    # identical message on every rank
    for key in ("timeout", "dims", "backend", "world", "nccl"):
        assert len({r[key] for r in results}) == 1, key


def _one_rank_skips_create(rank: int, world_size: int) -> str:
    if rank == 3:
        return "skipped"
    try:
        cg.GroupRegistry(cg.Layout(dims={"cp": 4}), create_timeout_s=3).create()
    except errors.AgreementTimeoutError as error:
        return str(error)
    return "created"


def test_missing_rank_times_out_naming_it() -> None:
    results = run_world(_one_rank_skips_create, 4, timeout=60)
    assert results[3] == "skipped"
    for message in results[:3]:
        assert "never arrived: [3]" in message
