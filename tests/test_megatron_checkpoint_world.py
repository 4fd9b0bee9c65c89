"""Megatron's distributed checkpoint on the registry's gloo group, on one real 8-rank gloo world.

As a Megatron script would: a registry over ``megatron_layout(tp=2, dp=4)`` is installed in
``parallel_state`` and the sharded state dict is built from its getters (a weight sharded over tp
and replicated over dp, an optimizer state sharded over dp and tp, common state); it is saved with
:func:`commgroups.integrations.megatron.checkpoint.save` into a real directory and loaded back
(bitwise equal), under the audit: every collective of the save and of the load is on the
``checkpoint-metadata`` gloo group, none on the default group or a training role. Then a second
registry with another layout (tp=4, dp=2) loads the same checkpoint (Megatron reshards), and
Megatron's own ``dist_checkpointing.load`` reads it too. Megatron's load without a group is
audited as the contrast: its exchange is on the default group. Skips without megatron-core.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from commgroups.util.local_world import run_local_world

pytestmark = [pytest.mark.world]

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'commgroups[megatron]', Python 3.12): CI's megatron step runs these")

WORLD = 8
PRELOAD = ("torch", "torch.distributed", "commgroups", "megatron.core.parallel_state",
           "megatron.core.dist_checkpointing", "commgroups.integrations.megatron",
           "commgroups.integrations.megatron.checkpoint", "commgroups.audit.recorder",
           "tests.test_megatron_checkpoint_world")
WEIGHT_SHAPE = (8, 6)  # sharded over tp on rows, replicated over dp
OPTIM_SHAPE = (8, 4)   # sharded over dp on rows and tp on columns
COMMON = {"iteration": 7, "note": "commgroups"}


def _global(key: str, shape: tuple[int, int]) -> Any:
    import torch

    generator = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=generator)


def _sharded_state_dict(fill: bool) -> dict[str, Any]:
    """The state dict of this rank, from parallel_state's getters, as Megatron modules build it."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = WEIGHT_SHAPE[0] // tp
    weight = _global("weight", WEIGHT_SHAPE)[tp_rank * rows:(tp_rank + 1) * rows]
    o_rows, o_cols = OPTIM_SHAPE[0] // dp, OPTIM_SHAPE[1] // tp
    optim = _global("optim", OPTIM_SHAPE)[dp_rank * o_rows:(dp_rank + 1) * o_rows,
                                          tp_rank * o_cols:(tp_rank + 1) * o_cols]
    if not fill:
        weight, optim = torch.zeros_like(weight), torch.zeros_like(optim)
    return {
        "weight": ShardedTensor.from_rank_offsets("layer.weight", weight.contiguous(),
                                                  (0, tp_rank, tp), replica_id=dp_rank),
        "optim": ShardedTensor.from_rank_offsets("optim.exp_avg", optim.contiguous(),
                                                 (0, dp_rank, dp), (1, tp_rank, tp)),
        **({"common": dict(COMMON)} if fill else {}),
    }


def _bitwise(loaded: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    import torch

    problems = [f"{key} differs" for key in ("weight", "optim")
                if not torch.equal(loaded[key], expected[key].data)]
    if loaded.get("common") != COMMON:
        problems.append(f"common state {loaded.get('common')!r}")
    return problems


def _audited(registry: Any, what: str, fn: Any) -> tuple[Any, list[str], dict[str, int]]:
    """Run ``fn`` under the audit; problems: records off the checkpoint group; counts by group."""
    import commgroups as cg

    with cg.audit.record(registry) as recorder:
        value = fn()
    problems = [f"{what}: {r.op} on group {r.group} (roles {r.roles}) from {r.caller}"
                for r in recorder.records if r.roles != (cg.CHECKPOINT_ROLE,)]
    counts: dict[str, int] = {}
    for r in recorder.records:
        counts[r.op] = counts.get(r.op, 0) + 1
    if not recorder.records:
        problems.append(f"{what}: the audit recorded no collective")
    # Megatron's dist_checkpointing and commgroups' wrapper count as checkpoint traffic
    # (audit.records.CHECKPOINT_MODULES): no off_purpose hazard either.
    kinds = {h.kind for h in recorder.hazards()}
    problems += [f"{what}: hazard {kind}" for kind in sorted(kinds)]
    return value, problems, counts


def _rank_checks(rank: int, world_size: int, post: Any, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import commgroups as cg
    from commgroups.integrations import megatron as mg
    from commgroups.integrations.megatron import checkpoint

    problems: list[str] = []
    seconds: dict[str, float] = {}
    path = Path(root) / "step-7"
    path.mkdir(exist_ok=True)

    start = time.monotonic()
    registry = cg.GroupRegistry(mg.megatron_layout(tp=2, dp=4), heartbeat_s=None).create()
    mg.install_parallel_state(registry)
    seconds["create+install"] = time.monotonic() - start
    saved = _sharded_state_dict(fill=True)
    start = time.monotonic()
    _, save_problems, save_ops = _audited(
        registry, "save", lambda: checkpoint.save(dict(saved), path, registry=registry))
    seconds["save"] = time.monotonic() - start
    problems += save_problems
    start = time.monotonic()
    loaded, load_problems, load_ops = _audited(
        registry, "load",
        lambda: checkpoint.load(_sharded_state_dict(fill=False), path, registry=registry))
    seconds["load"] = time.monotonic() - start
    problems += load_problems + [f"round trip: {p}" for p in _bitwise(loaded, saved)]

    # Shards that overlap (every dp rank a main replica of the weight): refused on every rank,
    # where Megatron raises on global rank 0 alone and the others wait in the plan exchange.
    from megatron.core.dist_checkpointing import ShardedTensor

    bad = _sharded_state_dict(fill=True)
    bad["weight"] = ShardedTensor.from_rank_offsets(
        "layer.weight", bad["weight"].data, (0, ps.get_tensor_model_parallel_rank(), 2), replica_id=0)
    (Path(root) / "bad").mkdir(exist_ok=True)
    try:
        checkpoint.save(bad, Path(root) / "bad", registry=registry)
        problems.append("overlapping shards were saved")
    except cg.errors.ArgumentError as error:
        if "exactly once" not in str(error):
            problems.append(f"overlapping shards: {error}")

    # The contrast: Megatron's own load without a group exchanges on the default group.
    with cg.audit.record(registry) as recorder:
        dist_checkpointing.load(_sharded_state_dict(fill=False), str(path))
    if not any(r.group == "0" for r in recorder.records) or "aliasing" not in {
            h.kind for h in recorder.hazards()}:
        problems.append("Megatron's load without process_group was not seen on the default group")
    ps.destroy_model_parallel()  # closes the registry: tp=2 x dp=4 is gone

    # Another layout loads the same checkpoint: Megatron reshards tp 2 -> 4, dp 4 -> 2.
    start = time.monotonic()
    registry = cg.GroupRegistry(mg.megatron_layout(tp=4, dp=2), heartbeat_s=None).create()
    with mg.install_parallel_state(registry):
        expected = _sharded_state_dict(fill=True)
        resharded, reshard_problems, _ = _audited(
            registry, "load tp=4 dp=2",
            lambda: checkpoint.load(_sharded_state_dict(fill=False), path, registry=registry))
        problems += reshard_problems + [f"reshard: {p}" for p in _bitwise(resharded, expected)]
        # Megatron's own reader reads what commgroups wrote (its format, untouched)
        theirs = dist_checkpointing.load(_sharded_state_dict(fill=False), str(path),
                                         process_group=registry.group(cg.CHECKPOINT_ROLE))
        problems += [f"Megatron's load: {p}" for p in _bitwise(theirs, expected)]
    seconds["reshard"] = time.monotonic() - start
    if ps.model_parallel_is_initialized() or registry.created:
        problems.append("the handle's exit left parallel_state or the registry up")
    dist.barrier()
    return {"problems": problems, "seconds": seconds, "save_ops": save_ops, "load_ops": load_ops}


def test_save_and_load_run_on_the_checkpoint_group(tmp_path: Path) -> None:
    start = time.monotonic()
    reports = run_local_world(_rank_checks, WORLD, str(tmp_path), timeout_s=240.0, preload=PRELOAD)
    failures = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
    assert sorted(reports) == list(range(WORLD))
    problems = [f"rank {r}: {p}" for r in range(WORLD) for p in reports[r].value["problems"]]
    assert not problems, "\n".join(problems[:40])
    files = sorted(p.name for p in (tmp_path / "step-7").iterdir())
    assert ".metadata" in files and "metadata.json" in files, files  # DCP's and Megatron's
    value = reports[0].value
    print(f"8-rank world: {time.monotonic() - start:.1f}s; rank 0 collectives: save "
          f"{value['save_ops']}, load {value['load_ops']}; "
          + ", ".join(f"{k} {v:.2f}s" for k, v in value["seconds"].items()))


def test_a_coordinator_that_fails_writing_metadata_tells_every_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's own ``.metadata`` write (Megatron's ``writer.finish``) failing goes into
    the verdict broadcast the other ranks already wait in, as a writer's failure does, instead of
    leaving them there until the group's timeout. In this process, on a 1-rank gloo world: the
    broadcast is issued after the failure, and the failure is raised from the coordinator's."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    import commgroups as cg
    from commgroups.integrations.megatron import checkpoint, megatron_layout
    from commgroups.integrations.megatron import megatron_internals as internals

    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    events: list[str] = []
    broadcast = dist.broadcast_object_list

    def finish(self: Any, *args: Any, **kwargs: Any) -> None:
        events.append("finish")
        raise OSError(28, "No space left on device")

    def counted(*args: Any, **kwargs: Any) -> None:
        events.append("broadcast")
        broadcast(*args, **kwargs)

    monkeypatch.setattr(internals.checkpoint_names()["writer"], "finish", finish)
    monkeypatch.setattr(dist, "broadcast_object_list", counted)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with cg.GroupRegistry(megatron_layout()) as registry:
            state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0)}
            with pytest.raises(RuntimeError, match=r"group ranks \{0: .*No space left") as raised:
                checkpoint.save(state, tmp_path, registry=registry,
                                validate_access_integrity=False)
    finally:
        dist.destroy_process_group()
    assert isinstance(raised.value.__cause__, OSError)
    assert "finish" in events and "broadcast" in events[events.index("finish"):], events
