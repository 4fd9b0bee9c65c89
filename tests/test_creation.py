"""Creation paths on real gloo worlds (4 and 8 ranks) and the split decision with a mocked NCCL.

One spawned world runs every check of its size (worlds cost about a second of CPU per rank); the
workers return plain data and the assertions run in the parent against the pure plan.

Its tests that start processes are in ``tests/test_creation_world.py`` (marked ``world``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

import commgroups as cg
from commgroups.backends import BackendAdapter
from commgroups.backends.fake import FakeAdapter
from commgroups.backends.gloo import GlooAdapter
from commgroups.backends.hccl import HcclAdapter
from commgroups.backends.nccl import NcclAdapter
from commgroups.backends.rccl import RcclAdapter
from commgroups.backends.single_rank import SingleRankAdapter
from commgroups.creation import role_groups
from commgroups.creation.role_groups import (
    CreationContext,
    choose_method,
    create_role_group,
    creation_order,
    local_vote,
    nonmember_split_hazard,
    prefer_all_ranks,
)
from commgroups.torch_internals.version import torch_version
from tests import nccl_fakes

PATHS = ("all_ranks", "local", "auto")
UNBOUND = CreationContext(default_backend="gloo", device_bound=False)

# ------------------------------------------------------------------------------------ layouts


def _regular(world: int) -> cg.Layout:
    dims = {"dp_shard": 2, "cp": 2} if world == 4 else {"dp_shard": 2, "cp": 2, "tp": 2}
    return cg.Layout(dims=dims)  # built-in roles: one per dim, fsdp, checkpoint-metadata (gloo)


def _irregular(world: int) -> cg.Layout:
    """An explicit-ranks role that leaves ranks out, declared first, between regular roles."""
    return cg.Layout(
        dims={"dp_shard": world // 2, "cp": 2},
        roles=[
            cg.RoleSpec(name="embed", ranks=[[0, world - 1]]),
            cg.RoleSpec(name="cp", dims=["cp"]),
            cg.RoleSpec(name="pairs", ranks=[[0, 1], [2]]),  # uneven sizes
            cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
            cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo"),
        ],
    )


# ------------------------------------------------------------------------------ pure decisions


def test_auto_creates_on_every_rank_where_that_is_a_few_calls() -> None:
    """auto's last step: member-only candidates go all_ranks while they need at most 32 calls
    per rank together (no vote then), stay local above that (the calls grow with the world), and
    a role local by its backend (single-rank groups) always stays local; nothing changes on a
    device-bound default group."""
    gloo = GlooAdapter()
    for world, expected in ((8, "all_ranks"), (64, "all_ranks"), (128, "local")):
        plan = cg.plan(cg.Layout(dims={"dp_shard": world // 4, "cp": 4}))
        infos = {name: plan.role(name) for name in plan.role_names}
        methods = dict.fromkeys(infos, "local")
        # dp_shard x cp at 64 ranks: 4 + 16 + 1 + 1 = 22 calls; at 128: 4 + 32 + 1 + 1 = 38.
        chosen = prefer_all_ranks(methods, infos, dict.fromkeys(infos, gloo), UNBOUND)
        assert set(chosen.values()) == {expected}, (world, chosen)
    plan = cg.plan(cg.Layout(dims={"dp_shard": 2, "cp": 4}))
    infos = {name: plan.role(name) for name in plan.role_names}
    adapters: dict[str, BackendAdapter] = {**dict.fromkeys(infos, gloo), "cp": SingleRankAdapter()}
    methods = {**dict.fromkeys(infos, "local"), "dp_shard": "split"}
    assert prefer_all_ranks(methods, infos, adapters, UNBOUND) == {
        "dp_shard": "split", "cp": "local", "fsdp": "all_ranks", "checkpoint-metadata": "all_ranks"}
    assert prefer_all_ranks({"cp": "all_ranks"}, infos, adapters, UNBOUND) == {"cp": "all_ranks"}
    # A bound default group: a group every rank makes may hang its non-members (torch < 2.15).
    assert prefer_all_ranks(methods, infos, adapters, BOUND_NCCL) == methods


def test_single_rank_groups_alone_vote_without_the_store(fake_world: Any) -> None:
    """Where the only member-only groups are single-rank ones (a size-1 role; auto made every
    other group on every rank), nobody else computes their names and their backend keeps no
    rendezvous keys: the ballot needs no store request (this fake world's store would count
    none anyway; the 4-rank request count is tests/test_creation_world.py's), and it vetoes only
    where torch would refuse the name because a live group holds it (a rebuild makes its groups
    while the last generation's live)."""
    fake_world(4)
    layout = cg.Layout(dims={"dp_shard": 2, "cp": 2, "pp": 1}, roles=[
        cg.RoleSpec(name="dp_shard", dims=["dp_shard"]), cg.RoleSpec(name="cp", dims=["cp"]),
        cg.RoleSpec(name="pp", dims=["pp"]),
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")])
    plan = cg.plan(layout)
    order = creation_order(plan)
    methods = {"dp_shard": "all_ranks", "cp": "all_ranks", "pp": "local",
               "checkpoint-metadata": "all_ranks"}
    calls: list[str] = []

    class CountingStore:  # the fake world's store has no compare_set
        def compare_set(self, key: str, expected: str, desired: str) -> bytes:
            calls.append("compare_set")
            return b""

        def set(self, key: str, value: str) -> None:
            calls.append("set")

    real_default_store = role_groups.default_store
    role_groups.default_store = CountingStore  # type: ignore[assignment]
    try:
        ballot = local_vote(plan, order, methods, 0, 4, single={"pp"})
        assert ballot is not None and ballot.state == "single-rank" and not ballot.veto
        assert not calls  # no name history read or written
        # A live group by the name torch will give pp's group: torch would refuse it.
        planned = role_groups._planned_calls(plan, order, methods, 0)
        assert planned is not None
        names = role_groups.predict_group_names(planned[0], 4)
        assert names is not None
        pp_name = names[planned[1]["pp"]]
        real_live = role_groups.registered_group_names
        role_groups.registered_group_names = lambda: {pp_name}  # type: ignore[assignment]
        try:
            vetoed = local_vote(plan, order, methods, 0, 4, single={"pp"})
        finally:
            role_groups.registered_group_names = real_live  # type: ignore[assignment]
        assert vetoed is not None and vetoed.veto and not calls
        # With another member-only role the whole vote runs, the name history included.
        with_cp = {**methods, "cp": "local"}
        assert local_vote(plan, order, with_cp, 0, 4, single={"pp"}) is not None
        assert calls == ["compare_set", "set"]
    finally:
        role_groups.default_store = real_default_store  # type: ignore[assignment]


def test_creation_order_puts_irregular_roles_last() -> None:
    """Regular roles first, in layout order; irregular after."""
    assert [role.name for role in creation_order(cg.plan(_irregular(4)))] == [
        "cp", "fsdp", "checkpoint-metadata", "embed", "pairs"]
    # Split roles (a bound NCCL job) after the member-only ones, whose names torch must predict.
    methods = {"cp": "split", "fsdp": "split", "checkpoint-metadata": "local",
               "embed": "all_ranks", "pairs": "all_ranks"}
    assert [role.name for role in creation_order(cg.plan(_irregular(4)), methods)] == [
        "checkpoint-metadata", "cp", "fsdp", "embed", "pairs"]


def test_gloo_decisions() -> None:
    """CPU/gloo: local where regular, all_ranks otherwise; split never (no device binding)."""
    plan = cg.plan(_irregular(8))
    ctx = CreationContext(default_backend="gloo", device_bound=False)
    gloo = GlooAdapter()
    assert choose_method("auto", plan.role("cp"), gloo, ctx) == "local"
    assert choose_method("local", plan.role("cp"), gloo, ctx) == "local"
    assert choose_method("split", plan.role("cp"), gloo, ctx) == "all_ranks"
    assert choose_method("all_ranks", plan.role("cp"), gloo, ctx) == "all_ranks"
    assert choose_method("auto", plan.role("embed"), gloo, ctx) == "all_ranks"
    assert choose_method("local", plan.role("pairs"), FakeAdapter(), ctx) == "all_ranks"
    torchcomms = CreationContext(default_backend="gloo", device_bound=False,
                                 torchcomms=True)
    assert choose_method("auto", plan.role("cp"), gloo, torchcomms) == "all_ranks"
    with pytest.raises(ValueError, match="creation mode"):
        choose_method("fastest", plan.role("cp"), gloo, ctx)


def test_hccl_is_always_all_ranks_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """HCCL: member-only creation hangs, so every mode creates on all ranks, logged at INFO."""
    plan = cg.plan(_regular(4))
    ctx = CreationContext(default_backend="hccl", device_bound=True,
                          accelerator=True)
    with caplog.at_level(logging.INFO, logger="commgroups.creation.role_groups"):
        for mode in ("auto", "local", "split"):
            assert choose_method(mode, plan.role("cp"), HcclAdapter(), ctx) == "all_ranks"
    assert any("hccl" in r.getMessage() and "hangs" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)


# ---------------------------------------------------------------------------- mock NCCL (split)

BOUND_NCCL = CreationContext(default_backend="nccl", device_bound=True,
                             accelerator=True)


@pytest.mark.parametrize("adapter", [NcclAdapter(), RcclAdapter()], ids=["nccl", "rccl"])
def test_mock_nccl_split_decision(adapter: BackendAdapter) -> None:
    """Mock NCCL: split exactly when bound, same backend and an accelerator (every supported torch,
    2.10+, has a public split_group without the 2.6-2.7.1 device_id hang)."""
    plan = cg.plan(_irregular(8))
    assert choose_method("auto", plan.role("cp"), adapter, BOUND_NCCL) == "split"
    assert choose_method("split", plan.role("fsdp"), adapter, BOUND_NCCL) == "split"
    # Bound NCCL: non-members must join torch's comm split, so never local; and no split for
    # irregular roles.
    assert choose_method("local", plan.role("cp"), adapter, BOUND_NCCL) == "all_ranks"
    assert choose_method("auto", plan.role("embed"), adapter, BOUND_NCCL) == "all_ranks"
    # gloo groups do not split from the bound NCCL communicator: member-only creation is the safe
    # path (an all-ranks call sends only their non-members into torch's split: pytorch#145376)
    assert choose_method("auto", plan.role("cp"), GlooAdapter(), BOUND_NCCL) == "local"
    for changed in (
        {"default_backend": "cpu:gloo,cuda:nccl"},  # split would copy the gloo backend too
        {"accelerator": False},
    ):
        ctx = CreationContext(**{**BOUND_NCCL.__dict__, **changed})
        assert choose_method("auto", plan.role("cp"), adapter, ctx) == "all_ranks", changed
    unbound = CreationContext(**{**BOUND_NCCL.__dict__, "device_bound": False})
    assert choose_method("auto", plan.role("cp"), adapter, unbound) == "local"
    assert choose_method("split", plan.role("cp"), adapter, unbound) == "all_ranks"


def test_mock_nccl_split_creation_one_call_per_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mock NCCL: split makes one split_group call with every group, passing split_share.

    ``dist.ProcessGroupNCCL`` is a fake with the recorded attributes of the real class (newest
    recorded CUDA build, ``tests/nccl_fakes.py``): options it lacks could not be set."""
    calls: list[dict[str, Any]] = []
    sentinel = object()

    def fake_split_group(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return sentinel

    def forbidden_new_group(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("split creation must not call new_group")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_fakes.fake_class("ProcessGroupNCCL"),
                        raising=False)
    monkeypatch.setattr(dist, "split_group", fake_split_group)
    monkeypatch.setattr(dist, "new_group", forbidden_new_group)
    layout = cg.Layout(
        dims={"dp_shard": 4, "cp": 2},
        roles=[cg.RoleSpec(name="cp", dims=["cp"], backend="nccl", timeout_s=42,
                           options=cg.RoleOptions(nccl=cg.NcclOptions(split_share=True)))],
    )
    plan = cg.plan(layout)
    spec = layout.role("cp")
    created = create_role_group(plan, plan.role("cp"), NcclAdapter(), spec.options, spec.timeout_s, 5,
                                "split", "cp")
    assert created.method == "split" and created.group is sentinel and created.owned == [sentinel]
    assert len(calls) == 1
    call = calls[0]
    assert call["split_ranks"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert call["timeout"] == timedelta(seconds=42)
    assert call["pg_options"].config.split_share == 1
    assert call["group_desc"] == "cp"


def test_every_rank_creation_that_would_hang_on_a_bound_default_group_is_named() -> None:
    """Mock NCCL (a bound default group's context only): before torch 2.15 a gloo subgroup made by
    every rank sends its non-members into a split its members never make (pytorch#145376)."""
    plan = cg.plan(_irregular(8))
    cp, embed = plan.role("cp"), plan.role("embed")
    old_torch = torch_version()[:2] < (2, 15)
    hazard = nonmember_split_hazard(cp, GlooAdapter(), "all_ranks", BOUND_NCCL)
    assert (hazard is not None) == old_torch, hazard
    if hazard is not None:
        assert "'cp'" in hazard and "pytorch#145376" in hazard
    assert (nonmember_split_hazard(embed, GlooAdapter(), "all_ranks", BOUND_NCCL)
            is not None) == old_torch  # explicit rank groups: every rank makes them
    # Safe: member-only creation, members that split too, a world-spanning group, an unbound group.
    assert nonmember_split_hazard(cp, GlooAdapter(), "local", BOUND_NCCL) is None
    assert nonmember_split_hazard(cp, NcclAdapter(), "all_ranks", BOUND_NCCL) is None
    assert nonmember_split_hazard(plan.role("checkpoint-metadata"), GlooAdapter(), "all_ranks",
                                  BOUND_NCCL) is None
    unbound = CreationContext(**{**BOUND_NCCL.__dict__, "device_bound": False})
    assert nonmember_split_hazard(cp, GlooAdapter(), "all_ranks", unbound) is None
