"""The socket ledger on real gloo groups: each role's recorded sockets are the ones its group
opened, told apart by numbering alone (not the every-group fallback), on every creation path
(4 gloo ranks; run on each torch leg, since the count per group is gloo's); and a child forked
from a rank lets go of them, so the rank's death still reaches its peers at once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import torch_internals
from commgroups.creation.descriptor_table import table_size
from commgroups.creation.sockets import SUPPORTED, gloo_sockets, open_sockets
from tests.worlds import _gone, connected_barrier, explain, run_world

pytestmark = [pytest.mark.world,
              pytest.mark.skipif(not SUPPORTED, reason="needs /proc/self/fd (Linux)")]


def _recorded(rank: int, world: int, creation: str) -> dict[str, Any]:
    layout = cg.Layout(dims={"dp_shard": 2, "cp": 2})
    with cg.GroupRegistry(layout, creation_mode=creation, create_timeout_s=60) as registry:
        roles = registry._current.roles  # the generation the registry delegates to
        return {
            "sockets": {name: sorted(fd for fd, _ in made.sockets) for name, made in roles.items()},
            "sizes": {name: dist.get_world_size(registry.group(name)) for name in roles},
            "open": set(open_sockets()),
        }


@pytest.mark.parametrize("creation", ["local", "all_ranks"])
def test_each_role_records_the_sockets_its_group_opened(creation: str) -> None:
    for result in run_world(_recorded, 4, creation, timeout=120):
        sockets, sizes = result["sockets"], result["sizes"]
        # dp_shard and cp hold other members here: windows of their own, gloo's count each
        for role in ("dp_shard", "cp"):
            assert len(sockets[role]) == gloo_sockets(sizes[role]), (role, sockets)
        assert not set(sockets["dp_shard"]) & set(sockets["cp"])
        # fsdp and checkpoint-metadata both span the world: one window, shared
        world_roles = ("fsdp", cg.CHECKPOINT_ROLE)
        assert sockets["fsdp"] == sockets[cg.CHECKPOINT_ROLE]
        assert len(sockets["fsdp"]) == sum(gloo_sockets(sizes[role]) for role in world_roles)
        assert set().union(*map(set, sockets.values())) <= result["open"]


def _recorded_while_growing(rank: int, world: int) -> dict[str, Any]:
    # Descriptors held open up to 24 below the table's size (64 in a fresh process; a rank
    # forked from a process with more open keeps a larger one), so every rank's groups (34
    # descriptors) pass it during creation; no heartbeat, so every socket opened meanwhile is a
    # group's.
    size = table_size()
    assert size is not None
    padding = [os.open(os.devnull, os.O_RDONLY)
               for _ in range(size - 24 - len(os.listdir("/proc/self/fd")))]
    layout = cg.Layout(dims={"dp_shard": 2, "cp": world // 2})
    before = set(open_sockets().items())
    registry = cg.GroupRegistry(layout, create_timeout_s=60, heartbeat_s=None).create()
    now = set(open_sockets().items())
    opened = now - before
    recorded = {ref for made in registry._current.roles.values() for ref in made.sockets}
    # A recorded socket closed again by the time creation returned (seen once under load) was a
    # group's all the same, and a sever checks the inode before it touches a descriptor.
    closed_since = recorded - now
    result = {"grew": (table_size() or 0) > size, "missed": sorted(opened - recorded),
              "foreign": sorted(recorded - opened - closed_since),
              "closed_since": sorted(closed_since), "opened": len(opened) + len(closed_since)}
    registry.close()
    for fd in padding:
        os.close(fd)
    return result


def test_every_socket_is_recorded_while_the_descriptor_table_grows() -> None:
    # The table grows during creation (descriptor_table.grow_ahead, on a thread, before the
    # agreement). A descriptor that growth once held at the lowest free number could hide a
    # socket from the ledger (its group then never severed); a number taken at creation's own
    # highest could push the numbering out of order (the every-group fallback, which is safe).
    # Either way, every socket creation opened must be recorded, and nothing else.
    for result in run_world(_recorded_while_growing, 8, timeout=120):
        assert result["grew"], result
        assert result["missed"] == [] and result["foreign"] == [], result
        assert result["opened"] == 2 + 4 + 8 + 8, result  # gloo_sockets of each role's group


CHILD_ROLE_TIMEOUT_S = 20.0


def _killed_with_a_forked_child(rank: int, world_size: int) -> dict[str, Any]:
    layout = cg.Layout(dims={"cp": world_size}, roles=[
        cg.RoleSpec(name="cp", dims=["cp"], timeout_s=CHILD_ROLE_TIMEOUT_S),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo"),
    ])
    # No heartbeat: the peers' sockets are the only way the death can reach them.
    before = {link for _, link in open_sockets().items()}
    registry = cg.GroupRegistry(layout, create_timeout_s=60, heartbeat_s=None).create()
    cp = registry.collectives("cp")
    cp.all_reduce(torch.ones(4))
    recorded = {link for made in registry._current.roles.values() for _, link in made.sockets}
    # What torch's DataLoader does for each worker (num_workers > 0 on Linux, through
    # multiprocessing, which refuses to here: the test's ranks are daemonic): a forked process,
    # holding every descriptor the fork gave it, that outlives its rank for a while.
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    store = torch_internals.default_store()
    store.set(f"tests/child/{rank}", str(child))
    # For a failure's message: the sockets the victim had before creation, and those its
    # ledger recorded (its child lets go of these); any other socket the child still holds
    # kept the death from the peers, and so does a recorded one it did not let go of.
    store.set(f"tests/before/{rank}", " ".join(sorted(before)))
    store.set(f"tests/recorded/{rank}", " ".join(sorted(recorded)))
    victim = world_size - 1
    connected_barrier(registry, rank, world_size, victim=victim)  # the victim exits in there
    victims_child = int(store.get(f"tests/child/{victim}"))
    started = time.monotonic()
    try:
        cp.all_reduce(torch.ones(4))
        return {"error": None}
    except cg.errors.RoleCollectiveError as error:
        held = _sockets_of(victims_child) - set(store.get(f"tests/before/{victim}").decode().split())
        victims = set(store.get(f"tests/recorded/{victim}").decode().split())
        return {"timeout": isinstance(error, cg.errors.RoleTimeoutError),
                "seconds": time.monotonic() - started,
                "message": f"{error} (the victim's child holds, of the sockets the victim opened "
                           f"since before creation, recorded ones: {sorted(held & victims)}, "
                           f"unrecorded ones: {sorted(held - victims)}; it recorded "
                           f"{len(victims)})",
                "child_alive": not _gone(victims_child), "victims_child": victims_child}
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _sockets_of(pid: int) -> set[str]:
    """The sockets (``socket:[inode]``) process ``pid`` holds."""
    links = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone
        return set()
    for name in names:
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue
    return {link for link in links if link.startswith("socket:")}


def test_a_rank_killed_while_its_forked_child_lives_fails_its_peers_at_once() -> None:
    # Without the child letting go of the rank's gloo sockets, the peers' collective waited for
    # the child to exit (a DataLoader worker's watchdog: up to 5 s) or for the role timeout.
    results = run_world(_killed_with_a_forked_child, 4, timeout=120, expect_errors=True)
    for pid in {result["victims_child"] for result in results[:3]
                if isinstance(result, dict) and "victims_child" in result}:
        os.kill(pid, signal.SIGKILL)  # an orphan now: nobody else ends it
    for result in results[:3]:
        assert isinstance(result, dict), explain(results)
        assert result.get("error", "x") is not None, result  # raised, did not hang
        assert not result["timeout"], result["message"]  # the sockets closed: no timeout
        assert result["child_alive"], result  # while the victim's child still held its copies
        assert result["seconds"] < CHILD_ROLE_TIMEOUT_S / 2, result
