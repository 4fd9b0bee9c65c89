"""Train torchtitan on a local CPU gloo world, stock or through commgroups, and report what happened.

``train_rank`` runs on every rank of a :func:`commgroups.util.local_world.run_local_world` world (the
default group is already a gloo group; torchtitan's init_distributed then skips its own). It parses
the configuration exactly as ``python -m torchtitan.train`` does (``ConfigManager.parse_args``), so a
``with_registry`` config goes through tyro like a user's, builds the trainer, trains, and reports the
losses, the default group's collective count during training, and (through commgroups) what each
mesh torchtitan asked for is built on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests import torch_private
from tests.titan.counts import GroupKey, Tally
from tests.titan.cpu import apply_cpu_patches, force_sum_reduction

__all__ = ["TitanRun", "train_rank"]

STOCK_MODULES = {
    "llama3": ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
    # torchtitan's qwen3 MoE debug model with fewer layers (tests/titan/configs.py says why).
    "moe": ("tests.titan.configs", "qwen3_moe_small"),
}


@dataclass(frozen=True)
class TitanRun:
    """One training run: model, parallelism, stock or registry, checkpointing."""

    dump_folder: str
    assets: str
    model: str = "llama3"
    registry: bool = False
    cp: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    pp: int = 1
    spmd_backend: str = "spmd_types"
    steps: int = 4
    checkpoint_interval: int = 2
    seq_len: int = 512
    local_batch_size: int = 2
    seed: int | None = 42
    extra: tuple[str, ...] = ()
    audit: bool = False
    step_times: bool = False
    flight_recorder: bool = True
    """False: ``COMMGROUPS_FLIGHT_RECORDER=0`` in this rank process while it builds and trains
    (the user's switch; the benchmark's recorder-off variant)."""
    aligned_start: bool = False
    """Meet the other ranks (a barrier on the default group) just before building the trainer, as
    ranks a launcher starts together do. Within one world the ranks leave a training up to 2 s
    apart (rank 0 reports last): without it, stock's early ranks build their model while rank 0
    is still busy (none of stock's meshes makes a group when cp spans the world), a registry's
    wait in ``create()`` for rank 0, and rank 0's build time measures that skew."""

    def args(self) -> list[str]:
        """The command line ``python -m torchtitan.train`` would get."""
        module, config = STOCK_MODULES[self.model]
        if self.registry:
            module, config = "tests.titan.configs", f"{self.model}_registry"
        assets = Path(self.assets)
        args = [
            "--module", module, "--config", config,
            "--hf_assets_path", str(assets / "tokenizer"),
            "--dump_folder", self.dump_folder,
            "--dataloader.dataset_path", str(assets / "c4_test"),
            "--parallelism.context_parallel_degree", str(self.cp),
            "--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
            "--parallelism.pipeline_parallel_degree", str(self.pp),
            "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
            "--parallelism.tensor_parallel_degree", str(self.tp),
            "--parallelism.expert_parallel_degree", str(self.ep),
            "--parallelism.spmd_backend", self.spmd_backend,
            "--training.steps", str(self.steps),
            "--training.seq_len", str(self.seq_len),
            "--training.local_batch_size", str(self.local_batch_size),
            "--training.disable_cuda_graphs",
            "--validator.no-enable",
            "--metrics.log_freq", "1",
        ]
        if self.seed is not None:  # None: torchtitan agrees on rank 0's seed itself
            args += ["--debug.seed", str(self.seed)]
        if self.checkpoint_interval:
            args += ["--checkpoint.enable", "--checkpoint.interval", str(self.checkpoint_interval)]
        return [*args, *self.extra]


@dataclass
class RankResult:
    """What one rank saw."""

    rank: int
    losses: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    default_collectives: int = -1
    windows: dict[str, dict[GroupKey, int]] = field(default_factory=dict)
    role_groups: dict[str, GroupKey] = field(default_factory=dict)
    default_group: GroupKey | None = None
    warnings: list[str] = field(default_factory=list)
    meshes: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached decisions between trainings that share one test world."""
    from commgroups.torch_internals import clear_dtensor_caches as clear

    clear()


def _default_sequence() -> int:
    # Gloo counts every collective (functional ones and barriers too) per group.
    return torch_private.sequence_number(torch_private.default_group())


def _mesh_facts(trainer: Any) -> dict[str, Any]:
    """For each 1-D mesh torchtitan holds: its ranks, whether it is the default group, its backend."""
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    default = torch_private.default_group()
    facts: dict[str, Any] = {}
    pd = trainer.parallel_dims
    for name, mesh in single_axis_meshes(pd).items():
        try:
            group = mesh.get_group()
        except Exception as error:  # a placeholder mesh without a group
            facts[name] = {"size": mesh.size(), "group": None, "error": type(error).__name__}
            continue
        facts[name] = {
            "size": mesh.size(),
            "ranks": dist.get_process_group_ranks(group),
            "default": group is default or group.group_name == default.group_name,
            "backend": str(dist.get_backend(group)),
        }
    return facts


_SPMD_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
})


class SpmdDistProbe:
    """Sits in front of the dist module spmd_types was given, recording each raw collective's group.

    The integration hands spmd_types an AsyncWaitDist; wrapping it (not replacing it) shows that
    spmd_types' collectives reach it, and on which group.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str | None, str]] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in _SPMD_COLLECTIVES or not callable(attribute):
            return attribute

        def probe(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            self.calls.append((name, None if group is None else group.group_name,
                               type(self.inner).__name__))
            return attribute(*args, **kwargs)

        return probe


def _registry_facts(trainer: Any) -> dict[str, Any]:
    """Which registry group each torchtitan mesh name is on, FSDP2 flatten, the async-and-wait comms."""
    from commgroups.integrations.torchtitan.titan_internals import single_axis_meshes

    registry = trainer.registry
    pd = trainer.parallel_dims
    facts: dict[str, Any] = {
        "roles": {r: registry.group(r).group_name for r in registry.role_names},
        "fsdp_async_wait_modules": trainer.fsdp_async_wait_modules,
    }
    mesh_roles = {}
    for name, mesh in single_axis_meshes(pd).items():
        if name in registry.role_names and mesh.size() > 1:
            mesh_roles[name] = mesh.get_group() is registry.group(name)
    facts["mesh_is_role_group"] = mesh_roles
    if pd.spmd_backend in ("spmd_types", "full_dtensor"):
        shard_cp = pd.get_optional_mesh(["dp_shard", "cp"])  # None where cp is 1
        if shard_cp is not None:
            flat = torch_private.flatten(shard_cp, "dp_shard_cp")
            facts["dp_shard_cp_is_fsdp"] = flat.get_group() is registry.group("fsdp")
    return facts


def _group_key(group: Any) -> GroupKey:
    return (group.group_name, tuple(dist.get_process_group_ranks(group)))


@contextlib.contextmanager
def _observed(trainer: Any, result: RankResult, tally: Tally) -> Iterator[None]:
    """Count DCP save/load and the timeout change in their own windows; record each grad norm.

    Process-local wrappers on this trainer's checkpointer and on torchtitan's module attributes
    (looked up at call time), removed on exit; installed files are never edited.
    """
    import torchtitan.distributed.utils as dist_utils

    checkpointer = trainer.checkpointer
    for name in ("dcp_save", "dcp_load"):
        method = getattr(checkpointer, name)

        def counted(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with tally.inside("checkpoint"):
                return _method(*args, **kwargs)

        setattr(checkpointer, name, counted)
    clip, timeouts = dist_utils.clip_grad_norm_, dist_utils.set_pg_timeouts

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        norm = clip(*args, **kwargs)
        result.grad_norms[trainer.step] = float(norm.item())  # exact: the float torchtitan logs
        return norm

    def set_pg_timeouts(*args: Any, **kwargs: Any) -> Any:
        with tally.inside("timeouts"):
            return timeouts(*args, **kwargs)

    dist_utils.clip_grad_norm_ = clip_grad_norm_
    if not hasattr(trainer, "registry"):
        dist_utils.set_pg_timeouts = set_pg_timeouts
    else:  # the registry trainer installs its own replacement while it trains
        own = trainer._set_pg_timeouts

        def registry_timeouts(*args: Any, **kwargs: Any) -> Any:
            with tally.inside("timeouts"):
                return own(*args, **kwargs)

        trainer._set_pg_timeouts = registry_timeouts
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_, dist_utils.set_pg_timeouts = clip, timeouts
        for name in ("dcp_save", "dcp_load", "_set_pg_timeouts"):
            with contextlib.suppress(AttributeError):
                delattr(checkpointer if name.startswith("dcp") else trainer, name)


class _CommgroupsWarnings(logging.Handler):
    """Collects the WARNING (and worse) messages of commgroups' loggers."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] == "commgroups":
            self.into.append(record.getMessage())


def train_rank(rank: int, world_size: int, post: Any, run: TitanRun) -> RankResult:
    """Train ``run`` on this rank; a :func:`run_local_world` rank function."""
    handler = _CommgroupsWarnings([])
    logging.getLogger("commgroups").addHandler(handler)
    try:
        result = _train_rank(rank, world_size, run)
    finally:
        logging.getLogger("commgroups").removeHandler(handler)
    result.warnings = handler.into
    return result


def _train_rank(rank: int, world_size: int, run: TitanRun) -> RankResult:
    if run.flight_recorder:
        return _train_rank_as_set(rank, world_size, run)
    from commgroups.flight_recorder.settings import ENV_VAR

    os.environ[ENV_VAR] = "0"
    try:
        return _train_rank_as_set(rank, world_size, run)
    finally:
        del os.environ[ENV_VAR]


def _train_rank_as_set(rank: int, world_size: int, run: TitanRun) -> RankResult:
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "HF_DATASETS_OFFLINE": "1",
                       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    apply_cpu_patches()
    clear_dtensor_caches()
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(run.args())
    result = RankResult(rank)
    result.default_group = _group_key(torch_private.default_group())
    if run.aligned_start:
        dist.barrier()  # before the count starts: not one of the training's collectives
    before = _default_sequence()
    tally = Tally()
    tally.start()
    started = time.monotonic()
    trainer = config.build()
    result.notes["build_seconds"] = time.monotonic() - started
    registry = getattr(trainer, "registry", None)
    try:
        force_sum_reduction(trainer.model_parts)
        original_log = trainer.metrics_processor.log

        marks: list[float] = []

        def log(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                extra_metrics: Any = None) -> None:
            marks.append(time.perf_counter())
            result.losses[step] = (global_avg_loss, global_max_loss, float(grad_norm))
            original_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

        trainer.metrics_processor.log = log
        result.meshes = _mesh_facts(trainer)
        probe = None
        if registry is not None:
            result.notes.update(_registry_facts(trainer))
            result.role_groups = {role: _group_key(registry.group(role))
                                  for role in registry.role_names}
            if trainer.parallel_dims.spmd_backend == "spmd_types":
                import spmd_types
                import spmd_types._dist

                probe = SpmdDistProbe(spmd_types._dist.dist)
                spmd_types.set_dist(probe)
        tally.switch("train")
        with _observed(trainer, result, tally):
            marks.append(time.perf_counter())
            if run.audit:
                # The user's switch: the variable the trainer reads (this rank process only).
                from commgroups.audit import AUDIT_DIR_ENV

                os.environ[AUDIT_DIR_ENV] = str(Path(run.dump_folder) / "audit")
                try:
                    trainer.train()
                finally:
                    del os.environ[AUDIT_DIR_ENV]
                result.notes["audit_dir"] = str(Path(run.dump_folder) / "audit")
            else:
                trainer.train()
            if run.step_times:
                result.notes["step_seconds"] = [b - a for a, b in itertools.pairwise(marks)]
        tally.stop()
        result.notes["train_seconds"] = time.monotonic() - started - result.notes["build_seconds"]
        result.windows = tally.windows
        result.default_collectives = _default_sequence() - before
        if probe is not None:
            import spmd_types

            spmd_types.set_dist(probe.inner)
            result.notes["spmd_calls"] = probe.calls
    finally:
        trainer.close()
    if registry is not None:
        result.notes["registry_closed"] = not registry.created
    return result
