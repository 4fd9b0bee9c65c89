"""commgroups.rank_loss.check_in: after a real rank loss the survivors check in and learn one set of
live ranks; a rank that misses the window is told so and left out.

A real 4-rank gloo world (the launcher hosts the store); the layout is test_rebuild.py's HSDP one.
"""

from __future__ import annotations

import time

import pytest

from commgroups import GroupRegistry
from commgroups.errors import RebuildError
from tests.test_rebuild import hsdp_layout
from tests.worlds import connected_barrier, run_world

pytestmark = pytest.mark.world


def _late_rank(rank: int, world: int) -> str:
    registry = GroupRegistry(hsdp_layout(), create_timeout_s=30).create()
    connected_barrier(registry, rank, world, victim=3)
    if rank == 2:
        time.sleep(4)  # noticed the loss much later than the window allows
    try:
        report = registry.rebuild(timeout=1.5)
    except RebuildError as error:
        return f"excluded: {error}"
    return report.place


def test_a_rank_that_misses_the_window_is_told_and_left_out() -> None:
    results = run_world(_late_rank, 4, timeout=60, expect_errors=True)
    assert results[0] == results[1] == "member"
    assert isinstance(results[2], str) and results[2].startswith("excluded"), results[2]
    assert "timeout" in results[2]
