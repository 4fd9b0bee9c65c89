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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from commgroups.demo.model import ModelConfig, TinyTransformer
from commgroups.demo.train import batch_tokens
from commgroups.integrations.fsdp import fully_shard_on_role
from commgroups.registry import GroupRegistry
from commgroups.specs import ElasticSpec, Layout, RoleSpec, default_roles

__all__ = ["ElasticRun", "elastic_layout", "elastic_rank"]

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
    """The check-in window (None: the roles' longest timeout)."""
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


def elastic_rank(rank: int, world_size: int, post: Callable[[Any], None],
                 run: ElasticRun) -> dict[str, Any]:
    """Train ``run`` on this rank; survive the loss of ``run.kill_rank`` by rebuilding in place.

    Returns this rank's place (member, spare, dropped), its losses by step, the rebuild's report
    and timings, the shards it held when it rebuilt, and its final shards.
    """
    registry = GroupRegistry(run.layout, create_timeout_s=60).create()
    model = _build(registry)
    if run.start_shards:
        _load(model, run.start_shards[registry.members.index(rank)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict[str, Any] = {"losses": {}, "rebuild": None}
    step = run.start_step
    while step < run.steps:
        held = _shards(model)  # what this rank holds in memory at the start of the step
        position = registry.members.index(rank)
        started = time.monotonic()
        try:
            result["losses"][step] = _step(model, optim, step, position,
                                           die=rank == run.kill_rank and step == run.kill_step)
        except Exception as error:
            if run.kill_rank is None or result["rebuild"] is not None:
                raise
            noticed = time.monotonic() - started
            report = registry.rebuild(timeout=run.rebuild_timeout_s)
            result["rebuild"] = {"error": f"{type(error).__name__}: {str(error)[:160]}",
                                 "noticed_s": noticed, "report": report,
                                 "text": report.describe()}
            if rank == min(report.members, default=-1):
                post(f"[elastic] step {step}: rank {run.kill_rank} lost; noticed after "
                     f"{noticed:.2f}s ({type(error).__name__})\n" + report.describe())
            if report.place != "member":
                result["place"] = report.place
                registry.close()
                return result
            result["held"] = held
            model = _build(registry)
            _load(model, held)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            continue  # redo the step on the rebuilt world
        step += 1
    result.update(place="member", position=registry.members.index(rank),
                  layout=registry.layout, final=_shards(model), generation=registry.generation)
    registry.close()
    return result
