"""Hypothesis strategies shared by the planner and fuzzing tests."""

from __future__ import annotations

from hypothesis import strategies as st

import commgroups as cg

DIM_NAMES = ["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"]


@st.composite
def layouts(draw: st.DrawFn) -> cg.Layout:
    """Random layouts: 1-4 dims of size 1-5, random roles over ordered subsets of dims."""
    names = draw(st.lists(st.sampled_from(DIM_NAMES), min_size=1, max_size=4, unique=True))
    names = [n for n in DIM_NAMES if n in names]
    dims = {n: draw(st.integers(1, 5)) for n in names}
    roles: list[cg.RoleSpec] = []
    for i in range(draw(st.integers(1, 4))):
        subset = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        roles.append(cg.RoleSpec(name=f"r{i}", dims=[n for n in names if n in subset]))
    if draw(st.booleans()):
        roles.append(cg.RoleSpec(name="all", dims="world", backend="gloo"))
    return cg.Layout(dims=dims, roles=roles)
