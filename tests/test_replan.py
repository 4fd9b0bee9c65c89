"""Replanning after a rank loss (pure, no torch.distributed): which layout the survivors form.

Independent oracle: the new layout's plan, read through ``Replan.ranks``, must group the survivors
exactly as the old plan did (every role re-derived from the same rules), and every placed rank must be
alive. Random layouts and losses (hypothesis), the issue's examples, and one node lost out of
65,536 simulated ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import commgroups as cg
from commgroups.errors import ReplanError

HSDP = {"dp_replicate": 2, "dp_shard": 2}


def test_losing_a_rank_drops_its_replica() -> None:
    layout = cg.Layout(dims=HSDP, elastic={"dims": {"dp_replicate": 1}})
    result = cg.replan(layout, alive=[0, 1, 3])
    assert result.layout.dims == {"dp_replicate": 1, "dp_shard": 2}
    assert result.ranks == (0, 1) and result.lost == (2,) and result.dropped == (3,)
    assert result.spares == () and result.removed == {"dp_replicate": (1,)}
    assert result.new_rank(1) == 1 and result.new_rank(3) is None
    assert result.layout.role_names == layout.role_names  # every role re-derived
    assert result.layout.elastic == layout.elastic


def test_leftover_survivors_become_spares_when_asked() -> None:
    layout = cg.Layout(dims=HSDP, elastic={"dims": {"dp_replicate": 1}, "spares": True})
    result = cg.replan(layout, alive=[1, 2, 3])
    assert result.ranks == (2, 3) and result.spares == (1,) and result.dropped == ()


def test_nothing_lost_keeps_the_layout() -> None:
    layout = cg.Layout(dims=HSDP, elastic={"dims": {"dp_replicate": 1}})
    result = cg.replan(layout, alive=range(4))
    assert result.layout == layout and result.ranks == (0, 1, 2, 3) and result.lost == ()


def test_a_dim_that_may_not_shrink_is_named() -> None:
    layout = cg.Layout(dims={"dp_replicate": 2, "cp": 4})
    with pytest.raises(ReplanError, match=r"cp group \[4, 5, 6, 7\] lost rank 5; cp may not "
                                          r"shrink; the layout declares no elastic dim"):
        cg.replan(layout, alive=[0, 1, 2, 3, 4, 6, 7])
    at_minimum = cg.Layout(dims={"dp_replicate": 2, "cp": 4}, elastic={"dims": {"dp_replicate": 2}})
    with pytest.raises(ReplanError, match="dp_replicate would shrink from 2 to 1, below its "
                                          "minimum 2"):
        cg.replan(at_minimum, alive=[0, 1, 2, 3, 4, 6, 7])


def test_bad_survivor_lists_are_named() -> None:
    layout = cg.Layout(dims=HSDP, elastic={"dims": {"dp_replicate": 1}})
    with pytest.raises(ReplanError, match=r"ranks \[4\] are outside the world 0..3"):
        cg.replan(layout, alive=[0, 4])
    with pytest.raises(ReplanError, match="no rank survived"):
        cg.replan(layout, alive=[])


def test_an_auto_layout_is_resolved_before_planning() -> None:
    """plan, replan and estimate_memory need a world size, which an AutoLayout (load_layout's
    answer for a file with an "auto" dim) gets from resolve: each says so, not AttributeError."""
    from commgroups.errors import ArgumentError
    from commgroups.planning.memory import estimate_memory

    auto = cg.AutoLayout(dims={"dp_replicate": "auto", "dp_shard": 2},
                         elastic={"dims": {"dp_replicate": 1}})
    for use in (lambda: cg.plan(auto), lambda: cg.replan(auto, [0]),  # type: ignore[arg-type]
                lambda: estimate_memory(auto)):  # type: ignore[arg-type]
        with pytest.raises(ArgumentError) as info:
            use()
        assert info.value.field == "layout" and "fix: pass layout.resolve(world_size)" in str(
            info.value) and len(str(info.value)) <= 300
    assert cg.plan(auto.resolve(4)).world_size == 4


def test_the_dim_that_keeps_the_most_ranks_shrinks() -> None:
    layout = cg.Layout(dims={"dp_replicate": 2, "dp_shard": 4},
                       elastic={"dims": {"dp_replicate": 1, "dp_shard": 1}})
    result = cg.replan(layout, alive=[r for r in range(8) if r != 5])
    # dropping dp_shard coordinate 1 keeps 6 ranks; dropping replica 1 would keep 4
    assert result.layout.dims == {"dp_replicate": 2, "dp_shard": 3}
    assert result.ranks == (0, 2, 3, 4, 6, 7)


def test_views_shrink_with_the_elastic_dim() -> None:
    layout = cg.Layout(dims={"dp_replicate": 2, "dp_shard": 2, "cp": 2},
                       views={"sparse": {"dp_replicate": 2, "efsdp": 2, "ep": 2}},
                       roles=[{"name": "ep", "dims": ["ep"]}, {"name": "cp", "dims": ["cp"]}],
                       elastic={"dims": {"dp_replicate": 1}})
    result = cg.replan(layout, alive=[0, 1, 2, 3, 4, 5, 6])
    assert result.layout.views == {"sparse": {"dp_replicate": 1, "efsdp": 2, "ep": 2}}
    assert result.ranks == (0, 1, 2, 3)


def test_one_node_of_65536_ranks() -> None:
    layout = cg.Layout(dims={"dp_replicate": 64, "dp_shard": 128, "tp": 8},
                       elastic={"dims": {"dp_replicate": 32}})
    node = range(8 * 1000, 8 * 1001)  # the 8 ranks of one node: one tp group
    alive = np.setdiff1d(np.arange(65536), np.fromiter(node, dtype=np.int64))
    result = cg.replan(layout, alive.tolist())
    assert result.layout.dims == {"dp_replicate": 63, "dp_shard": 128, "tp": 8}
    assert len(result.ranks) == 63 * 128 * 8 and result.lost == tuple(node)
    assert len(result.dropped) == 1024 - 8  # the rest of the lost ranks' replica


@st.composite
def _elastic_cases(draw: st.DrawFn) -> tuple[cg.Layout, list[int]]:
    names = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    dims = {n: draw(st.integers(1, 4)) for n in names if draw(st.booleans())} or {"dp_shard": 2}
    elastic = {n: draw(st.integers(1, dims[n])) for n in dims
               if n in ("dp_replicate", "dp_shard") and draw(st.booleans())}
    roles = [{"name": f"r{i}", "dims": [n for n in dims if n in subset]}
             for i, subset in enumerate(draw(st.lists(
                 st.sets(st.sampled_from(list(dims)), min_size=1), min_size=1, max_size=3)))]
    roles.append({"name": "checkpoint-metadata", "dims": "world", "backend": "gloo"})
    layout = cg.Layout(dims=dims, roles=roles, elastic={"dims": elastic} if elastic else None)
    world = layout.world_size
    lost = draw(st.sets(st.integers(0, world - 1), max_size=min(3, world - 1)))
    return layout, [r for r in range(world) if r not in lost]


@settings(max_examples=150, deadline=None)
@given(_elastic_cases())
def test_survivors_are_grouped_by_the_same_rules(case: tuple[cg.Layout, list[int]]) -> None:
    layout, alive = case
    try:
        result = cg.replan(layout, alive)
    except ReplanError as error:
        # refused only when no elastic dim could absorb the loss
        assert "may not shrink" in str(error) or "below its minimum" in str(error)
        return
    ranks = result.ranks
    assert list(ranks) == sorted(ranks) and set(ranks) <= set(alive)
    assert len(ranks) == result.layout.world_size
    assert set(ranks) | set(result.dropped) | set(result.lost) == set(range(layout.world_size))
    for name, size in layout.dims.items():
        if layout.elastic is None or name not in layout.elastic.dims:
            assert result.layout.dims[name] == size
    old, new = cg.plan(layout), cg.plan(result.layout)
    for role in layout.role_names:
        for new_rank, global_rank in enumerate(ranks):
            mapped = {ranks[r] for r in new.group_of(role, new_rank) or ()}
            before = set(old.group_of(role, global_rank) or ())
            assert mapped == before & set(ranks), (role, new_rank)


def test_the_elastic_section_loads_from_a_layout_file() -> None:
    from pathlib import Path

    layout = cg.load_layout(Path(__file__).resolve().parents[1] / "examples/layouts/hsdp_elastic.toml")
    assert layout.elastic is not None and layout.elastic.dims == {"dp_replicate": 2}
    assert cg.replan(layout, alive=[0, 1, 2, 3, 4, 5, 7]).layout.dims == {"dp_replicate": 3,
                                                                          "dp_shard": 2}


def test_a_rank_past_int64_is_a_replan_error() -> None:
    """A set or generator holding a rank too large for int64 (numpy raises OverflowError there)
    gets the same clear error as any other malformed alive list."""
    layout = cg.Layout(dims={"dp_replicate": 2, "dp_shard": 2},
                       elastic={"dims": {"dp_replicate": 1}})
    for alive in ({0, 1, 2**70}, (rank for rank in (0, 2**70))):
        with pytest.raises(cg.errors.ReplanError, match=r"alive: .* fix: pass e\.g\. alive="):
            cg.replan(layout, alive)  # type: ignore[arg-type]
