"""commgroups.torch_internals: the one place private torch is reached, proven on the running torch.

Every supported torch (2.10 to the newest release, one CI leg each) runs this file: the naming
prediction is compared with the names torch actually registers on a real 4-rank gloo world, ``auto``
creation must take the local path there, and commgroups must emit no deprecation warning.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_torch_internals.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import torch_internals
from commgroups.registry import GroupRegistry
from tests.test_torch_internals import TORCH
from tests.worlds import run_world

pytestmark = pytest.mark.world

# torch 2.14 salts hashed group names with _world.group_count, which grows with every group ever
# made (until the default group is destroyed): a layout re-created after close() gets new names.
# Before 2.14 the salt is len(_world.pg_names), which falls back when groups are destroyed.
NAMES_NEVER_REPEAT = TORCH >= (2, 14, 0)


# --------------------------------------------------------------------- on a real gloo world


def _regular() -> cg.Layout:
    return cg.Layout(dims={"dp_shard": 2, "cp": 2})  # built-in roles: dp_shard, cp, fsdp, ckpt


def names_worker(rank: int, world: int) -> dict[str, Any]:
    """Predict the names of a mixed sequence of new_group calls, make them, compare; twice (the
    second time from the state the first left: groups are kept, so no name can come back)."""
    out: dict[str, Any] = {}
    pairs = [[0, 1], [2, 3]]
    mine = next(g for g in pairs if rank in g)
    columns = [[0, 2], [1, 3]]
    column = next(g for g in columns if rank in g)
    calls = [
        *(torch_internals.GroupCall(tuple(g), local=False, member=rank in g) for g in pairs),
        torch_internals.GroupCall(tuple(column), local=True, member=True),
        torch_internals.GroupCall(tuple(range(world)), local=True, member=True),
    ]
    kept: list[dist.ProcessGroup] = []
    for attempt in ("first", "second"):
        before = torch_internals.group_naming_state(world), torch_internals.registered_group_names()
        predicted = torch_internals.predict_group_names(calls, world)
        after = torch_internals.group_naming_state(world), torch_internals.registered_group_names()
        out["untouched"] = out.get("untouched", True) and before == after
        made: list[dist.ProcessGroup | None] = []
        for g in pairs:
            group = dist.new_group(g)
            made.append(group if g == mine else None)
        made.append(dist.new_group(column, use_local_synchronization=True))
        made.append(dist.new_group(list(range(world)), use_local_synchronization=True))
        actual = [g.group_name if isinstance(g, dist.ProcessGroup) else None for g in made]
        out[attempt] = {"predicted": predicted, "actual": actual,
                        "member": [c.member for c in calls]}
        kept.extend(g for g in made if isinstance(g, dist.ProcessGroup))
    # The groups stay until the world ends: destroyed, torch < 2.14 could hand their names to
    # later groups, whose rendezvous would meet the stale keys (local_worker runs next).
    return out


def _names_then_local(rank: int, world: int) -> dict[str, Any]:
    # Both checks in one 4-rank world. Names first, on torch's fresh counters; its groups stay
    # live, so the registry's groups after them get names never used here before.
    return {"names": names_worker(rank, world), "local": local_worker(rank, world)}


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    return run_world(_names_then_local, 4, timeout=180)


def test_predicted_names_match_torch(gloo_results: list[dict[str, Any]]) -> None:
    """torch's own naming code, run on a copy of its counters, predicts the names it registers."""
    results = [result["names"] for result in gloo_results]
    for rank, result in enumerate(results):
        assert result["untouched"], f"rank {rank}: predicting names moved torch's own counters"
        for attempt in ("first", "second"):
            predicted, actual = result[attempt]["predicted"], result[attempt]["actual"]
            assert predicted is not None, f"torch {torch.__version__}: names not predictable"
            for member, guess, name in zip(result[attempt]["member"], predicted, actual):
                if member:
                    assert guess == name, (rank, attempt, predicted, actual)


def local_worker(rank: int, world: int) -> dict[str, Any]:
    """local creation of a regular layout, twice (re-created after close), plus set_timeout
    (local, not auto: on 4 ranks auto makes these few groups on every rank, prefer_all_ranks)."""
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in ("first", "again"):
            registry = GroupRegistry(_regular(), creation_mode="local", create_timeout_s=60).create()
            out[attempt] = {role: registry.creation_method(role) for role in registry.role_names}
            registry.set_timeout(120, "cp")
            tensor = torch.tensor([float(rank)])
            registry.collectives("cp").all_reduce(tensor)
            out[f"{attempt}-sum"] = tensor.item()
            registry.close()
    out["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
                       for w in caught
                       if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    return out


def test_local_takes_the_member_only_path_and_warns_nothing(
        gloo_results: list[dict[str, Any]]) -> None:
    """4 gloo ranks, regular layout: local is kept; after close() again local where names never
    repeat (torch >= 2.14), else all_ranks (a reused name would hang); no deprecation warnings."""
    results = [result["local"] for result in gloo_results]
    again = "local" if NAMES_NEVER_REPEAT else "all_ranks"
    for rank, result in enumerate(results):
        assert set(result["first"].values()) == {"local"}, (rank, result["first"])
        assert set(result["again"].values()) == {again}, (rank, torch.__version__, result["again"])
        expected = float(sum(cg.plan(_regular()).group_of("cp", rank) or ()))
        assert result["first-sum"] == result["again-sum"] == expected
        assert result["warnings"] == [], result["warnings"]
