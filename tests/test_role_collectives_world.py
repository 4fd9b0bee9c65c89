"""registry.collectives(role): every method matches the raw torch.distributed call (real gloo, 4 ranks),
and every call it makes reaches c10d as async_op=True (unless the role turns async_and_wait off).

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_role_collectives.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests.gloo_support import NO_ALL_TO_ALL, all_to_all_or_note
from tests.worlds import run_world

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

pytestmark = pytest.mark.world


SEED = str(LAYOUTS / "seed_cp4.toml")


class _Raw:
    """Plain torch.distributed bound to one group: the reference every wrapper call is checked against."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name == "p2p_op":
            return lambda op, tensor, peer=None, tag=0: dist.P2POp(op, tensor, peer, self.group, tag)
        if name == "batch_isend_irecv":
            return dist.batch_isend_irecv
        return functools.partial(getattr(dist, name), group=self.group)


def _exercise(api: Any, rank: int, world: int) -> dict[str, Any]:
    """Call every method of the torch.distributed API (without group=) and return the results."""
    out: dict[str, Any] = {}
    base = torch.arange(4, dtype=torch.float32) + 10 * rank

    t = base.clone()
    api.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = base.clone()
    api.all_reduce(t, dist.ReduceOp.MAX)
    out["all_reduce_max"] = t.tolist()

    t = base.clone()
    api.broadcast(t, src=2)
    out["broadcast"] = t.tolist()
    t = base.clone()
    api.broadcast(t, group_src=1)
    out["broadcast_group_src"] = t.tolist()

    t = base.clone()
    api.reduce(t, dst=3)
    out["reduce"] = t.tolist() if rank == 3 else None

    gathered = [torch.empty(4) for _ in range(world)]
    api.all_gather(gathered, base)
    out["all_gather"] = [g.tolist() for g in gathered]

    flat = torch.empty(4 * world)
    api.all_gather_into_tensor(flat, base)
    out["all_gather_into_tensor"] = flat.tolist()

    rs = torch.empty(4)
    api.reduce_scatter(rs, [base + i for i in range(world)])
    out["reduce_scatter"] = rs.tolist()
    rst = torch.empty(2)
    api.reduce_scatter_tensor(rst, torch.arange(2.0 * world) * (rank + 1))
    out["reduce_scatter_tensor"] = rst.tolist()

    def all_to_all() -> list[list[float]]:
        a2a = [torch.empty(2) for _ in range(world)]
        api.all_to_all(a2a, [torch.full((2,), 100.0 * rank + j) for j in range(world)])
        return [x.tolist() for x in a2a]

    out["all_to_all"] = all_to_all_or_note(all_to_all)
    in_splits = [1 + (rank + j) % 2 for j in range(world)]
    out_splits = [1 + (j + rank) % 2 for j in range(world)]
    single = torch.empty(sum(out_splits))
    api.all_to_all_single(single, torch.arange(float(sum(in_splits))) + 100 * rank,
                          output_split_sizes=out_splits, input_split_sizes=in_splits)
    out["all_to_all_single"] = single.tolist()

    gather_list = [torch.empty(4) for _ in range(world)] if rank == 1 else None
    api.gather(base, gather_list=gather_list, dst=1)
    out["gather"] = [g.tolist() for g in gather_list] if gather_list else None

    scattered = torch.empty(4)
    scatter_list = [torch.full((4,), float(j)) for j in range(world)] if rank == 0 else None
    api.scatter(scattered, scatter_list=scatter_list, src=0)
    out["scatter"] = scattered.tolist()

    api.barrier()

    # point to point: 0 <-> 1 and 2 <-> 3
    peer = rank ^ 1
    box = torch.empty(4)
    if rank % 2 == 0:
        api.send(base, dst=peer)
        out["recv_from"] = None
    else:
        out["recv_from"] = api.recv(box)  # any source: the sender's global rank comes back
        out["recv"] = box.tolist()
    box = torch.empty(4)
    work = api.isend(base, dst=peer) if rank % 2 else api.irecv(box, src=peer)
    work.wait()
    out["irecv"] = box.tolist() if rank % 2 == 0 else None
    ring = torch.empty(4)
    works = api.batch_isend_irecv([
        api.p2p_op(dist.isend, base, (rank + 1) % world),
        api.p2p_op(dist.irecv, ring, (rank - 1) % world),
    ])
    for w in works:
        w.wait()
    out["batch_isend_irecv"] = ring.tolist()

    # async_op=True: the caller's Work, unwaited
    t = base.clone()
    work = api.all_reduce(t, async_op=True)
    out["async_work_type"] = type(work).__name__
    work.wait()
    out["async_all_reduce"] = t.tolist()

    objects: list[Any] = [None] * world
    api.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    gathered_objects: list[Any] | None = [None] * world if rank == 2 else None
    api.gather_object(("r", rank), gathered_objects, dst=2)
    out["gather_object"] = gathered_objects
    bcast: list[Any] = [f"from {rank}", rank]
    api.broadcast_object_list(bcast, src=3)
    out["broadcast_object_list"] = bcast
    scatter_out: list[Any] = [None]
    api.scatter_object_list(scatter_out, [f"to {j}" for j in range(world)] if rank == 1 else None,
                            src=1)
    out["scatter_object_list"] = scatter_out
    if rank % 2 == 0:
        api.send_object_list([{"p2p": rank}], dst=peer)
    else:
        received: list[Any] = [None]
        out["recv_object_list_src"] = api.recv_object_list(received, src=peer)
        out["recv_object_list"] = received
    return out


def _collectives_world(rank: int, world: int) -> dict[str, Any]:
    registry = cg.GroupRegistry(cg.load_layout(SEED)).create()
    try:
        group = registry.group("cp")
        raw = _exercise(_Raw(group), rank, world)
        result: dict[str, Any] = {"raw": raw, "cp_group": group.group_name}
        variants = {
            "async_and_wait": registry.collectives("cp"),
            "no_async_and_wait": cg.RoleCollectives(group, role="cp", async_and_wait=False),
        }
        for name, api in variants.items():
            with cg.audit.record(registry) as rec:
                got = _exercise(api, rank, world)
            result[name] = got
            result[name + "_calls"] = [(r.op, r.group, r.async_op) for r in rec.records]
        # a P2POp on the default group is refused before anything is issued
        try:
            registry.collectives("cp").batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 0)])
        except ValueError as error:
            result["batch_error"] = str(error)
        result["repr"] = repr(registry.collectives("fsdp"))
        result["size_rank"] = (registry.collectives("cp").size, registry.collectives("cp").rank)
        return result
    finally:
        registry.close()


@pytest.fixture(scope="module")
def world_results() -> list[dict[str, Any]]:
    """One 4-rank gloo world for every check in this file."""
    return run_world(_collectives_world, 4)


def test_every_method_matches_the_raw_call(world_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world_results):
        raw = result["raw"]
        assert raw["all_reduce"] == [60.0, 64.0, 68.0, 72.0]  # the reference itself is right
        for variant in ("async_and_wait", "no_async_and_wait"):
            got = result[variant]
            assert got.keys() == raw.keys(), (rank, variant)
            for key in raw:
                assert got[key] == raw[key], (rank, variant, key)


def test_results_are_what_torch_documents(world_results: list[dict[str, Any]]) -> None:
    # spot checks that the exercise really moved data (so equality with raw means something)
    r0, r1, r3 = world_results[0]["async_and_wait"], world_results[1]["async_and_wait"], world_results[3]
    assert r0["broadcast"] == [20.0, 21.0, 22.0, 23.0]
    assert r0["broadcast_group_src"] == [10.0, 11.0, 12.0, 13.0]
    assert r3["async_and_wait"]["reduce"] == [60.0, 64.0, 68.0, 72.0]
    assert r0["all_gather"][3] == [30.0, 31.0, 32.0, 33.0]
    assert r1["recv_from"] == 0 and r1["recv"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["irecv"] == [10.0, 11.0, 12.0, 13.0]
    assert r0["batch_isend_irecv"] == [30.0, 31.0, 32.0, 33.0]
    assert r0["async_work_type"] == "Work"
    assert r0["all_gather_object"] == [{"rank": r} for r in range(4)]
    assert world_results[2]["async_and_wait"]["gather_object"] == [("r", r) for r in range(4)]
    assert r0["broadcast_object_list"] == ["from 3", 3]
    assert r0["scatter_object_list"] == ["to 0"]
    assert r1["recv_object_list"] == [{"p2p": 0}] and r1["recv_object_list_src"] == 0


def test_all_to_all_moves_data(world_results: list[dict[str, Any]]) -> None:
    got = world_results[1]["async_and_wait"]["all_to_all"]
    if got == NO_ALL_TO_ALL:
        pytest.skip(f"torch {torch.__version__}: {NO_ALL_TO_ALL}")
    assert got == [[100.0 * j + 1] * 2 for j in range(4)]


def test_async_and_wait_issues_everything_async_on_the_role_group(
    world_results: list[dict[str, Any]],
) -> None:
    for result in world_results:
        calls = result["async_and_wait_calls"]
        assert len(calls) > 20
        # every call ran on the dedicated cp group, object collectives' inner calls included
        assert {group for _, group, _ in calls} == {result["cp_group"]}
        blocking = [op for op, _, async_op in calls if async_op is False]
        assert blocking == [], blocking
        assert sum(async_op is True for _, _, async_op in calls) > 20


def test_without_async_and_wait_calls_pass_through_blocking(world_results: list[dict[str, Any]]) -> None:
    # the observation can see blocking calls: with async-and-wait off they show up
    for result in world_results:
        blocking = [op for op, _, async_op in result["no_async_and_wait_calls"] if async_op is False]
        assert len(blocking) > 20, blocking  # the exercise's collectives, issued as asked


def test_misuse_is_named(world_results: list[dict[str, Any]]) -> None:
    result = world_results[0]
    assert "default group" in result["batch_error"] and "p2p_op" in result["batch_error"]
    assert "role='fsdp'" in result["repr"] and "async_and_wait=True" in result["repr"]
    assert result["size_rank"] == (4, 0)
