"""The single-rank backend: a 1-rank group with no communicator gives a real 1-rank group's results.

Every check runs on real multi-process gloo worlds: each rank makes its own single-rank group and a
real 1-rank gloo group, runs the same collective on the same input on both, and compares outputs,
futures and Work behaviour side by side.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_single_rank.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups.backends.single_rank import (
    TORCH_BACKEND,
    SingleRankProcessGroup,
    ensure_registered,
)
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Case = Callable[[dist.ProcessGroup, bool, int], list[torch.Tensor]]


def new_single_rank_group(
    *, group_desc: str | None = None, timeout: timedelta | None = None,
) -> dist.ProcessGroup:
    """This rank's own 1-rank group on the single-rank backend; only this rank calls it.

    Member-only creation (``use_local_synchronization=True``) is exactly right for a 1-rank group:
    the other ranks neither call nor wait, nothing crosses the store, and on a default group bound to
    a device (``init_process_group(device_id=...)``) no rank joins a communicator split (torch
    2.10-2.14 make *non-members* of an all-ranks ``new_group`` split the default NCCL communicator,
    which hangs for any non-NCCL group; member-only creation has no non-members).

    Every rank must make the same number of member-only groups before the next all-ranks
    ``new_group``: torch >= 2.14 counts member-only groups in the names of later groups
    (``_world.group_count``), so give every rank its single-rank group for the same dims, in the same
    order (a registry does: a size-1 dim gives every rank one).

    Args:
        group_desc: the group's description (``pg.group_desc``), e.g. the role's name.
        timeout: recorded for torch's bookkeeping only; nothing here can time out.

    Returns:
        A :class:`SingleRankProcessGroup` over ``[dist.get_rank()]``, registered with torch like any
        other group (``dist.destroy_process_group(group)`` releases it).

    Raises:
        ValueError: torch's name for the group collides with a live group of this rank (torch
            <= 2.13 names member-only groups ``sha1(ranks + number of live groups)``, so destroying
            an older such group while a newer one lives can repeat a name; the message says so).

    The registry creates its single-rank groups on its own member-only path
    (``commgroups.creation.role_groups``); this is the same call, made directly, for these tests.
    """
    backend = ensure_registered()
    rank = dist.get_rank()
    try:
        # torch >= 2.14 types this ProcessGroup | NON_GROUP_MEMBER; the caller is its one member.
        group: dist.ProcessGroup = dist.new_group(  # type: ignore[assignment]
            [rank], timeout=timeout, backend=backend, use_local_synchronization=True,
            group_desc=group_desc,
        )
    except ValueError as error:
        if "already been created" not in str(error):
            raise
        raise ValueError(
            f"rank {rank}: torch named the new single-rank group like a live group of this rank "
            "(member-only names hash the ranks and the number of live groups, and a group "
            "destroyed before a newer one lowered that number); fix: destroy groups in reverse "
            "creation order, or create this group before destroying older ones"
        ) from error
    return group


def _x(rank: int, n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values per rank (and never the zeros an untouched output would hold)."""
    return (torch.arange(n) + 1 + 100 * rank).to(dtype)


def _run(work: Any, async_op: bool) -> list[torch.Tensor]:
    """Check the Work an op returned and give its future's tensors (empty when it has none)."""
    if not async_op:
        assert work is None
        return []
    if isinstance(work, torch_private.future_class()):  # all_reduce_coalesced / all_gather_coalesced
        work.wait()
        value = work.value()
    else:
        assert work.wait() is True
        try:
            value = work.get_future().value()
        except RuntimeError:  # gloo's reduce_scatter Work has no future
            return []
    flat = value if isinstance(value, list) else [value]
    return [t.clone() for t in flat if isinstance(t, torch.Tensor)]


def _all_reduce(op: Any, dtype: torch.dtype = torch.float32) -> Case:
    def case(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
        t = _x(r, dtype=dtype)
        return [t, *_run(dist.all_reduce(t, op=op, group=g, async_op=a), a)]
    return case


def _all_reduce_coalesced(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    ts = [_x(r), _x(r, 3) * 2]
    return [*ts, *_run(dist.all_reduce_coalesced(ts, group=g, async_op=a), a)]


def _all_gather(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = [torch.zeros(6)]
    return [*out, *_run(dist.all_gather(out, _x(r), group=g, async_op=a), a)]


def _all_gather_into_tensor(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = torch.zeros(2, 3)
    inp = _x(r).reshape(2, 3)
    return [out, *_run(dist.all_gather_into_tensor(out, inp, group=g, async_op=a), a)]


def _all_gather_coalesced(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    outs = [[torch.zeros(6), torch.zeros(3)]]
    work = dist.all_gather_coalesced(outs, [_x(r), _x(r, 3)], group=g, async_op=a)
    return [*outs[0], *_run(work, a)]


def _coalesced(collective: Callable[..., Any]) -> Case:
    """``collective(out, in)`` twice inside one coalescing manager."""
    def case(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
        outs = [torch.zeros(6), torch.zeros(3)]
        with torch_private.coalescing_manager(group=g, async_ops=a) as cm:
            for out, inp in zip(outs, [_x(r), _x(r, 3)]):
                collective(out, inp, group=g)
        if a:
            cm.wait()
        return outs
    return case


_all_gather_into_tensor_coalesced = _coalesced(dist.all_gather_into_tensor)


def _reduce_scatter(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = torch.zeros(6)
    return [out, *_run(dist.reduce_scatter(out, [_x(r)], group=g, async_op=a), a)]


def _reduce_scatter_tensor(op: Any) -> Case:
    def case(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
        out = torch.zeros(6)
        work = dist.reduce_scatter_tensor(out, _x(r), op=op, group=g, async_op=a)
        return [out, *_run(work, a)]
    return case


_reduce_scatter_tensor_coalesced = _coalesced(dist.reduce_scatter_tensor)


def _all_to_all(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = [torch.zeros(6)]
    return [*out, *_run(dist.all_to_all(out, [_x(r)], group=g, async_op=a), a)]


def _all_to_all_single(splits: bool) -> Case:
    def case(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
        out = torch.zeros(4, 2)
        inp = _x(r, 8).reshape(4, 2)
        sizes = [4] if splits else None
        work = dist.all_to_all_single(out, inp, sizes, sizes, group=g, async_op=a)
        return [out, *_run(work, a)]
    return case


def _broadcast(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    t = _x(r)
    return [t, *_run(dist.broadcast(t, group_src=0, group=g, async_op=a), a)]


def _reduce(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    t = _x(r)
    return [t, *_run(dist.reduce(t, group_dst=0, group=g, async_op=a), a)]


def _gather(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = [torch.zeros(6)]
    return [*out, *_run(dist.gather(_x(r), out, group_dst=0, group=g, async_op=a), a)]


def _scatter(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    out = torch.zeros(6)
    return [out, *_run(dist.scatter(out, [_x(r)], group_src=0, group=g, async_op=a), a)]


def _barrier(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    return _run(dist.barrier(group=g, async_op=a), a)


def _objects(g: dist.ProcessGroup, a: bool, r: int) -> list[torch.Tensor]:
    gathered: list[Any] = [None]
    dist.all_gather_object(gathered, {"rank": r}, group=g)
    sent = [[r, "x"]]
    dist.broadcast_object_list(sent, group_src=0, group=g)
    return [torch.tensor([gathered[0]["rank"], sent[0][0]])]


CASES: dict[str, Case] = {
    "all_reduce_sum": _all_reduce(dist.ReduceOp.SUM),
    "all_reduce_avg": _all_reduce(dist.ReduceOp.AVG),
    "all_reduce_max": _all_reduce(dist.ReduceOp.MAX),
    "all_reduce_min": _all_reduce(dist.ReduceOp.MIN),
    "all_reduce_product": _all_reduce(dist.ReduceOp.PRODUCT),
    "all_reduce_band": _all_reduce(dist.ReduceOp.BAND, torch.int64),
    "all_reduce_bor": _all_reduce(dist.ReduceOp.BOR, torch.int64),
    "all_reduce_bxor": _all_reduce(dist.ReduceOp.BXOR, torch.int64),
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_coalesced": _all_gather_coalesced,
    "all_gather_into_tensor_coalesced": _all_gather_into_tensor_coalesced,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor_sum": _reduce_scatter_tensor(dist.ReduceOp.SUM),
    "reduce_scatter_tensor_avg": _reduce_scatter_tensor(dist.ReduceOp.AVG),
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor_coalesced,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single(False),
    "all_to_all_single_splits": _all_to_all_single(True),
    "broadcast": _broadcast,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _barrier,
    "objects": _objects,
}


# What a 1-rank group must give where an older gloo lacks the op (torch 2.10: list all_to_all).
EXPECTED_WITHOUT_GLOO: dict[str, Callable[[int], list[torch.Tensor]]] = {
    "all_to_all": lambda r: [_x(r)],
}


def _own_gloo_group(rank: int, world: int) -> dist.ProcessGroup:
    """The real reference: this rank's 1-rank gloo group (every rank creates every one, in order)."""
    mine = None
    for r in range(world):
        group = dist.new_group([r], backend="gloo")
        if r == rank:
            mine = group
    assert mine is not None
    return mine


def _settle() -> None:
    # A world function with no collective on the default group can let a fast rank exit while a
    # slow one is still connecting gloo's full mesh in init_process_group ("closed by peer").
    dist.barrier()


def _errors(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as error:
        return type(error).__name__
    return None


def _compare_world(rank: int, world: int) -> dict[str, Any]:
    single = new_single_rank_group(group_desc="single")
    gloo = _own_gloo_group(rank, world)
    assert isinstance(single, SingleRankProcessGroup)
    mismatches: list[str] = []
    for name, case in CASES.items():
        for async_op in (False, True):
            got = case(single, async_op, rank)
            try:
                want = case(gloo, async_op, rank)
            except RuntimeError as error:
                if "does not support" not in str(error) or name not in EXPECTED_WITHOUT_GLOO:
                    raise
                want = EXPECTED_WITHOUT_GLOO[name](rank)
            # gloo's reduce_scatter Works carry no future: compare the outputs only there.
            got = got[: len(want)] if len(got) > len(want) else got
            if len(got) != len(want) or not all(
                g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
                for g, w in zip(got, want)
            ):
                mismatches.append(f"{name} async={async_op}: {got} != {want}")
    # PREMUL_SUM (FSDP2's gradient divide factor): gloo lacks it; NCCL scales by the factor.
    premul: list[bool] = []
    for factor in (0.25, torch.tensor(0.25)):
        t = _x(rank)
        dist.all_reduce(t, op=torch_private.premul_sum(factor), group=single)
        premul.append(torch.equal(t, _x(rank) * 0.25))
        out = torch.zeros(6)
        dist.reduce_scatter_tensor(out, _x(rank), op=torch_private.premul_sum(factor), group=single)
        premul.append(torch.equal(out, _x(rank) * 0.25))
    # Bad input fails on both, with the same exception type.
    bad = {
        "gather_size": lambda g: dist.all_gather_into_tensor(torch.zeros(5), _x(rank), group=g),
        "gather_dtype": lambda g: dist.all_gather_into_tensor(torch.zeros(6, dtype=torch.int64),
                                                              _x(rank), group=g),
        "a2a_splits": lambda g: dist.all_to_all_single(torch.zeros(4), _x(rank, 4), [3], [4], group=g),
    }
    # The single group's Works are finished when returned (no wait needed), futures too.
    t, out = _x(rank), torch.zeros(6)
    works = [
        dist.all_reduce(t, group=single, async_op=True),
        dist.all_gather_into_tensor(out, t, group=single, async_op=True),
        dist.reduce_scatter_tensor(out, t, group=single, async_op=True),
        dist.reduce_scatter(out, [t], group=single, async_op=True),
        dist.all_to_all_single(out, t, group=single, async_op=True),
        dist.broadcast(t, group_src=0, group=single, async_op=True),
        dist.barrier(group=single, async_op=True),
    ]
    premul.append(all(w.is_completed() and w.get_future().done() for w in works))
    # NCCL (unlike gloo) accepts a stacked output, (group size, *input shape): so do we.
    stacked = torch.zeros(1, 2, 3)
    dist.all_gather_into_tensor(stacked, _x(rank).reshape(2, 3), group=single)
    premul.append(torch.equal(stacked.reshape(-1), _x(rank)))
    bad_results = {k: (_errors(lambda f=f: f(single)), _errors(lambda f=f: f(gloo)))
                   for k, f in bad.items()}
    try:
        single.send([torch.zeros(1)], 0, 0)
        p2p = "no error"
    except RuntimeError as error:
        p2p = str(error)
    names = [None] * world
    dist.all_gather_object(names, single.group_name)
    info = {
        "backend": dist.get_backend(single),
        "name": single.name(),
        "size": single.size(),
        "rank": single.rank(),
        "ranks": dist.get_process_group_ranks(single),
        "desc": single.group_desc,
        "names": names,
    }
    dist.destroy_process_group(single)
    return {"mismatches": mismatches, "premul": premul, "bad": bad_results, "p2p": p2p, "info": info}


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_matches_a_real_one_rank_gloo_group(world: int) -> None:
    results = run_world(_compare_world, world)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}"
        assert all(res["premul"]), f"rank {rank}: PREMUL_SUM, stacked output or finished Works wrong"
        for op, (single_error, gloo_error) in res["bad"].items():
            assert single_error is not None and single_error == gloo_error, (op, single_error, gloo_error)
        assert "no other rank" in res["p2p"]
        info = res["info"]
        assert info["backend"] == TORCH_BACKEND and info["name"] == TORCH_BACKEND
        assert (info["size"], info["rank"], info["ranks"], info["desc"]) == (1, 0, [rank], "single")
    names = results[0]["info"]["names"]
    assert len(set(names)) == world, f"group names collide across ranks: {names}"


def _local_creation(rank: int, world: int) -> dict[str, Any]:
    store = torch_private.default_store()
    # Rank r creates and uses its group while every later rank is still blocked on the store: no
    # rank's creation can wait for another rank.
    if rank > 0:
        store.wait([f"done/{rank - 1}"])
    made = new_single_rank_group(group_desc="alone")
    t = _x(rank)
    out = torch.zeros(6)
    dist.all_gather_into_tensor(out, t, group=made)
    store.set(f"done/{rank}", "1")
    # Later all-ranks groups still get one name on every rank (each rank made one member-only
    # group: torch >= 2.14 counts those in the name of the next group, <= 2.13 in its salt).
    later = dist.new_group(list(range(world)), backend="gloo")
    total = torch.ones(1)
    dist.all_reduce(total, group=later)
    return {"ok": torch.equal(out, t), "later_sum": float(total), "later_name": later.group_name}


def _local_then_dtensor(rank: int, world: int) -> dict[str, Any]:
    # Independent checks share one 4-rank world; local creation first (it checks group naming).
    return {"local": _local_creation(rank, world), "dtensor": _dtensor_world(rank, world)}


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict[str, Any]]:
    return run_world(_local_then_dtensor, 4, timeout=240)  # two checks: twice the default


def test_creation_is_local_to_the_rank_and_later_groups_still_agree(
        four_rank_results: list[dict[str, Any]]) -> None:
    results = [result["local"] for result in four_rank_results]
    assert all(r["ok"] for r in results)
    assert [r["later_sum"] for r in results] == [4.0] * 4
    assert len({r["later_name"] for r in results}) == 1


def _recreate_after_destroying_an_older_group(rank: int, world: int) -> str:
    first = new_single_rank_group(group_desc="first")
    second = new_single_rank_group(group_desc="second")
    dist.destroy_process_group(first)
    try:
        third = new_single_rank_group(group_desc="third")
    except ValueError as error:  # torch <= 2.13 salts member-only names with the live-group count
        return str(error)
    finally:
        _settle()
    names = {second.group_name, third.group_name}
    return "distinct" if len(names) == 2 else "same name"


def test_a_name_collision_after_destroy_is_a_clear_error_or_does_not_happen() -> None:
    for outcome in run_world(_recreate_after_destroying_an_older_group, 2):
        assert outcome == "distinct" or ("fix:" in outcome and "destroy" in outcome), outcome


def _bound_default(rank: int, world: int) -> dict[str, Any]:
    # Mock of an NCCL default group bound with init_process_group(device_id=...): on a CPU machine
    # only the binding can be mocked. new_group then passes the bound device to the new group and
    # asks its backend for that device whether it can split.
    default = torch_private.default_group()
    default.bound_device_id = torch.device("cuda", 0)
    try:
        group = new_single_rank_group(group_desc="bound")
    finally:
        default.bound_device_id = None
    t = _x(rank)
    dist.all_reduce(t, group=group)
    _settle()
    return torch.equal(t, _x(rank))


def test_creation_with_a_device_bound_default_group_mocked_nccl_binding() -> None:
    assert run_world(_bound_default, 2) == [True, True]


def _dtensor_world(rank: int, world: int) -> dict[str, Any]:
    funcol = torch_private.functional_collectives()
    all_gather_tensor, all_reduce = funcol.all_gather_tensor, funcol.all_reduce
    all_to_all_single, reduce_scatter_tensor = funcol.all_to_all_single, funcol.reduce_scatter_tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    single = new_single_rank_group(group_desc="cp")
    gloo = _own_gloo_group(rank, world)
    dp = dist.new_group(list(range(world)), backend="gloo")
    results: dict[str, Any] = {"mismatches": []}

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            results["mismatches"].append(f"{name}: {got} != {want}")

    # Functional collectives, side by side.
    for name, fn in {
        "fc_all_gather": lambda g: all_gather_tensor(_x(rank).reshape(2, 3), 0, g),
        "fc_reduce_scatter": lambda g: reduce_scatter_tensor(_x(rank).reshape(2, 3), "sum", 0, g),
        "fc_all_reduce": lambda g: all_reduce(_x(rank), "avg", g),
        "fc_all_to_all": lambda g: all_to_all_single(_x(rank), [6], [6], g),
    }.items():
        same(name, fn(single).wait(), fn(gloo).wait())

    # DTensor on 2-D meshes (dp = real gloo over all ranks, cp = the 1-rank group), both dim orders.
    layouts = {
        "cp_inner": (lambda cp: [dp, cp], torch.arange(world).reshape(world, 1), ("dp", "cp")),
        "cp_outer": (lambda cp: [cp, dp], torch.arange(world).reshape(1, world), ("cp", "dp")),
    }
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for layout, (groups, mesh_ranks, names) in layouts.items():
        meshes = [DeviceMesh.from_group(groups(cp), "cpu", mesh=mesh_ranks, mesh_dim_names=names)
                  for cp in (single, gloo)]
        assert meshes[0].get_group("cp") is single
        cp_dim = names.index("cp")
        plans: list[tuple[list[Any], list[Any]]] = [
            ([Shard(0), Shard(1)], [Replicate(), Replicate()]),
            ([Shard(1), Shard(0)], [Shard(0), Replicate()]),
            ([Replicate(), Shard(1)], [Shard(1), Shard(0)]),
        ]
        for i, (src, dst) in enumerate(plans):
            outs = [distribute_tensor(full, m, src).redistribute(m, dst) for m in meshes]
            same(f"{layout}/plan{i}/local", outs[0].to_local(), outs[1].to_local())
            same(f"{layout}/plan{i}/full", outs[0].full_tensor(), outs[1].full_tensor())
        # Partial on the cp dim: the 1-rank reduction (all-reduce / reduce-scatter) of local data.
        partial = [Replicate(), Replicate()]
        partial[cp_dim] = Partial()
        for dst_cp in (Replicate(), Shard(0)):
            dst = [Replicate(), Replicate()]
            dst[cp_dim] = dst_cp
            outs = [distribute_tensor(full, m, [Replicate(), Replicate()]) for m in meshes]
            outs = [type(o).from_local(o.to_local() + rank, m, partial).redistribute(m, dst)
                    for o, m in zip(outs, meshes)]
            same(f"{layout}/partial->{dst_cp}", outs[0].to_local(), outs[1].to_local())
        sub = meshes[0]["cp"]
        results.setdefault("sub", []).append((sub.size(), sub.get_group() is single))
    return results


def test_functional_collectives_and_dtensor_on_a_2d_mesh_with_a_single_rank_dim(
        four_rank_results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(result["dtensor"] for result in four_rank_results):
        assert res["mismatches"] == [], f"rank {rank}"
        assert res["sub"] == [(1, True), (1, True)]


def _fsdp_world(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def train(mesh: DeviceMesh) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            data = torch.randn(8, 16, generator=torch.Generator().manual_seed(step + 10 * rank))
            loss = model(data).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    single = new_single_rank_group(group_desc="dp")
    gloo = _own_gloo_group(rank, world)
    shard = dist.new_group(list(range(world)), backend="gloo")
    hsdp_ranks = torch.arange(world).reshape(1, world)
    names = ("dp_replicate", "dp_shard")
    return {
        # FSDP2 on a 1-rank mesh (torch 2.13 skips its own collectives at shard size 1).
        "fsdp": [train(DeviceMesh.from_group(g, "cpu", mesh_dim_names=("dp_shard",)))
                 for g in (single, gloo)],
        # HSDP with a size-1 replicate dim: FSDP2 all-reduces (AVG) over the 1-rank group.
        "hsdp": [train(DeviceMesh.from_group([g, shard], "cpu", mesh=hsdp_ranks, mesh_dim_names=names))
                 for g in (single, gloo)],
    }


def test_fsdp2_on_a_one_rank_mesh_trains_like_a_one_rank_gloo_mesh() -> None:
    for res in run_world(_fsdp_world, 2):
        for kind in ("fsdp", "hsdp"):
            on_single, on_gloo = res[kind]
            assert on_single == on_gloo, kind
            assert len(set(on_single)) == 3, kind  # it trained: the loss moved every step


def _lifecycle(rank: int, world: int) -> dict[str, Any]:
    import gc
    import weakref

    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    refs = []
    names = []
    for i in range(20):
        group = new_single_rank_group(group_desc=f"g{i}")
        t = _x(rank)
        dist.all_gather_into_tensor(torch.zeros(6), t, group=group)
        refs.append(weakref.ref(group))
        names.append(group.group_name)
        dist.destroy_process_group(group)
        del group
    gc.collect()
    _settle()
    registered = set(torch_private.group_names().values())
    return {
        "alive": sum(ref() is not None for ref in refs),
        "registered": sum(name in registered for name in names),
        "fds": len(os.listdir("/proc/self/fd")) - fds_before,
        "threads": threading.active_count() - threads_before,
        "groups_left": len(torch_private.live_groups()),
    }


def test_destroy_process_group_releases_everything() -> None:
    for res in run_world(_lifecycle, 2):
        opened = res.pop("fds")
        assert opened <= 0, f"{opened} file descriptors left open"
        assert res == {"alive": 0, "registered": 0, "threads": 0, "groups_left": 1}


_REGISTRATION_SCRIPT = textwrap.dedent("""
    import json
    import torch.distributed as dist
    import commgroups.backends.single_rank as sr
    report = {"at_import": sr.TORCH_BACKEND in dist.Backend.backend_list}
    defaults = dict(dist.Backend.default_device_backend_map)
    # Pretend an accelerator without a default backend exists: registering must not claim it.
    sr.single_rank_device_types = lambda: ["cpu", "cuda", "hpu"]
    calls = []
    original = dist.Backend.register_backend
    dist.Backend.register_backend = lambda *a, **k: (calls.append(a[0]), original(*a, **k))
    first, second = sr.ensure_registered(), sr.ensure_registered()
    report.update(
        names=[first, second], calls=calls,
        capability=dist.Backend.backend_capability[sr.TORCH_BACKEND],
        defaults_unchanged=dict(dist.Backend.default_device_backend_map) == defaults,
        adapter=[sr.SingleRankAdapter().group_args(None, None).backend,
                 sr.SingleRankAdapter.supports_local_creation],
    )
    print(json.dumps(report))
""")


def test_registration_is_lazy_idempotent_and_claims_no_default_device() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _REGISTRATION_SCRIPT], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["at_import"] is False
    assert report["names"] == [TORCH_BACKEND, TORCH_BACKEND]
    assert report["calls"] == [TORCH_BACKEND]  # the second call registered nothing
    assert sorted(report["capability"]) == ["cpu", "cuda", "hpu"]
    assert report["defaults_unchanged"] is True
    assert report["adapter"] == [TORCH_BACKEND, True]


def _wrong_size(rank: int, world: int) -> str:
    from commgroups.backends.single_rank import ensure_registered

    try:
        dist.new_group(list(range(world)), backend=ensure_registered())
    except ValueError as error:
        return str(error)
    finally:
        _settle()
    return "no error"


def test_a_group_of_more_than_one_rank_is_refused_with_the_fix() -> None:
    for message in run_world(_wrong_size, 2):
        assert "exactly one rank" in message and "[0, 1]" in message and "fix:" in message
