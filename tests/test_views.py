"""Views: other factorizations of the same world (torchtitan's MoE mesh efsdp x ep over dp_shard x cp).

Its tests that start processes are in ``tests/test_views_world.py`` (marked ``world``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import commgroups as cg

# torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep) re-factorizes dp_shard x cp x tp.
MOE = cg.Layout(
    dims={"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1},
    views={"sparse": {"pp": 1, "dp_replicate": 1, "efsdp": 2, "ep": 2}},
    roles=[
        cg.RoleSpec(name="cp", dims=["cp"]),
        cg.RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
        cg.RoleSpec(name="ep", dims=["ep"]),
        cg.RoleSpec(name="efsdp", dims=["efsdp"]),
    ],
)


def _row_major_groups(sizes: dict[str, int], dims: list[str]) -> list[tuple[int, ...]]:
    """Reference: the groups of ``dims`` in a row-major grid, as torch's _unflatten makes them."""
    names = list(sizes)
    grid = np.arange(int(np.prod(list(sizes.values())))).reshape(list(sizes.values()))
    moved = np.moveaxis(grid, [names.index(d) for d in dims], range(len(names) - len(dims),
                                                                    len(names)))
    rows = moved.reshape(-1, int(np.prod([sizes[d] for d in dims])))
    return sorted(tuple(int(r) for r in row) for row in rows)


@pytest.mark.parametrize("view, dims", [
    ({"pp": 2, "efsdp": 4, "ep": 2}, ["ep"]),
    ({"pp": 2, "efsdp": 4, "ep": 2}, ["efsdp"]),
    ({"pp": 2, "efsdp": 2, "ep": 4}, ["pp", "ep"]),
    ({"pp": 2, "efsdp": 8, "ep": 1}, ["efsdp"]),
])
def test_view_roles_match_a_row_major_grid(view: dict[str, int], dims: list[str]) -> None:
    layout = cg.Layout(dims={"pp": 2, "dp_shard": 2, "cp": 2, "tp": 2}, views={"moe": view},
                       roles=[cg.RoleSpec(name="r", dims=dims)])
    plan = cg.plan(layout)
    assert sorted(plan.groups("r")) == _row_major_groups(view, dims)
    for rank in range(plan.world_size):
        mine = plan.group_of("r", rank)
        assert mine is not None and rank in mine
        assert plan.groups("r")[plan.group_index("r", rank) or 0] == mine


def test_per_rank_groups_of_the_moe_view() -> None:
    plan = cg.plan(MOE)
    # ep pairs neighbours, efsdp strides over them; cp and ep happen to coincide at this size.
    assert [plan.group_of("ep", r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [plan.group_of("efsdp", r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert plan.role("ep").factorization == "sparse"
    assert plan.role("fsdp").factorization == "dims"


def test_fingerprint_covers_views_and_keeps_old_layouts() -> None:
    plain = cg.Layout(dims=MOE.dims, roles=MOE.roles[:2])
    with_view = cg.Layout(dims=MOE.dims, roles=MOE.roles[:2], views=MOE.views)
    assert cg.plan(plain).fingerprint != cg.plan(with_view).fingerprint
    assert "views" not in cg.plan(plain).canonical()
    assert plain != with_view


@pytest.mark.parametrize("views, match", [
    ({"sparse": {"efsdp": 2, "ep": 3}}, "covers 6 ranks"),
    ({"sparse": {"cp": 4}}, "groups other ranks"),  # cp is size 2 in dims
    ({"dims": {"x": 4}}, "reserved name 'dims'"),
    ({"sparse": {}}, "has no dims"),
    ({"sparse": {"world": 4}}, "not allowed"),
    ({"sparse": {"efsdp": 4, "ep": 0}}, "size 0"),
])
def test_bad_views_name_the_field_and_fix(views: dict[str, Any], match: str) -> None:
    with pytest.raises(cg.errors.LayoutError, match=match) as info:
        cg.Layout(dims={"dp_shard": 2, "cp": 2}, views=views)
    assert "fix:" in str(info.value) and (info.value.field or "").startswith("views")


def test_a_role_takes_its_dims_from_one_factorization() -> None:
    with pytest.raises(cg.errors.LayoutError, match="no single factorization"):
        cg.Layout(dims=MOE.dims, views=MOE.views,
                  roles=[cg.RoleSpec(name="bad", dims=["dp_shard", "ep"])])
    with pytest.raises(cg.errors.LayoutError, match="out of layout order"):
        cg.Layout(dims=MOE.dims, views=MOE.views,
                  roles=[cg.RoleSpec(name="bad", dims=["ep", "efsdp"])])
    # A dim shared by name and meaning (pp) is usable with either factorization's dims.
    layout = cg.Layout(dims=MOE.dims, views=MOE.views,
                       roles=[cg.RoleSpec(name="pp_ep", dims=["pp", "ep"])])
    assert cg.plan(layout).role("pp_ep").factorization == "sparse"
