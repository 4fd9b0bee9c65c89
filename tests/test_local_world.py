"""The local-world runner behind the demo, the benchmarks and these tests: nothing hangs."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch.distributed as dist

from commgroups.util.local_world import Post, run_local_world

pytestmark = pytest.mark.world


def _behave(rank: int, world_size: int, post: Post, how: str) -> Any:
    post(f"hello from {rank}")
    if rank == 1 and how == "raise":
        raise ValueError("rank 1 broke")
    if rank == 1 and how == "die":
        os._exit(7)
    if rank == 1 and how == "hang":
        time.sleep(60)
    if how != "hang":
        dist.barrier() if how == "ok" else time.sleep(0.2)
    return rank * 10


def test_results_and_messages() -> None:
    messages: list[Any] = []
    reports = run_local_world(_behave, 3, "ok", timeout_s=60, on_message=messages.append)
    assert {r: rep.value for r, rep in reports.items()} == {0: 0, 1: 10, 2: 20}
    assert sorted(messages) == ["hello from 0", "hello from 1", "hello from 2"]


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    reports = run_local_world(_behave, 3, "raise", timeout_s=60)
    assert not reports[1].ok and isinstance(reports[1].value, ValueError)
    assert "rank 1 broke" in (reports[1].traceback or "")
    assert reports[0].ok and reports[2].ok


def test_a_dead_rank_is_missing_and_the_run_ends() -> None:
    started = time.monotonic()
    reports = run_local_world(_behave, 3, "die", timeout_s=60, grace_s=2.0)
    assert 1 not in reports
    assert time.monotonic() - started < 30


def test_a_hung_rank_is_stopped_at_the_deadline() -> None:
    started = time.monotonic()
    reports = run_local_world(_behave, 2, "hang", timeout_s=8)
    assert 1 not in reports and reports[0].ok
    assert time.monotonic() - started < 25


def test_a_world_that_cannot_join_is_started_again_then_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rendezvous failures restart the whole world (bounded); the function runs on no rank."""
    messages: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="commgroups.util.local_world"):
        reports = run_local_world(_behave, 2, "ok", backend="no-such-backend", timeout_s=60,
                                  init_attempts=2, on_message=messages.append)
    assert messages == []  # nobody ran _behave
    assert reports and all(not rep.ok and rep.init_failed for rep in reports.values())
    assert all("no-such-backend" in (rep.traceback or "") for rep in reports.values())
    retries = [r.getMessage() for r in caplog.records if "failed to join" in r.getMessage()]
    assert len(retries) == 1 and "(attempt 1 of 2); starting the world again" in retries[0]


def test_ranks_start_together() -> None:
    """No rank runs the function before every rank has joined (a fast rank cannot exit early and
    leave a slow one connecting to nobody): the default group works from the first statement."""
    reports = run_local_world(_first_collective, 4, timeout_s=60)
    assert {r: rep.value for r, rep in reports.items()} == {r: 6.0 for r in range(4)}


def _first_collective(rank: int, world_size: int, post: Post) -> float:
    import torch

    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    return float(tensor.item())
