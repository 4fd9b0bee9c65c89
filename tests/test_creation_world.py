"""Creation paths on real gloo worlds (4 and 8 ranks) and the split decision with a mocked NCCL.

One spawned world runs every check of its size (worlds cost about a second of CPU per rank); the
workers return plain data and the assertions run in the parent against the pure plan.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_creation.py``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups.registry import GroupRegistry
from commgroups.torch_internals.version import torch_version
from tests.test_creation import _irregular, _regular
from tests.worlds import run_world

pytestmark = pytest.mark.world

TORCH = torch_version()


# ------------------------------------------------------------------------------------ workers


def _exercise(registry: GroupRegistry, rank: int) -> dict[str, Any]:
    """Per role: method, ranks, an all_reduce of the global ranks, and default-group aliasing."""
    roles: dict[str, Any] = {}
    for role in registry.role_names:
        if registry.plan.group_of(role, rank) is None:
            roles[role] = {"method": registry.creation_method(role), "member": False}
            continue
        group = registry.group(role)
        tensor = torch.tensor([float(rank)])
        dist.all_reduce(tensor, group=group)
        roles[role] = {
            "method": registry.creation_method(role),
            "member": True,
            "ranks": tuple(dist.get_process_group_ranks(group)),
            "registry_ranks": registry.ranks(role),
            "sum": tensor.item(),
            "is_default": group is dist.group.WORLD,
        }
    return roles


def paths_worker(rank: int, world: int, runs: list[tuple[str, str, str, bool]]) -> dict[str, Any]:
    """Per (label, layout kind, mode, keep): create, time and exercise a registry.

    Kept registries stay alive until every run is done (so later ones start at other group counts);
    the others are closed at once.
    """
    out: dict[str, Any] = {}
    kept: list[GroupRegistry] = []
    for label, kind, mode, keep in runs:
        if label == "close-kept":
            for registry in reversed(kept):
                registry.close()
            kept.clear()
            continue
        layout = _regular(world) if kind == "regular" else _irregular(world)
        registry = GroupRegistry(layout, creation_mode=mode, create_timeout_s=60).create()
        out[label] = {"roles": _exercise(registry, rank), "describe": registry.describe()}
        if keep:
            kept.append(registry)
        else:
            registry.close()
    for registry in kept:
        registry.close()
    return out


def mesh_worker(rank: int, world: int) -> dict[str, Any]:
    """A mesh dim without a role of its own gets a dedicated group (via the checked local path)."""
    layout = cg.Layout(dims={"dp_shard": 2, "cp": 2},
                       roles=[cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"])])
    # "local": on 4 ranks auto would make these few groups on every rank (prefer_all_ranks).
    with GroupRegistry(layout, creation_mode="local", create_timeout_s=60,
                       meshes=[["dp_shard", "cp"]]) as registry:
        mesh = registry.device_mesh(["dp_shard", "cp"])
        groups = [mesh.get_group(dim) for dim in ("dp_shard", "cp")]
        sums = []
        for group in groups:
            tensor = torch.tensor([float(rank)])
            dist.all_reduce(tensor, group=group)
            sums.append(tensor.item())
        return {
            "ranks": [tuple(dist.get_process_group_ranks(g)) for g in groups],
            "sums": sums,
            "default": [g is dist.group.WORLD for g in groups],
            "methods": {dim: c.method for dim, c in registry._current.dim_groups.items()},
        }


# ------------------------------------------------------------------------------------ checks


def _check(layout: cg.Layout, rank: int, roles: dict[str, Any]) -> None:
    plan = cg.plan(layout)
    for role in plan.role_names:
        expected = plan.group_of(role, rank)
        got = roles[role]
        if expected is None:
            assert not got["member"], (role, rank)
            continue
        assert got["ranks"] == expected == got["registry_ranks"], (role, rank)
        assert got["sum"] == float(sum(expected)), (role, rank)
        assert not got["is_default"], (role, rank)


def _methods(roles: dict[str, Any]) -> dict[str, str]:
    return {role: info["method"] for role, info in roles.items()}


RUNS: list[tuple[str, str, str, bool]] = [
    ("warm-up", "regular", "all_ranks", False),  # first connections cost extra: keep them out
    ("all_ranks", "regular", "all_ranks", True),
    ("local", "regular", "local", True),
    ("auto", "regular", "auto", True),
    # Explicit-ranks roles leave group counts uneven across ranks: they fall back and go last.
    ("irregular-local", "irregular", "local", True),
    # Before torch 2.14 the name salt (groups registered) now differs between ranks (members of the
    # irregular groups have more): local would hang. From 2.14 the salt counts every new_group call,
    # the same on every rank, so local is safe (torch's own naming code says so, see local_vote).
    ("after-irregular", "regular", "local", True),
    ("close-kept", "", "", False),
    ("local-fresh", "regular", "local", False),
    # The same groups again right after destroying them: before torch 2.14 local would reuse their
    # hashed names (stale rendezvous keys: a hang); from 2.14 names never repeat, so local is safe.
    ("local-again", "regular", "local", False),
]


@pytest.mark.parametrize("world", [4, 8])
def test_every_path_creates_correct_groups(world: int) -> None:
    """all_ranks, local and auto give the planned groups; unsafe local falls back, never hangs."""
    results = run_world(paths_worker, world, RUNS, timeout=180)
    # torch >= 2.14 salts hashed names with a counter of every new_group call (never repeats).
    repeat = "local" if TORCH >= (2, 14, 0) else "all_ranks"
    regular, irregular = _regular(world), _irregular(world)
    labels = [label for label, _, _, _ in RUNS if label != "close-kept"]
    for rank, result in enumerate(results):
        for label, kind, _, _ in RUNS:
            if label in labels:
                _check(regular if kind == "regular" else irregular, rank, result[label]["roles"])
        assert set(_methods(result["all_ranks"]["roles"]).values()) == {"all_ranks"}
        assert set(_methods(result["local"]["roles"]).values()) == {"local"}
        # gloo: no split; 4 and 8 ranks: a few all-ranks calls cost less than the local vote.
        assert set(_methods(result["auto"]["roles"]).values()) == {"all_ranks"}
        assert _methods(result["irregular-local"]["roles"]) == {
            "embed": "all_ranks", "cp": "local", "pairs": "all_ranks", "fsdp": "local",
            "checkpoint-metadata": "local",
        }
        assert set(_methods(result["after-irregular"]["roles"]).values()) == {repeat}
        assert set(_methods(result["local-fresh"]["roles"]).values()) == {"local"}
        assert set(_methods(result["local-again"]["roles"]).values()) == {repeat}
    assert "local" in results[0]["local"]["describe"]


def test_mesh_dim_groups_are_dedicated() -> None:
    """device_mesh over dims without roles: dedicated groups, made member-only after the check."""
    results = run_world(mesh_worker, 4, timeout=120)
    plan = cg.plan(cg.Layout(dims={"dp_shard": 2, "cp": 2}))
    for rank, result in enumerate(results):
        expected = [plan.group_of(dim, rank) for dim in ("dp_shard", "cp")]
        assert result["ranks"] == expected
        assert result["sums"] == [float(sum(g or ())) for g in expected]
        assert result["default"] == [False, False]
        assert set(result["methods"].values()) == {"local"}


class _CountingStore(dist.Store):  # type: ignore[misc]  # torch's stubs re-export Store loosely
    """The job's store, forwarding every call and counting those of the thread that made it
    (commgroups' own calls only: torch's group rendezvous reads the store it was given at init,
    not this one; the background threads' calls come whenever they run)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self._owner = threading.get_ident()

    def _forward(self, name: str, *args: Any) -> Any:
        if threading.get_ident() == self._owner:
            self.calls += 1
        return getattr(self.inner, name)(*args)

    def set(self, key: str, value: Any) -> None:
        self._forward("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._forward("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._forward("add", key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._forward("compare_set", key, expected, desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._forward("wait", keys, *([] if timeout is None else [timeout]))

    def check(self, keys: list[str]) -> bool:
        return bool(self._forward("check", keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return list(self._forward("multi_get", keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._forward("delete_key", key))


def store_calls_worker(rank: int, world: int) -> list[int]:
    import commgroups.creation.role_groups as creation
    from commgroups import torch_internals

    counting = _CountingStore(torch_internals.default_store())
    creation.default_store = lambda: counting  # type: ignore[assignment]
    torch_internals.default_store = lambda: counting  # type: ignore[assignment]
    calls = []
    # auto with a size-1 dim: every real group all_ranks (few calls), the dim's single-rank group
    # member-only by its backend.
    with_size_one = cg.Layout(dims={**_regular(world).dims, "pp": 1})
    for layout, mode in ((_regular(world), "local"), (_regular(world), "all_ranks"),
                         (with_size_one, "auto")):
        counting.calls = 0
        registry = GroupRegistry(layout, creation_mode=mode, create_timeout_s=60).create()
        calls.append(counting.calls)
        dist.barrier()  # every rank created: closing waits for nobody
        registry.close()
    return calls


def test_creation_costs_each_rank_a_fixed_number_of_store_calls() -> None:
    """The registry's own round trips, O(1) per rank whatever the world: open the attempt (1),
    local creation's name history (2), the agreement (5: compare with the first rank in, record
    presence, count in, then wait for and read the verdict, or, the last rank in, end the attempt
    and publish the verdict) and the note that this rank is done (1). The first rank in also
    publishes its payload (1); the last to note says every rank is done (1). The note is the
    starter thread's where a heartbeat starts (not here: the counting store is not a TCPStore),
    and so is the flight recorder's first status."""
    calls = run_world(store_calls_worker, 4)
    local, every_rank, size_one = ([c[0] for c in calls], [c[1] for c in calls],
                                   [c[2] for c in calls])
    assert min(local) == 9 and sum(local) == 4 * 9 + 1 + 1, local
    # Without member-only roles there is no name history to read and extend.
    assert min(every_rank) == 7 and sum(every_rank) == 4 * 7 + 1 + 1, every_rank
    # Nor for single-rank groups (size-1 dims): nobody else names them (it was 9 a rank).
    assert min(size_one) == 7 and sum(size_one) == 4 * 7 + 1 + 1, size_one


def _descriptors_worker(rank: int, world_size: int) -> tuple[int, int, dict[str, Any]]:
    import contextlib
    import os

    from commgroups.generation import make

    asked: list[int] = []
    grow = make.grow_ahead

    def recorded(extra: int) -> int | None:
        asked.append(extra)
        return grow(extra)

    make.grow_ahead = recorded  # this rank's process only

    def listed() -> set[tuple[int, str]]:
        # (number, target): a number another thread freed during creation and a group's
        # descriptor then took counts as new
        found = set()
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                found.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        return found

    before = listed()
    registry = GroupRegistry(cg.Layout(dims={"dp_shard": 2, "cp": 2}), heartbeat_s=None).create()
    after = listed()
    # A socket the groups opened, recorded by creation's ledger, and closed again by the time
    # creation returned (seen once under load) was opened all the same.
    closed_since = {ref for made in registry._current.roles.values() for ref in made.sockets
                    if ref not in after}
    registry.close()
    detail = {"new": sorted(after - before), "gone": sorted(before - after),
              "closed_since": sorted(closed_since)}
    return asked[0], len(after - before) + len(closed_since), detail


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc: not Linux")
def test_creation_grows_the_descriptor_table_for_as_many_descriptors_as_its_groups_open() -> None:
    # The count handed to grow_ahead before the agreement (descriptor_table: a growth inside a
    # group's connect held every peer for an RCU grace period) is what the gloo groups open:
    # a torch whose gloo opens more would grow the table inside creation again.
    for predicted, opened, detail in run_world(_descriptors_worker, 4):
        assert predicted == opened == (2 + 3) * 2 + (4 + 3) * 2, (predicted, opened, detail)
