"""registry.rebuild() after a real rank loss: survivors check in, retire, and rebuild every role.

Real gloo worlds where one rank exits for good (``os._exit``) mid-job; the launcher hosts the store,
so even rank 0 may die. Survivors first see their collective fail (the peer is gone), then rebuild on
the smaller layout that ``elastic`` allows, and keep communicating on the new groups.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from commgroups import GroupRegistry, Layout, RoleSpec, default_roles
from commgroups.errors import RebuildError, ReplanError, StaleGenerationError
from commgroups.rank_loss import recovery as recovery_module
from tests import torch_private
from tests.worlds import connected_barrier, explain, run_world

pytestmark = pytest.mark.world

ROLE_TIMEOUT_S = 3.0
DIMS = {"dp_replicate": 2, "dp_shard": 2}


def hsdp_layout(dims: dict[str, int] = DIMS, *, spares: bool = False,
                timeout_s: float = ROLE_TIMEOUT_S) -> Layout:
    """HSDP whose replicas may be lost down to one; every role times out after ``timeout_s``."""
    roles = [RoleSpec(**{**role.model_dump(), "timeout_s": timeout_s})
             for role in default_roles(dims)]
    return Layout(dims=dims, roles=roles,
                  elastic={"dims": {"dp_replicate": 1}, "spares": spares})


def _fail_then_rebuild(rank: int, world: int, victim: int, role: str,
                       alive_known: bool) -> dict[str, Any]:
    registry = GroupRegistry(hsdp_layout(), create_timeout_s=30).create()
    old = registry.collectives(role)
    mesh = registry.device_mesh(["dp_replicate", "fsdp"])
    connected_barrier(registry, rank, world, victim=victim)  # lost for good: no report
    started = time.monotonic()
    error = ""
    try:
        old.all_reduce(torch.ones(1))  # fails on the victim's peers in ``role``
        registry.collectives("checkpoint-metadata").barrier()  # spans the world: fails everywhere
    except Exception as caught:  # the role error: the peer is gone (at once, or at the timeout)
        error = type(caught).__name__
    detected = time.monotonic() - started
    alive = [r for r in range(world) if r != victim] if alive_known else None
    report = registry.rebuild(alive, timeout=2 * ROLE_TIMEOUT_S + 6)  # may notice after 2 timeouts
    result: dict[str, Any] = {"error": error, "detected_s": detected, "place": report.place,
                              "generation": registry.generation, "lost": report.lost,
                              "members": report.members, "seconds": report.seconds}
    try:
        old.all_reduce(torch.ones(1))
    except StaleGenerationError as stale:
        result["stale"] = (stale.role, stale.generation)
    if report.place != "member":
        try:
            registry.group("fsdp")
        except Exception as refused:
            result["refused"] = type(refused).__name__
        registry.close()
        return result
    total = torch.tensor([float(rank)])
    registry.collectives("fsdp").all_reduce(total)
    world_sum = torch.tensor([1.0])
    registry.collectives("checkpoint-metadata").all_reduce(world_sum)
    new_mesh = registry.device_mesh(["dp_replicate", "fsdp"])
    result.update(
        fsdp_ranks=registry.ranks("fsdp"), fsdp_sum=float(total.item()),
        world_sum=float(world_sum.item()), dims=dict(registry.layout.dims),
        mesh=new_mesh.mesh.tolist(), mesh_is_new=new_mesh is not mesh,
        default_alias=any(g is torch_private.default_group()
                          for g in registry.process_groups().values()),
    )
    registry.close()
    return result


# A rank dies while the survivors are in a collective of each role (then of the world). One case
# waits out the check-in window (nobody says who is alive: 12 s here); the others are told (alive=).
# The window path is also taken by the second-loss and late-rank tests below, the in-place training
# test (tests/test_rebuild_training.py) and the demo's kill test.
@pytest.mark.parametrize(("victim", "role", "alive_known"), [
    (3, "fsdp", False), (0, "dp_replicate", True), (2, "dp_shard", True),
    (1, "checkpoint-metadata", True),
], ids=["rank3-fsdp-check-in-window", "rank0-dp_replicate-alive-given",
        "rank2-dp_shard-alive-given", "rank1-checkpoint-metadata-alive-given"])
def test_survivors_rebuild_on_the_smaller_layout(victim: int, role: str,
                                                 alive_known: bool) -> None:
    results = run_world(_fail_then_rebuild, 4, victim, role, alive_known, timeout=90,
                        expect_errors=True)
    assert isinstance(results[victim], TimeoutError)  # it never reported: it is gone
    survivors = [r for r in range(4) if r != victim]
    kept = [0, 1] if victim >= 2 else [2, 3]  # the victim's replica goes with it
    for rank in survivors:
        result = results[rank]
        assert isinstance(result, dict), result
        assert result["error"], f"rank {rank}: the loss went unnoticed"
        # Noticed at once (a direct peer) or at the role's timeout, never later.
        assert result["detected_s"] < 2 * ROLE_TIMEOUT_S + 5
        assert result["lost"] == (victim,)
        assert result["members"] == tuple(kept)
        assert result["generation"] == 1
        assert result["stale"] == (role, 0)
        if rank in kept:
            assert result["place"] == "member"
            assert result["dims"] == {"dp_replicate": 1, "dp_shard": 2}
            assert result["fsdp_ranks"] == tuple(kept)
            assert result["fsdp_sum"] == float(sum(kept))
            assert result["world_sum"] == 2.0
            assert result["mesh"] == [kept]
            assert result["mesh_is_new"] and not result["default_alias"]
            assert set(result["seconds"]) == {"check_in", "replan", "retire", "create", "meshes", "release"}
        else:
            assert result["place"] == "dropped"
            assert result["refused"] == "RegistryStateError"


def _replan_refused(rank: int, world: int) -> str:
    layout = Layout(dims={"dp_shard": 2, "cp": 2}, elastic={"dims": {"dp_shard": 2}})
    registry = GroupRegistry(layout).create()
    # Not at once: a rank returns from create() while a peer may still be connecting to it,
    # and its exit then fails that peer's create() (torch 2.10 leg, once the end of create()
    # got shorter), which is a loss during creation, not this test's loss after it.
    connected_barrier(registry, rank, world, victim=1)
    try:
        registry.rebuild([r for r in range(world) if r != 1], timeout=10)
    except ReplanError as error:
        message = str(error)
        # Nothing was retired: the registry still answers (its groups hold the dead rank).
        registry.ranks("cp")
        return message
    return "rebuilt"


def test_a_loss_no_dim_may_absorb_is_the_same_error_everywhere() -> None:
    results = run_world(_replan_refused, 4, timeout=60, expect_errors=True)
    messages = {results[r] for r in (0, 2, 3)}
    assert len(messages) == 1, messages
    (message,) = messages
    assert isinstance(message, str) and "cp" in message and "1" in message, message


def _bad_alive(rank: int, world: int) -> list[str]:
    registry = GroupRegistry(hsdp_layout()).create()
    said = []
    for alive in ([0, 1, 2, 3, 9], [r for r in range(world) if r != rank], ["a"]):
        try:
            registry.rebuild(alive, timeout=timedelta(seconds=1))
        except RebuildError as error:
            said.append(str(error).split(";")[0])
    registry.close()
    return said


def test_malformed_alive_is_refused_before_anything_happens() -> None:
    for said in run_world(_bad_alive, 4, timeout=60):
        assert len(said) == 3
        assert "outside" not in said[1]


SECOND_LOSS_WINDOW_S = 60.0


def _second_loss_during_rebuild(rank: int, world: int, alive_known: bool) -> dict[str, Any]:
    """6 ranks (3 replicas of 2): rank 5 dies; rank 0 dies too, inside its rebuild, just after the
    check-in. The survivors' rebuild() starts over without rank 0 by itself."""
    registry = GroupRegistry(hsdp_layout({"dp_replicate": 3, "dp_shard": 2}),
                             create_timeout_s=6).create()
    connected_barrier(registry, rank, world, victim=5)
    if rank == 0:
        def die(*args: Any, **kwargs: Any) -> Any:
            os._exit(0)

        # dies mid-rebuild, after the check-in, on this rank only (a spawned process: no undo)
        setattr(recovery_module, "make_generation", die)  # noqa: B010
    with contextlib.suppress(Exception):
        registry.collectives("checkpoint-metadata").barrier()
    alive = [0, 1, 2, 3, 4] if alive_known else None  # the caller knows of rank 5 only
    report = registry.rebuild(alive, timeout=SECOND_LOSS_WINDOW_S)
    result = {"place": report.place, "lost": report.lost, "retried": report.retried,
              "check_in_s": report.seconds["check_in"], "described": report.describe(),
              "members": report.members, "generation": registry.generation}
    if report.place == "member":
        total = torch.ones(1)
        registry.collectives("checkpoint-metadata").all_reduce(total)
        result["world_sum"] = float(total.item())
    registry.close()
    return result


@pytest.mark.parametrize("alive_known", [False, True], ids=["no-alive", "alive-with-rank-0"])
def test_a_second_loss_during_rebuild_is_rebuilt_without_at_once(alive_known: bool) -> None:
    results = run_world(_second_loss_during_rebuild, 6, alive_known, timeout=150,
                        expect_errors=True)
    assert all(isinstance(results[rank], dict) for rank in (1, 2, 3, 4)), explain(results)
    assert isinstance(results[0], TimeoutError) and isinstance(results[5], TimeoutError)
    # Rank 4 lost its replica-mate at the first rebuild: dropped then, before the second loss.
    assert results[4]["place"] == "dropped" and results[4]["retried"] == ()
    for rank in (1, 2, 3):
        result = results[rank]
        # Rank 0's process is gone while the others wait in the agreement: a peer on its host
        # sees it and ends the attempt for everyone at once, and rebuild() starts over (before:
        # create_timeout_s, then an AgreementTimeoutError for the caller to retry on).
        assert len(result["retried"]) == 1, result
        assert "retried 1 time(s) after a survivor died" in result["described"], result
        # The retry checks in with the members the first attempt decided on: it waited for rank
        # 4 (dropped then, gone with its place) until its window ended before.
        assert result["check_in_s"] < SECOND_LOSS_WINDOW_S / 2, result
        assert result["generation"] == 1
        assert result["members"] == (2, 3)  # replicas 0 and 2 are gone
        assert set(result["lost"]) >= {0, 5}
    assert results[1]["place"] == "dropped"
    assert results[2]["world_sum"] == results[3]["world_sum"] == 2.0
