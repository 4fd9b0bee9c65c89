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

    import commgroups as cg
    from commgroups.integrations.torchtitan.trainer import agree_on_seed
    from tests.torch_private import default_group, sequence_number

    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": world_size})).create()
    torch.manual_seed(1000 + rank)  # every rank's RNG differs; rank 0's must win
    own = int(torch.get_rng_state()[:8].clone().view(torch.uint64).item())
    before = sequence_number(default_group())
    seeds = [agree_on_seed(registry) for _ in range(2)]
    collectives = sequence_number(default_group()) - before
    registry.close()
    return seeds, own, collectives


def seed_without_rank_0(rank: int, world_size: int, post: Any) -> tuple[str, float]:
    """Rank 0 dies before it publishes its seed: the others' error, and how long they waited."""
    import os
    import time

    import commgroups as cg
    from commgroups.errors import CommGroupsError
    from commgroups.integrations.torchtitan.trainer import agree_on_seed

    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": world_size}),
                                create_timeout_s=120).create()
    if rank == 0:
        os._exit(0)  # the job's store lives in the test process: it outlives rank 0
    started = time.monotonic()
    try:
        agree_on_seed(registry)
    except CommGroupsError as error:
        return type(error).__name__, time.monotonic() - started
    return "no error", time.monotonic() - started


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


def test_a_seed_whose_first_member_died_raises_at_once_not_after_the_stores_timeout() -> None:
    """Before, every other rank read the seed's key on the job's shared connection until the
    store's own timeout (the world's init timeout here, 120 s; torchrun's is 900 s)."""
    from commgroups.util.local_world import run_local_world

    reports = run_local_world(seed_without_rank_0, 3, timeout_s=300, grace_s=None)
    for rank in (1, 2):
        assert reports[rank].ok, reports[rank].traceback
        error, waited = reports[rank].value
        assert error == "LossInterruptedError", (rank, error, waited)
        assert waited < 30, (rank, waited)
