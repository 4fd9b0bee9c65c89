"""The reconfigure probe of commgroups.torch_internals: False without torch 2.15's API, never raises.

torch 2.15 has a private reconfigure API (``_supports_reconfigure``, ``_get_reconfigure_handle``,
``_reconfigure``); older torch has none, and there the probe must say False. What it does to a world
that lost a rank is measured by ``benchmarks/reconfigure.py`` (docs/guide.md, "torch 2.15's
reconfigure, measured"); here one gloo rank in this process is enough.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.torch_internals.version import torch_version

HAS_API = torch_version() >= (2, 15, 0)
needs_2_15 = pytest.mark.skipif(
    not HAS_API, reason=f"torch {torch.__version__} has no reconfigure API (torch >= 2.15 has)")


def test_the_api_is_there_exactly_from_torch_2_15() -> None:
    assert torch_internals.has_reconfigure() is HAS_API


def test_without_a_default_group_the_probe_says_false() -> None:
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    assert torch_internals.supports_reconfigure() is False
    assert torch_internals.supports_reconfigure(None) is False


# Before the one_rank tests: that module-scoped world lives until the file ends.
def test_the_probe_says_false_on_a_fake_backend(fake_world: object) -> None:
    fake_world(4)  # type: ignore[operator]  # the fixture's factory
    assert torch_internals.supports_reconfigure() is False


def test_on_a_real_gloo_group_the_probe_follows_the_torch_version(
        one_rank: dist.ProcessGroup) -> None:
    assert torch_internals.supports_reconfigure() is HAS_API
    assert torch_internals.supports_reconfigure(one_rank) is HAS_API


def test_before_torch_2_15_the_probe_says_false_and_never_raises(
        one_rank: dist.ProcessGroup) -> None:
    if HAS_API:
        pytest.skip(f"torch {torch.__version__} has the reconfigure API")
    assert torch_internals.has_reconfigure() is False
    assert torch_internals.supports_reconfigure(one_rank) is False


@needs_2_15
def test_a_gloo_group_reconfigured_onto_itself_still_carries_collectives(
        one_rank: dist.ProcessGroup) -> None:
    handle = torch_internals.reconfigure_handle(one_rank)
    assert handle.startswith("gloo:0:")
    torch_internals.reconfigure_group(one_rank, uuid=7, handles=[handle])
    total = torch.ones(3)
    dist.all_reduce(total, group=one_rank)
    assert total.tolist() == [1.0, 1.0, 1.0]
    assert torch_internals.reconfigure_handle(one_rank).startswith("gloo:0:7:")  # the new uuid
