"""The local-world runner behind the demo, the benchmarks and these tests: nothing hangs."""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from commgroups.local_world import Post, run_local_world


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
