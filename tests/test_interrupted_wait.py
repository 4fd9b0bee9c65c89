"""A generation keeps a group whose abandoned call still runs: release waits for the call to end,
and close() leaves that one group to torch (fake backend: no process, no socket).

The world test (``tests/test_interrupted_wait_world.py``) abandons a real gloo call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

import commgroups as cg
from commgroups.generation import Generation


class _Work:
    """A call that ends when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def _generation(registry: cg.GroupRegistry) -> Generation:
    current = registry._current  # the state object the registry delegates to
    assert current is not None
    return current


def test_a_retired_generation_is_released_only_once_its_abandoned_call_ended(
        fake_world: Callable[..., None]) -> None:
    fake_world(4)
    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": 2, "cp": 2})).create()
    generation = _generation(registry)
    work = _Work()
    generation.abandon(registry.group("fsdp"), work)
    generation.retire()
    assert generation.release() is False and generation.ended == "retired"
    work.done = True
    assert generation.release() is True and generation.ended == "released"
    assert generation.abandoned == []


def test_close_leaves_only_the_group_whose_abandoned_call_runs(
        fake_world: Callable[..., None]) -> None:
    fake_world(4)
    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": 2, "cp": 2})).create()
    kept, gone = registry.group("fsdp"), registry.group("cp")
    _generation(registry).abandon(kept, _Work())
    registry.close()
    assert dist.get_process_group_ranks(kept) == [0, 1, 2, 3]  # still registered with torch
    try:
        dist.get_process_group_ranks(gone)
    except KeyError:  # torch forgot it: destroyed
        pass
    else:
        raise AssertionError("the cp group should have been destroyed")
