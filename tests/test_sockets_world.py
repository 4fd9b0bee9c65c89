"""The socket ledger on real gloo groups: each role's recorded sockets are the ones its group
opened, told apart by numbering alone (not the every-group fallback), on every creation path
(4 gloo ranks; run on each torch leg, since the count per group is gloo's)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed as dist

import commgroups as cg
from commgroups.creation.descriptor_table import table_size
from commgroups.creation.sockets import SUPPORTED, gloo_sockets, open_sockets
from tests.worlds import run_world

pytestmark = [pytest.mark.world,
              pytest.mark.skipif(not SUPPORTED, reason="needs /proc/self/fd (Linux)")]


def _recorded(rank: int, world: int, creation: str) -> dict[str, Any]:
    layout = cg.Layout(dims={"dp_shard": 2, "cp": world // 2})
    # 8 ranks: descriptors up to 39 held open, so every rank's groups pass 64 in creation.
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(40 - len(os.listdir("/proc/self/fd")))
               ] if world == 8 else []
    size = table_size()
    with cg.GroupRegistry(layout, creation_mode=creation, create_timeout_s=60) as registry:
        roles = registry._current.roles  # the generation the registry delegates to
        return {
            "sockets": {name: sorted(fd for fd, _ in made.sockets) for name, made in roles.items()},
            "sizes": {name: dist.get_world_size(registry.group(name)) for name in roles},
            "open": set(open_sockets()),
            "table": (size, table_size()),
            "padding": [os.close(fd) for fd in padding],
        }


@pytest.mark.parametrize(("creation", "world"), [("local", 4), ("all_ranks", 4), ("auto", 8)])
def test_each_role_records_the_sockets_its_group_opened(creation: str, world: int) -> None:
    # 8 ranks: the groups take each rank's fresh process past 64 descriptors (padded), so the
    # table grows during creation (descriptor_table.grow_ahead, on a thread, before the agreement);
    # a descriptor that growth held at the lowest free number once hid a socket from the ledger.
    results = run_world(_recorded, world, creation, timeout=120)
    if world == 8:
        assert all(result["table"] == (64, 128) for result in results), results
    for result in results:
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
