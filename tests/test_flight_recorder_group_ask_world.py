"""A hang in a small role's group asks only that group: on a 4-rank gloo world with cp groups of
2, the rank whose cp partner skipped an all_reduce names it behind, and the store shows one ask,
answered by the group's 2 members alone (the other group's publishers heard the ask event and
wrote nothing): the asker by its join, its partner by its status."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import commgroups as cg
from commgroups.flight_recorder.publisher import BLOCK_MEMBERS
from tests.worlds import run_world

pytestmark = pytest.mark.world

ASKER = 0


def _small_group_hang(rank: int, world_size: int) -> dict[str, Any]:
    roles = [cg.RoleSpec(name="cp", dims=["cp"], timeout_s=2),
             cg.RoleSpec(name="hold", dims=["dp", "cp"], timeout_s=60)]
    out: dict[str, Any] = {}
    with cg.GroupRegistry(cg.Layout(dims={"dp": 2, "cp": 2}, roles=roles)) as registry:
        session = registry.flight_recorder
        assert session is not None and session.publisher is not None
        publisher = session.publisher
        hold, cp = registry.collectives("hold"), registry.collectives("cp")
        group = session.recorder.ranks("cp")
        out["group"] = group
        tensor = torch.ones(4)
        cp.all_reduce(tensor)  # #1 on every rank
        hold.barrier()
        if rank == ASKER:
            try:
                cp.all_reduce(tensor)  # its partner skips it: a hang in a group of 2
            except cg.errors.RoleCollectiveError as error:
                out["cls"], out["flight"] = type(error).__name__, error.flight
            store, prefix = publisher.store, publisher.prefix
            out["asked"] = json.loads(store.get(f"{prefix}asked/1").decode())
            key = f"{prefix}{out['asked']['q']}"
            out["asks"] = int(store.add(f"{prefix}requests", 0))
            lines = store.get(f"{key}/answers").decode().splitlines()
            # a member at the asked call answers as it joins, with its bit in a join counter
            blocks = publisher.joined(key, len(group))
            joined = [group[block * BLOCK_MEMBERS + bit] for block, bits in enumerate(blocks)
                      for bit in range(BLOCK_MEMBERS) if bits >> bit & 1]
            out["count"] = len(lines) + len(joined)
            out["answered"] = sorted([*(int(line) if line.isdigit() else json.loads(line)["r"]
                                        for line in lines), *joined])
            out["joined"] = joined
        hold.barrier()
    return out


def test_a_hang_in_a_small_group_asks_only_its_members() -> None:
    results = run_world(_small_group_hang, 4, timeout=120)
    asker = results[ASKER]
    group = asker["group"]
    assert len(group) == 2 and ASKER in group, group
    (partner,) = [rank for rank in group if rank != ASKER]
    assert asker["cls"] in ("RoleHangError", "RoleCollectiveError"), asker
    assert asker["flight"]["behind"] == [partner], asker["flight"]
    assert asker["flight"]["silent"] == [] and len(asker["flight"]["ranks"]) == 1
    assert asker["asks"] == 1  # one ask for the call
    # the group's two members answered (the asker itself, its partner); the other group, which
    # heard the same event, wrote nothing
    assert asker["count"] == 2 and asker["answered"] == sorted(group), asker
    # the asker reached the call it asked about: its join was its answer; its partner, behind,
    # answered with its status
    assert asker["joined"] == [ASKER], asker
    assert asker["asked"]["r"] == "cp" and asker["asked"]["a"] == ASKER, asker["asked"]
    assert asker["asked"]["q"].startswith(f"ask/cp/{min(group)}/2-"), asker["asked"]
