"""The pure planner: partitions, canonical order, one-rank planning at scale, the fingerprint.

Its tests that start processes are in ``tests/test_plan_world.py`` (marked ``world``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import commgroups as cg
from commgroups.layout.specs import Layout, RoleSpec
from commgroups.planning.plan import plan
from tests.strategies import layouts

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_groups_partition_the_world(layout: cg.Layout) -> None:
    plan = cg.plan(layout)
    for role in plan.role_names:
        info = plan.role(role)
        groups = plan.rank_groups(role)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(plan.world_size))  # each rank in exactly one group
        assert all(len(g) == info.group_size for g in groups)
        assert len(groups) == info.num_groups == plan.world_size // info.group_size
        assert all(list(g) == sorted(g) for g in groups)  # new_group's rank order
        for index, group in enumerate(groups):
            for rank in group:
                assert plan.ranks_of(role, rank) == group
                assert plan.group_index(role, rank) == index


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_groups_match_device_mesh_rows(layout: cg.Layout) -> None:
    """A role over dims D groups the ranks that share every other coordinate (DeviceMesh's rule)."""
    plan = cg.plan(layout)
    grid = np.arange(plan.world_size).reshape(plan.dim_sizes)
    for role in plan.role_names:
        info = plan.role(role)
        assert info.dim_names is not None
        axes = [plan.dim_names.index(d) for d in info.dim_names]
        others = [i for i in range(grid.ndim) if i not in axes]
        rows = np.transpose(grid, others + axes).reshape(-1, info.group_size)
        assert [tuple(r) for r in rows.tolist()] == plan.rank_groups(role)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.data())
def test_fingerprint_is_stable_and_order_sensitive(layout: cg.Layout, data: st.DataObject) -> None:
    again = cg.Layout.model_validate(layout.model_dump())
    assert cg.plan(again).fingerprint == cg.plan(layout).fingerprint
    if len(layout.roles) > 1:
        swapped = [layout.roles[1], layout.roles[0], *layout.roles[2:]]
        assert cg.plan(cg.Layout(dims=layout.dims, roles=swapped)).fingerprint != cg.plan(
            layout).fingerprint
    if len(layout.dims) > 1:
        reordered = dict(reversed(list(layout.dims.items())))
        roles = [r for r in layout.roles if r.dims == "world"] or [
            cg.RoleSpec(name="all", dims="world")]
        a = cg.Layout(dims=layout.dims, roles=roles)
        b = cg.Layout(dims=reordered, roles=roles)
        assert cg.plan(a).fingerprint != cg.plan(b).fingerprint
    changed = layout.with_dims(**{next(iter(layout.dims)): next(iter(layout.dims.values())) + 1})
    assert cg.plan(changed).fingerprint != cg.plan(layout).fingerprint


def test_fingerprint_sees_options_backend_and_timeout() -> None:
    base = cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"])])
    variants = [
        cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"], backend="gloo")]),
        cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"], timeout_s=5)]),
        cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(
            name="cp", dims=["cp"], options={"nccl": {"high_priority_stream": True}})]),
        cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"], async_and_wait=False)]),
    ]
    prints = {cg.plan(v).fingerprint for v in [base, *variants]}
    assert len(prints) == 5


def test_seed_layout_plan() -> None:
    plan = cg.plan(cg.load_layout(LAYOUTS / "seed_cp4.toml"))
    assert plan.role_names == ("fsdp", "cp", "checkpoint-metadata")
    for role in plan.role_names:
        assert plan.rank_groups(role) == [(0, 1, 2, 3)]
        assert plan.role(role).spans_world
    assert plan.communicators_per_rank(2) == 3
    assert plan.coords(2) == {"dp_shard": 0, "cp": 2}


def test_explicit_rank_groups_are_irregular() -> None:
    layout = cg.Layout(dims={"pp": 4}, roles=[cg.RoleSpec(name="embed", ranks=[[3, 0]]),
                                              cg.RoleSpec(name="pp", dims=["pp"])])
    plan = cg.plan(layout)
    assert plan.rank_groups("embed") == [(0, 3)]
    assert plan.ranks_of("embed", 3) == (0, 3)
    assert plan.ranks_of("embed", 1) is None
    assert not plan.role("embed").regular and plan.role("pp").regular
    assert not plan.is_regular
    assert plan.communicators_per_rank(1) == 1


def test_one_rank_of_a_million_rank_layout() -> None:
    """One rank's groups come from its coordinates; nothing world-sized is materialised."""
    layout = cg.Layout(dims={"pp": 16, "dp_shard": 512, "cp": 8, "tp": 16})
    assert layout.world_size == 1_048_576
    plan = cg.plan(layout)
    rank = 777_777
    coords = plan.coords(rank)
    assert rank == sum(coords[d] * s for d, s in zip(plan.dim_names, plan.dim_strides))
    tp = plan.ranks_of("tp", rank)
    assert tp is not None and len(tp) == 16 and rank in tp
    assert tp == tuple(range(rank - rank % 16, rank - rank % 16 + 16))
    fsdp = plan.ranks_of("fsdp", rank)
    assert fsdp is not None and len(fsdp) == 512 * 8 and rank in fsdp
    assert np.all(np.diff(fsdp) > 0)
    assert all(plan.coords(r)["pp"] == coords["pp"] and plan.coords(r)["tp"] == coords["tp"]
               for r in fsdp[:: 97])
    assert plan.group_index("pp", rank) == rank % plan.role("pp").num_groups


@pytest.mark.parametrize("rank", [-1, 4])
def test_rank_out_of_range(rank: int) -> None:
    plan = cg.plan(cg.Layout(dims={"cp": 4}))
    with pytest.raises(ValueError, match="outside"):
        plan.ranks_of("cp", rank)


def test_cg_plan_is_the_function_and_shadows_no_module() -> None:
    # `cg.plan(layout)` is the public function; the module is commgroups.planning.plan, so importing a
    # submodule never rebinds the name (a module named plan would, depending on import order).
    import importlib

    import commgroups.planning.plan

    assert callable(cg.plan) and cg.plan is commgroups.planning.plan.plan
    assert importlib.util.find_spec("commgroups.plan") is None


def test_groups_and_group_of_are_the_old_names() -> None:
    """``rank_groups`` / ``ranks_of`` (rank tuples; a ProcessGroup is the registry's ``group``)."""
    assert cg.Plan.groups is cg.Plan.rank_groups
    assert cg.Plan.group_of is cg.Plan.ranks_of
    plan = cg.plan(cg.Layout(dims={"dp_shard": 2, "cp": 2}))
    assert plan.groups("cp") == plan.rank_groups("cp") == [(0, 1), (2, 3)]
    assert plan.group_of("dp_shard", 2) == plan.ranks_of("dp_shard", 2) == (0, 2)


def test_a_dim_group_is_planned_once_with_its_one_dim_spec() -> None:
    """dim_group plans each dim once per Plan (its RoleSpec is validated when made), for dims of
    ``dims`` and of views alike; its group size is the dim's size."""
    layout = Layout(dims={"pp": 2, "dp_shard": 2, "cp": 2}, views={"experts": {"ep": 4, "x": 2}})
    the_plan = plan(layout)
    for dim in the_plan.all_dim_names:
        made = the_plan.dim_group(dim)
        assert made.spec == RoleSpec(name=dim, dims=[dim])
        assert made.group_size == the_plan.dim_size(dim)
        assert the_plan.dim_group(dim) is made  # planned once
