"""Collect: a small Megatron-Core GPT forward and backward on one GPU, every group from the registry.

On a one-rank device-bound NCCL world: the registry over ``megatron_layout(tp=1, pp=1, cp=1,
dp=1)`` (one GPU allows nothing larger), Megatron's own ``ProcessGroupCollection`` from
``process_group_collection(registry)``, then ``GPTModel`` (2 layers, hidden 64, the local layer
spec: no Transformer Engine, no Apex) built with ``pg_collection=`` and trained a few SGD steps
(forward with labels, backward), then the same through Megatron's ``DistributedDataParallel``
(``finish_grad_sync`` on the collection's dp_cp group). ``parallel_state`` is never initialised,
so a group the model reached for there would fail; the collection handed to Megatron records
which fields Megatron read, and each of those, like every process group the modules keep, must be
the registry's group for that field's role (:data:`~commgroups.integrations.megatron.FIELD_ROLES`),
never the default group.

Every role has one rank here, so each is the registry's single-rank group (no communicator): the
check is that Megatron-Core runs on registry groups end to end on CUDA, not a communication figure.
Skipped (``skipped: <reason>``) where megatron-core is not importable (it ships cp312 wheels only).
A CPU smoke run with megatron-core builds the registry, the collection and the model on the CPU
and stops there: Megatron's attention buffer and RNG tracker are CUDA-only.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from tools.gpu_check.skip import PartSkipped
from tools.gpu_check.world import device, init_world, sync

__all__ = ["MODEL", "collect_megatron", "megatron_unavailable"]

MODEL: dict[str, int] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                         "vocab_size": 128, "seq_length": 32, "micro_batch": 2, "steps": 3}
"""The model and batch: small enough that building and three steps take well under a second."""
SEED = 1234
LR = 0.1


def megatron_unavailable() -> str | None:
    """Why megatron-core cannot be used here (None: it imports)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: F401
    except Exception as error:  # ImportError, or a broken install failing at import time
        return (f"megatron-core is not importable ({type(error).__name__}: {str(error)[:160]}); "
                f"it ships cp312 wheels only (this is Python {sys.version_info[0]}."
                f"{sys.version_info[1]}): on Python 3.12, `make gpu-wheels` brings it")
    return None


def _tracking(collection: Any, used: set[str]) -> Any:
    """A copy of ``collection`` (Megatron's class, subclassed) that notes every field read."""
    from dataclasses import fields

    base = type(collection)
    names = {f.name for f in fields(base)}
    read: Any = base.__getattribute__  # Megatron's own lookup (its __getattr__ gives unset = None)

    def __getattribute__(self: Any, name: str) -> Any:  # the dunder being replaced
        if name in names:
            used.add(name)
        return read(self, name)

    tracked = type("TrackedProcessGroupCollection", (base,), {"__getattribute__": __getattribute__})
    return tracked(**vars(collection))


def _field_rows(registry: Any, collection: Any, used: set[str]) -> list[dict[str, Any]]:
    """Per field Megatron read: its role, and whether it is that role's registry group."""
    import torch.distributed as dist

    from commgroups.integrations.megatron import FIELD_ROLES, UNFILLED_FIELDS

    values = vars(collection)  # not getattr: our own reads must not count as Megatron's
    rows = []
    for name in sorted(used):
        group, role = values.get(name), FIELD_ROLES.get(name)
        row: dict[str, Any] = {"field": name, "role": role, "set": group is not None,
                               "registry_group": False, "default_group": group is dist.group.WORLD,
                               "backend": None, "note": UNFILLED_FIELDS.get(name)}
        if group is not None and role is not None:
            row["registry_group"] = group is registry.group(role)
            row["backend"] = registry.resolved_backend(role)
        rows.append(row)
    return rows


def _module_groups(model: Any, registry: Any) -> dict[str, Any]:
    """Every process group the model's modules hold: how many, and are they all registry groups."""
    import torch.distributed as dist

    ours = {id(registry.group(role)) for role in registry.role_names}
    held: list[tuple[str, str, Any]] = []
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            candidates = value if isinstance(value, (list, tuple)) else [value]
            held += [(module_name, attr, group) for group in candidates
                     if isinstance(group, dist.ProcessGroup)]
    foreign = sorted({f"{m or '<root>'}.{a}" for m, a, g in held if id(g) not in ours})
    return {"count": len(held), "distinct": len({id(g) for _, _, g in held}),
            "all_registry": not foreign, "not_registry": foreign[:10],
            "default_group": any(g is dist.group.WORLD for _, _, g in held)}


def _config(smoke: bool) -> Any:
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
                             num_attention_heads=MODEL["num_attention_heads"],
                             use_cpu_initialization=smoke, params_dtype=torch.float32,
                             hidden_dropout=0.0, attention_dropout=0.0)


def _gpt(config: Any, collection: Any, smoke: bool) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=MODEL["vocab_size"],
                     max_sequence_length=MODEL["seq_length"], pg_collection=collection)
    return model.to(device(smoke))  # torch's LayerNorm (no Apex) is built on the CPU


def _batch(smoke: bool) -> dict[str, Any]:
    import torch

    b, s, vocab = MODEL["micro_batch"], MODEL["seq_length"], MODEL["vocab_size"]
    where = device(smoke)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=generator).to(where)
    causal = torch.ones(s, s, dtype=torch.bool, device=where).triu(1).view(1, 1, s, s)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(s, device=where).unsqueeze(0).expand(b, s),
            "attention_mask": causal}  # True = masked out, as Megatron's masks


def _train(model: Any, batch: dict[str, Any], smoke: bool,
           after_backward: Callable[[], None] | None = None) -> dict[str, Any]:
    """``MODEL["steps"]`` forward/backward/SGD steps on one batch; losses and seconds."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    losses, seconds = [], []
    for _ in range(MODEL["steps"]):
        start = time.perf_counter()
        for p in params:
            p.grad = None
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        per_token = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"])
        loss = per_token.float().mean()
        loss.backward()
        if after_backward is not None:
            after_backward()
        with torch.no_grad():
            for p in params:
                grad = getattr(p, "main_grad", None) if p.grad is None else p.grad
                if grad is not None:
                    p.add_(grad.to(p.dtype), alpha=-LR)
        sync(smoke)
        seconds.append(round(time.perf_counter() - start, 4))
        losses.append(float(loss.item()))
    with_grad = sum(1 for p in params
                    if p.grad is not None or getattr(p, "main_grad", None) is not None)
    return {"losses": losses, "step_s": seconds, "params": len(params), "params_with_grad": with_grad,
            "finite": all(math.isfinite(v) for v in losses),
            "numel": sum(p.numel() for p in params)}


def _stage(record: dict[str, Any], name: str, run: Callable[[], dict[str, Any]]) -> None:
    """Run one stage; its result or its error goes to ``record[name]`` (the next stage still runs)."""
    start = time.perf_counter()
    try:
        record[name] = {**run(), "error": None}
    except Exception as error:  # recorded per stage: a DDP failure keeps the model's result
        record[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    record[name]["seconds"] = round(time.perf_counter() - start, 3)


def collect_megatron(smoke: bool) -> dict[str, Any]:
    """Run the part; raises :class:`~tools.gpu_check.skip.PartSkipped` without megatron-core.

    Returns:
        ``{"ran", "layout", "default_backend", "forward_backward", "ddp", "fields",
        "module_groups", "all_fields_registry", "parallel_state_initialized", "seconds"}``:
        ``ran`` is True when the model's forward and backward ran on the GPU (never in a smoke run).
    """
    started = time.perf_counter()
    reason = megatron_unavailable()  # imports Megatron-Core: most of the part's time
    if reason:
        raise PartSkipped(reason)
    import torch.distributed as dist
    from megatron.core import __version__ as megatron_version
    from megatron.core import parallel_state

    import commgroups as cg
    from commgroups.integrations.megatron import megatron_layout, process_group_collection

    imported_s = time.perf_counter() - started
    init_world("gloo" if smoke else "nccl-bound")
    out: dict[str, Any] = {"ran": False, "megatron_core": megatron_version,
                           "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, "model": dict(MODEL),
                           "default_backend": dist.get_backend(), "import_s": round(imported_s, 3)}
    registry = cg.GroupRegistry(megatron_layout(tp=1, pp=1, cp=1, dp=1)).create()
    try:
        used: set[str] = set()
        collection = _tracking(process_group_collection(registry), used)
        out["collection_fields_set"] = sorted(vars(collection))
        stages: dict[str, Any] = {}
        config = _config(smoke)
        holder: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            import torch

            torch.manual_seed(SEED)  # CPU-built parts (LayerNorm, CPU init in a smoke run)
            if not smoke:
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                # Megatron's weight init and dropout fork its CUDA RNG tracker; the ranks come from
                # the collection, so parallel_state is not read.
                groups = vars(collection)  # not getattr: only Megatron's reads count as used
                model_parallel_cuda_manual_seed(SEED, tp_rank=groups["tp"].rank(),
                                                ep_rank=groups["ep"].rank(),
                                                etp_rank=groups["expt_tp"].rank())
                # The local attention takes its score buffer from parallel_state's memory buffer,
                # which initialize_model_parallel would set up with the groups; only the buffer.
                parallel_state._set_global_memory_buffer()
            holder["model"] = _gpt(config, collection, smoke)
            return {"params": sum(p.numel() for p in holder["model"].parameters())}

        _stage(stages, "build", build)
        if smoke:
            stages["forward_backward"] = {"error": "skipped: a CPU smoke run (Megatron's attention "
                                          "buffer and CUDA RNG tracker need CUDA)", "seconds": 0.0}
            stages["ddp"] = dict(stages["forward_backward"])
        elif "model" in holder:
            batch = _batch(smoke)
            _stage(stages, "forward_backward", lambda: _train(holder["model"], batch, smoke))

            def ddp() -> dict[str, Any]:
                from megatron.core.distributed import (
                    DistributedDataParallel,
                    DistributedDataParallelConfig,
                )

                wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                                  _gpt(config, collection, smoke),
                                                  pg_collection=collection)
                holder["ddp"] = wrapped  # its groups are checked even if a step fails
                return _train(wrapped, batch, smoke, after_backward=wrapped.finish_grad_sync)

            _stage(stages, "ddp", ddp)
        out.update(stages)
        out["ran"] = not smoke and stages.get("forward_backward", {}).get("error") is None
        if out["ran"]:
            out["loss"] = stages["forward_backward"]["losses"][0]
        out["fields"] = _field_rows(registry, collection, used)
        set_rows = [row for row in out["fields"] if row["set"]]
        out["all_fields_registry"] = bool(set_rows) and all(
            row["registry_group"] and not row["default_group"] for row in set_rows)
        out["module_groups"] = {name: _module_groups(holder[name], registry)
                                for name in ("model", "ddp") if name in holder}
        out["parallel_state_initialized"] = bool(parallel_state.model_parallel_is_initialized())
        sync(smoke)
    finally:
        registry.close()
        dist.destroy_process_group()
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out
