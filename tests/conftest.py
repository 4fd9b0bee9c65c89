"""Shared fixtures: real gloo worlds (tests.worlds) and single-process fake-backend worlds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_world() -> Iterator[object]:
    """Factory: init a fake-backend default group of any size in this process; torn down after."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
