"""One rank of the demo: train with FSDP2 and cp, checkpoint through DCP, load, compare.

Called on every rank after ``init_process_group`` (by the launcher, or under torchrun). Rank 0 prints
progress and the report and writes the JSON; every rank returns its own result dict.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commgroups import torch_internals
from commgroups.collectives.async_wait import issue_and_wait

from .audit_hook import start_audit
from .config import DemoConfig
from .groups import JobGroups, build_groups, demo_layout
from .model import ModelConfig, SeqGather, TinyTransformer

__all__ = ["batch_tokens", "run_rank", "spmd_seq_gather"]

logger = logging.getLogger(__name__)

_DIR_KEY = "commgroups/demo/checkpoint_dir"


def batch_tokens(step: int, data_key: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """``[batch, seq + 1]`` arithmetic sequences mod ``vocab`` (learnable only with attention).

    Seeded by step and data-parallel replica only, so every run of the demo sees the same data.
    """
    gen = torch.Generator().manual_seed(10_007 * step + data_key)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq + 1)) % vocab


def spmd_seq_gather(axis: Any) -> SeqGather:
    """K/V gather over ``axis`` with spmd_types: stack-all_gather (V -> R), then merge into seq.

    The stack path is spmd_types' raw ``dist.all_gather_into_tensor`` (blocking unless the dist module
    says otherwise) and its backward a raw ``reduce_scatter_tensor``: exactly the calls that race FSDP
    on a shared NCCL communicator.
    """
    spmd: Any = importlib.import_module("spmd_types")

    def gather(t: torch.Tensor) -> torch.Tensor:
        stacked = spmd.all_gather(t, axis, src=spmd.V, dst=spmd.R)  # [cp, batch, heads, local, hd]
        return stacked.movedim(0, 2).flatten(2, 3)  # type: ignore[no-any-return]

    return gather


def _all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # The demo's own collective follows the rule it demonstrates, through the library's primitive.
    issue_and_wait(dist.all_reduce, value, op=dist.ReduceOp.SUM, group=group)
    return value


def _cp_mean(value: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if cp_group is None:
        return value
    waited = torch_internals.functional_all_reduce(value, "sum", cp_group)
    return waited / dist.get_world_size(cp_group)


def _shared_dir(cfg: DemoConfig, rank: int) -> tuple[str, bool]:
    """The checkpoint directory every rank uses, and whether this rank created it (and must clean)."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir, False
    store = torch_internals.default_store()
    key = f"{_DIR_KEY}/{cfg.mode}"
    if rank == 0:
        path = tempfile.mkdtemp(prefix="commgroups-demo-")
        store.set(key, path)
        return path, True
    return store.get(key).decode(), False


def _build_model(seed: int, mcfg: ModelConfig, groups: JobGroups) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyTransformer(mcfg)
    # Equivalent to commgroups.integrations.fsdp.fully_shard_on_role in registry mode; the baseline
    # has no registry, so both go through the mesh the groups object holds.
    for block in model.blocks:
        fully_shard(block, mesh=groups.fsdp_mesh)
    fully_shard(model, mesh=groups.fsdp_mesh)
    return model


def _local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        key: (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in model.state_dict().items()
    }


def run_rank(cfg: DemoConfig, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo on this rank; collective. Returns the run's result (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # several ranks share few cores: oversubscription only slows them down
    emit = say if (say is not None and rank == 0 and not cfg.quiet) else (lambda _msg: None)
    t0 = time.monotonic()
    layout = demo_layout(cfg)
    groups = build_groups(cfg, layout)
    try:
        with warnings.catch_warnings():
            # spmd_types calls all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
            # deprecates; one warning per rank and call site would bury the demo's own output.
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=r".*is deprecated\. Please use `torch\.distributed\.")
            return _run(cfg, groups, rank, world, emit, t0)
    finally:
        groups.close()


def _run(
    cfg: DemoConfig,
    groups: JobGroups,
    rank: int,
    world: int,
    emit: Callable[[str], None],
    t0: float,
) -> dict[str, Any]:
    cp_ranks = groups.cp_ranks
    cp_size, cp_index, data_key = len(cp_ranks), cp_ranks.index(rank), min(cp_ranks)
    local = cfg.tokens_per_cp_rank
    seq = local * cp_size
    mcfg = ModelConfig(max_seq=seq)
    aliases = sorted(name for name, info in groups.roles.items() if info["is_default_group"])
    emit(f"[demo] {cfg.mode}: {world} ranks, fsdp over {groups.roles['fsdp']['size']} ranks, "
         f"cp {cp_size} ({local} of {seq} tokens per rank); roles on the default group: "
         f"{', '.join(aliases) or 'none'}")

    audit = start_audit(cfg.audit, groups)
    gather = spmd_seq_gather("cp") if groups.cp_group is not None else None
    local_losses: list[torch.Tensor] = []
    ckpt_dir, owns_dir = _shared_dir(cfg, rank)
    try:
        # The audit sees the job's own traffic (FSDP2, cp, DCP, the per-step loss over cp); the
        # demo's bookkeeping (averages over the data-parallel replicas, the comparison's verdict)
        # is reduced after the recording ends.
        with audit.recording():
            model = _build_model(0, mcfg, groups)
            optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            for step in range(cfg.steps):
                tokens = batch_tokens(step, data_key, cfg.batch, seq, mcfg.vocab)
                lo = cp_index * local
                inputs, targets = tokens[:, lo:lo + local], tokens[:, lo + 1:lo + local + 1]
                with groups.spmd_scope():
                    logits = model(inputs, lo, gather)
                    loss = F.cross_entropy(logits.reshape(-1, mcfg.vocab), targets.reshape(-1))
                    loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
                optim.zero_grad(set_to_none=True)
                # The sequence's loss, averaged over its cp ranks as CP training loops do for
                # logging (a functional collective: the async path), on the job's cp group.
                local_losses.append(_cp_mean(loss.detach(), groups.cp_group))
                emit(f"[demo] step {step + 1}/{cfg.steps}  loss {float(local_losses[-1]):.4f}  "
                     f"({time.monotonic() - t0:.1f}s)")

            path = os.path.join(ckpt_dir, "step-final")
            ckpt = groups.roles["checkpoint-metadata"]
            where = "the default group" if ckpt["is_default_group"] else "the checkpoint-metadata group"
            emit(f"[demo] checkpoint: DCP save through {where} ({ckpt['backend']})")
            groups.save({"model": model.state_dict()}, path)
            fresh = _build_model(1, mcfg, groups)
            before = _local_state(fresh)
            groups.load({"model": fresh.state_dict()}, path)
            saved, loaded = _local_state(model), _local_state(fresh)
        hazards = audit.finish()
        mismatched = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        unchanged = [k for k in saved if torch.equal(before[k], saved[k])]
        counts = _all_reduce_sum(torch.tensor([len(mismatched), len(unchanged)]), groups.fsdp_group)
        # Every rank holds an equal share of the tokens: the mean of the per-sequence means over all
        # ranks is the global mean (each sequence counted once per cp rank, equally).
        summed = _all_reduce_sum(torch.stack(local_losses), groups.fsdp_group)
        losses = (summed / dist.get_world_size(groups.fsdp_group)).tolist()
    finally:
        if owns_dir:
            # Only after every rank has read the files: the reductions above are collective.
            shutil.rmtree(ckpt_dir, ignore_errors=True)

    bad, vacuous = int(counts[0]), int(counts[1])
    if bad:
        roundtrip = f"mismatch: {bad} tensor shard(s) differ after load"
    elif vacuous:
        roundtrip = f"vacuous: {vacuous} tensor shard(s) equal before the load"
    else:
        roundtrip = "exact"
    emit(f"[demo] load into a fresh model: {roundtrip} ({len(saved)} tensors per rank)")
    emit("[demo] losses (mean over all ranks): " + "  ".join(f"{v:.4f}" for v in losses))
    return {
        "mode": cfg.mode,
        "world_size": world,
        "layout": dict(demo_layout(cfg).dims),
        "steps": cfg.steps,
        "roles": groups.roles,
        "aliases_of_default_group": len(aliases),
        "aliased_roles": aliases,
        "losses": losses,
        "loss_decreased": len(losses) > 1 and losses[-1] < losses[0] and all(map(math.isfinite, losses)),
        "checkpoint_roundtrip": roundtrip,
        "audit": audit.status,
        "hazards": hazards,
        "elapsed_s": round(time.monotonic() - t0, 2),
    }
