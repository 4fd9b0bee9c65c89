"""The demo's rank-loss run: HSDP training that loses a rank mid-step and carries on in place.

FSDP2 shards the model over the ``fsdp`` role and replicates it over ``dp_replicate`` (HSDP on
``registry.device_mesh(["dp_replicate", "fsdp"])``). At ``kill_step`` the chosen rank exits after its
forward pass; the survivors' backward collectives fail (at once for its direct peers, at the role's
timeout for the others), they call ``registry.rebuild()`` (the lost rank's replica goes with it, as
the layout's ``elastic`` section allows) and redo the step on the smaller world from the shards they
hold in memory: no checkpoint is read. Each survivor keeps its ``dp_shard`` coordinate, so its shard of
every parameter is the same on the new mesh.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commgroups.demo.model import ModelConfig, TinyTransformer
from commgroups.demo.train import batch_tokens
from commgroups.integrations.fsdp import fully_shard_on_role
from commgroups.layout.specs import CHECKPOINT_ROLE, ElasticSpec, Layout, RoleSpec, default_roles
from commgroups.registry import GroupRegistry

__all__ = ["ElasticRun", "elastic_layout", "elastic_rank", "run_elastic_demo"]

SEQ = 16
BATCH = 2


def elastic_layout(world_size: int, role_timeout_s: float) -> Layout:
    """HSDP over ``world_size`` ranks (2 per replica; 1 on one rank) whose replicas may shrink to
    one; every role times out after ``role_timeout_s`` (how long a survivor may wait for a lost
    peer before it notices)."""
    shard = 2 if world_size % 2 == 0 else 1
    dims = {"dp_replicate": world_size // shard, "dp_shard": shard}
    roles = [RoleSpec(**{**role.model_dump(), "timeout_s": role_timeout_s})
             for role in default_roles(dims)]
    return Layout(dims=dims, roles=roles, elastic=ElasticSpec(dims={"dp_replicate": 1}))


@dataclass(frozen=True)
class ElasticRun:
    """One run of :func:`elastic_rank` (the same on every rank)."""

    layout: Layout
    steps: int
    kill_rank: int | None = None
    """The global rank that exits mid-step (None: nobody)."""
    kill_step: int = 1
    rebuild_timeout_s: float | None = None
    """The check-in window (None: rebuild()'s default, the roles' longest timeout and half again)."""
    alive_known: bool = False
    """Survivors pass ``alive=`` (every rank but ``kill_rank``), as a launcher's failure report
    would let them: the check-in ends once they are all in instead of at the window's end."""
    stall: tuple[int, int, float] | None = None
    """``(rank, step, seconds)``: that rank sleeps for ``seconds`` before the step (a rank stalled
    on loaded cores); its peers time out, rebuild the same world and go on."""
    start_step: int = 0
    start_shards: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    """Position -> local parameter shards to start from (a reference run); empty: the seed."""


def _build(registry: GroupRegistry) -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig(max_seq=SEQ))
    for block in model.blocks:
        fully_shard_on_role(block, registry, replicate="dp_replicate")
    fully_shard_on_role(model, registry, replicate="dp_replicate")
    return model


def _shards(model: nn.Module) -> dict[str, np.ndarray]:
    """This rank's local shard of every parameter, as numpy arrays (they travel between processes
    by value; torch tensors would travel as shared-memory handles of a process that may be gone)."""
    return {name: _local(param).detach().numpy().copy() for name, param in model.named_parameters()}


def _local(param: nn.Parameter) -> torch.Tensor:
    local: torch.Tensor = param.to_local()  # type: ignore[attr-defined]  # a DTensor (FSDP2)
    return local


def _load(model: nn.Module, shards: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = _local(param)
            if local.shape != shards[name].shape:
                raise RuntimeError(
                    f"{name}: the shard held in memory has shape {tuple(shards[name].shape)}, the "
                    f"new mesh wants {tuple(local.shape)}: the sharded dim changed size, which "
                    "needs a checkpoint reload (restart mode), not an in-place rebuild"
                )
            local.copy_(torch.from_numpy(shards[name]))


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, position: int,
          die: bool) -> float:
    tokens = batch_tokens(step, position, BATCH, SEQ, 64)
    logits = model(tokens[:, :SEQ])
    loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
    if die:
        os._exit(17)  # mid-step, after the forward pass: lost for good
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def _agreed_step(registry: GroupRegistry, step: int) -> int:
    """The step every member of the rebuilt world restarts from: the earliest one in progress.

    A survivor can be one step ahead of another (it finished its optimizer step while a peer's
    gradient reduction failed), never more: every step's collectives join the ranks of each replica
    and the replicas. Agreed over the checkpoint-metadata group (world-spanning, gloo): it is
    recovery metadata, like DCP's, and carries no model traffic.
    """
    earliest = torch.tensor([step], dtype=torch.int64)
    registry.collectives(CHECKPOINT_ROLE).all_reduce(earliest, op=dist.ReduceOp.MIN)
    return int(earliest.item())


def elastic_rank(rank: int, world_size: int, post: Callable[[Any], None],
                 run: ElasticRun) -> dict[str, Any]:
    """Train ``run`` on this rank; survive the loss of ``run.kill_rank`` by rebuilding in place.

    Each step starts by keeping this rank's shards in memory (the last two steps'). After a rebuild
    the members agree on the step to redo and restore the shards they held at its start.

    Every failed step is rebuilt from, not only the one ``run.kill_rank`` fails: a rank that
    stalls past the role timeout on loaded cores makes its peers time out too, and they rebuild
    the same world (nobody lost) and go on, as a training job would.

    Returns this rank's place (member, spare, dropped), its losses by step, every rebuild's report
    and timings (``rebuilds``, oldest first), the step it last resumed from with the shards it
    held then, and its final shards.
    """
    registry = GroupRegistry(run.layout, create_timeout_s=60).create()
    model = _build(registry)
    if run.start_shards:
        _load(model, run.start_shards[registry.members.index(rank)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict[str, Any] = {"losses": {}, "rebuilds": []}
    held: dict[int, dict[str, np.ndarray]] = {}  # step -> this rank's shards at its start
    step = run.start_step
    while step < run.steps:
        held[step] = _shards(model)
        held.pop(step - 2, None)
        position = registry.members.index(rank)
        started = time.monotonic()
        if run.stall is not None and run.stall[:2] == (rank, step) and not result["rebuilds"]:
            time.sleep(run.stall[2])
        try:
            result["losses"][step] = _step(model, optim, step, position,
                                           die=rank == run.kill_rank and step == run.kill_step)
        except Exception as error:
            noticed = time.monotonic() - started
            # alive= once the kill step is near (a survivor may fail one step behind it); a
            # stall's rebuild before that loses nobody and is told nothing.
            told = (run.alive_known and run.kill_rank in registry.members
                    and step >= run.kill_step - 1)
            alive = [r for r in registry.members if r != run.kill_rank] if told else None
            report = registry.rebuild(alive, timeout=run.rebuild_timeout_s)
            # gloo prefixes its messages with a source path in brackets: keep what follows.
            text = str(error).rsplit("] ", 1)[-1]
            result["rebuilds"].append({"error": f"{type(error).__name__}: {text[:160]}",
                                       "noticed_s": noticed, "report": report,
                                       "text": report.describe(), "failed_step": step})
            if report.place != "member":
                result["place"] = report.place
                registry.close()
                return result
            step = _agreed_step(registry, step)
            if rank == min(report.members):
                post(f"[elastic] step {step}: a collective failed after {noticed:.2f}s "
                     f"({type(error).__name__}); rebuilt generation {report.generation} in "
                     f"{report.total_seconds:.2f}s; redoing step {step}")
            result["resumed_step"], result["held"] = step, held[step]
            result["losses"] = {s: v for s, v in result["losses"].items() if s < step}
            model = _build(registry)
            _load(model, held[step])
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            continue  # redo the step on the rebuilt world
        step += 1
    result.update(place="member", position=registry.members.index(rank),
                  layout=registry.layout, final=_shards(model), generation=registry.generation)
    registry.close()
    return result


def _say(line: str) -> None:
    print(line, flush=True)


def run_elastic_demo(layout: Layout, steps: int, kill_rank: int, kill_step: int,
                     timeout_s: float, quiet: bool = False) -> int:
    """``commgroups demo --kill-rank R``: spawn the world, lose rank R at ``kill_step``, print what
    was lost, what was rebuilt and how long each phase took. Returns the exit status (0: every
    member of the rebuilt world trained every step)."""
    from commgroups.util.local_world import run_local_world

    world = layout.world_size
    if not quiet:
        _say(f"[demo] starting {world} processes (gloo, CPU); HSDP "
             f"{' x '.join(f'{k}={v}' for k, v in layout.dims.items())}; rank {kill_rank} exits "
             f"during step {kill_step}")
    run = ElasticRun(layout, steps, kill_rank=kill_rank, kill_step=kill_step)
    reports = run_local_world(elastic_rank, world, run, timeout_s=timeout_s,
                              init_timeout_s=min(timeout_s, 120.0),
                              preload=("torch", "torch.distributed", "commgroups.demo.elastic"),
                              on_message=None if quiet else _say, grace_s=None)
    failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    for rank, text in sorted(failed.items()):
        print(f"commgroups demo: rank {rank} failed:\n{text}", file=sys.stderr)
    members = {r: rep.value for r, rep in reports.items()
               if rep.ok and rep.value.get("place") == "member"}
    if failed or not members:
        return 1
    first = members[min(members)]
    _say("")
    if not first["rebuilds"]:
        _say(f"no rank was lost ({kill_step=} >= {steps=}?)")
        return 1
    *earlier_ones, rebuild = first["rebuilds"]
    for earlier in earlier_ones:
        _say(f"an earlier rebuild (generation {earlier['report'].generation}, step "
             f"{earlier['failed_step']}) lost {list(earlier['report'].lost) or 'nobody'}: "
             f"{earlier['error'][:100]}")
    report = rebuild["report"]
    _say(f"lost: rank {kill_rank} (noticed by rank {min(members)} after "
         f"{rebuild['noticed_s']:.2f}s: {rebuild['error'][:100]})")
    _say(rebuild["text"])
    others = {r: rep.value.get("place") for r, rep in reports.items() if r not in members}
    if others:
        _say("left out: " + ", ".join(f"rank {r} ({place})" for r, place in sorted(others.items())))
    losses = first["losses"]
    _say(f"rank {min(members)} losses: " + ", ".join(
        f"step {s} {losses[s]:.4f}" for s in sorted(losses))
        + f" (steps {first['resumed_step']}+ on the rebuilt world, from memory: no checkpoint "
        "read)")
    complete = all(sorted(v["losses"]) == list(range(steps)) for v in members.values())
    if not complete:
        print("commgroups demo: a member of the rebuilt world did not train every step",
              file=sys.stderr)
    return 0 if complete and kill_rank in report.lost else 1
