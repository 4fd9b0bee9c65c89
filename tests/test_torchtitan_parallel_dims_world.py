"""RegistryParallelDims against torchtitan's own ParallelDims on real gloo worlds of 2 and 4 ranks.

The process half of tests/test_torchtitan_parallel_dims.py: on every rank, stock and commgroups
build their meshes for the same degrees (stock's real groups beside the registry's), every lookup
answers the same (tests/titan/parallel_dims.py), commgroups' documented differences hold, and an
all-reduce over each of commgroups' active 1-D meshes sums that mesh's ranks. Skipped only when
torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.titan.parallel_dims import BACKENDS, Degrees, rank_compare
from tests.worlds import run_world

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    pytest.mark.world,
]

WORLDS = {
    2: [Degrees(dp_shard=2), Degrees(cp=2)],
    # cp = world (stock: cp, fsdp and loss are the default group) and HSDP; the other layouts
    # run on fake worlds (a real world costs seconds per layout on CPU)
    4: [Degrees(cp=4), Degrees(dp_replicate=2, dp_shard=2)],
}


@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_gloo_world_lookups_equal_stock(world_size: int) -> None:
    cases = [(degrees, backend) for degrees in WORLDS[world_size] for backend in BACKENDS]
    reports = run_world(rank_compare, world_size, cases, timeout=300)
    for rank, report in enumerate(reports):
        assert len(report) == len(cases)
        for case, found in report.items():
            assert found["problems"] == [], (rank, case, found["problems"])
            assert found["sums"], (rank, case)  # every case has an active mesh
            for name, (got, expected) in found["sums"].items():
                assert got == expected, (rank, case, name)
            assert sorted(found["sums"]) == found["active"], (rank, case)
