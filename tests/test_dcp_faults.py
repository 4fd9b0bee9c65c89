"""A rank killed in the middle of a DCP save: the previous checkpoint still loads exactly (in the
survivors' rebuilt registry, and in a fresh job), and the broken one is never taken for complete."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups.integrations import dcp
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {f"w{rank}": torch.arange(12.0).reshape(3, 4) * step + rank,
            f"b{rank}": torch.full((6,), float(step * 10 + rank))}


def _all_states(world_size: int, step: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        merged.update(_state(rank, step))
    return merged


# Survivors that are not the lost rank's direct peers wait this long in DCP's collectives; it also
# bounds the healthy saves before the loss (milliseconds each here).
GROUP_TIMEOUT_S = 6


def _save_then_die(rank: int, world_size: int, root: str) -> dict[str, Any]:
    layout = cg.Layout(dims={"dp": world_size}, roles=[
        cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo", timeout_s=GROUP_TIMEOUT_S)],
        elastic={"dims": {"dp": 1}})
    registry = cg.GroupRegistry(layout).create()
    step1, step2 = Path(root, "step1"), Path(root, "step2")
    dcp.save(_state(rank, 1), checkpoint_id=step1, registry=registry)
    out: dict[str, Any] = {"step1_complete": dcp.checkpoint_complete(step1)}
    try:
        dcp.save(_state(rank, 1), checkpoint_id=step1, registry=registry)
        out["overwrite_refused"] = None
    except dcp.CheckpointExistsError as error:
        out["overwrite_refused"] = str(error)
    dist.barrier(group=registry.group("checkpoint-metadata"))
    if rank == 3:
        from torch.distributed.checkpoint import filesystem

        def die_while_writing(*args: Any, **kwargs: Any) -> Any:
            os._exit(3)  # killed after planning, in the middle of writing its data

        filesystem.FileSystemWriter.write_data = die_while_writing  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        dcp.save(_state(rank, 2), checkpoint_id=step2, registry=registry)
        out["step2_error"] = None
    except Exception as error:  # whatever DCP raises when a peer vanishes
        out["step2_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    out["seconds"] = time.monotonic() - started
    # The survivors rebuild in place and read the previous checkpoint through the new
    # checkpoint-metadata group (the lost rank's keys are simply not asked for).
    # The window outlasts two group timeouts (a survivor may notice only at the timeout, or after
    # two, while a direct peer checks in at once); told who is alive, it ends once all are in.
    report = registry.rebuild(alive=[0, 1, 2], timeout=2 * GROUP_TIMEOUT_S + 5)
    out["rebuilt_members"] = report.members
    mine = {k: torch.zeros_like(v) for k, v in _state(rank, 1).items()}
    dcp.load(mine, checkpoint_id=step1, registry=registry)
    out["reloaded_exact"] = all(torch.equal(mine[k], v) for k, v in _state(rank, 1).items())
    registry.close()
    return out


@pytest.fixture
def fault_results(tmp_path: Path) -> tuple[Path, list[Any]]:
    return tmp_path, run_world(_save_then_die, 4, str(tmp_path), timeout=120, expect_errors=True)


def test_killed_save_never_complete_and_previous_loads(fault_results: tuple[Path, list[Any]]) -> None:
    root, results = fault_results
    assert isinstance(results[3], TimeoutError)  # rank 3 died
    for out in results[:3]:
        assert out["step1_complete"]
        assert out["overwrite_refused"] is not None and "overwrite=True" in out["overwrite_refused"]
        assert out["step2_error"] is not None, "survivors must see the failed save"
        assert out["step2_error"].startswith(("RoleCollectiveError", "RoleTimeoutError")), out
        assert "role 'checkpoint-metadata'" in out["step2_error"], out
        assert out["seconds"] < 3 * GROUP_TIMEOUT_S  # generous: no hang, not a speed test
        assert out["rebuilt_members"] == (0, 1, 2) and out["reloaded_exact"]
    step1, step2 = root / "step1", root / "step2"
    assert dcp.checkpoint_complete(step1)
    assert not dcp.checkpoint_complete(step2)
    (verdict,) = run_world(_verify, 1, str(root), timeout=60)
    assert verdict["step1_exact"]
    assert "not a complete checkpoint" in verdict["step2_error"]
    assert verdict["overwritten"]


def _verify(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A fresh one-rank job reads every rank's shards of both checkpoints."""
    with cg.GroupRegistry(cg.Layout(dims={"dp": 1})) as registry:
        expected = _all_states(4, 1)
        loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(loaded, checkpoint_id=Path(root, "step1"), registry=registry)
        exact = all(torch.equal(loaded[k], v) for k, v in expected.items())
        try:
            dcp.load({k: torch.zeros_like(v) for k, v in _all_states(4, 2).items()},
                     checkpoint_id=Path(root, "step2"), registry=registry)
            error = "loaded"
        except dcp.IncompleteCheckpointError as caught:
            error = str(caught)
        step3 = Path(root, "step3")
        dcp.save(_state(0, 3), checkpoint_id=step3, registry=registry)
        dcp.save(_state(0, 4), checkpoint_id=step3, registry=registry, overwrite=True)
        again = {k: torch.zeros_like(v) for k, v in _state(0, 4).items()}
        dcp.load(again, checkpoint_id=step3, registry=registry)
        overwritten = all(torch.equal(again[k], v) for k, v in _state(0, 4).items())
    return {"step1_exact": exact, "step2_error": error, "overwritten": overwritten}
