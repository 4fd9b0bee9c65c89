"""``with_registry`` as a torchtitan user calls it: the config it returns and its switches.

Needs torchtitan (no process group). Skipped only when torchtitan is not installed.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_torchtitan_config.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = [pytest.mark.world, pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')",
)]


def seed_rank(rank: int, world_size: int, post: Any) -> tuple[list[int], int, int]:
    """Two agreements in a row on this rank, rank 0's own seed, and default-group collectives."""
    import torch

    from commgroups.integrations.torchtitan.trainer import agree_on_seed
    from tests.torch_private import default_group, default_store, sequence_number

    torch.manual_seed(1000 + rank)  # every rank's RNG differs; rank 0's must win
    own = int(torch.get_rng_state()[:8].clone().view(torch.uint64).item())
    before = sequence_number(default_group())
    seeds = [agree_on_seed(default_store(), rank) for _ in range(2)]
    return seeds, own, sequence_number(default_group()) - before


def test_seed_agreed_through_the_store_without_a_collective() -> None:
    from commgroups.util.local_world import run_local_world

    reports = run_local_world(seed_rank, 3, timeout_s=300)
    assert all(rep.ok for rep in reports.values()), [rep.traceback for rep in reports.values()]
    seeds, own0, _ = reports[0].value
    for rank in range(3):
        got, own, collectives = reports[rank].value
        assert got == [own0, own0] == seeds  # the n-th call meets the n-th call
        assert collectives == 0
        assert rank == 0 or own != own0
