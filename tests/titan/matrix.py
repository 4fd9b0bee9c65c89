"""The torchtitan isolation matrix: parallelism pairs (and triples), stock against commgroups.

Each :class:`Entry` is one parallelism configuration. A :class:`Job` is an entry under one spmd
backend: the tests ask for jobs, and one spawned world per world size trains every job of that
size in turn (start-up is the expensive part on CPU: :func:`world_rank`), each through commgroups
and then stock, with the same seed and command line but ``--module``; a ``scenario`` entry also
resumes each side from the other's checkpoint (:mod:`tests.titan.scenario`). :data:`CI_JOBS` is
the subset CI trains on every submission (``-m titan_ci``); ``make test-titan`` trains them all.
:func:`compare` then checks one entry:

- losses (average, max) and grad norms, as exact floats, equal stock's on every rank;
- commgroups puts 0 collectives on the default group (the whole training, building included);
- the checkpoint-metadata group carries collectives only inside DCP save/load (none at all in a
  run without checkpointing, some in one with it);
- every role torchtitan communicates on for this entry carried collectives, and outside
  checkpointing and the timeout change (building and training), the collectives per rank set
  equal stock's: the same number of collectives ran over the same ranks, so no reduction was
  merged onto another group (DTensor's layout-keyed flattening lookup) or split differently;
- no commgroups warning is said twice in one training.

Counts come from gloo's per-group sequence numbers (:mod:`tests.titan.counts`), not the audit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.titan.counts import GroupKey
from tests.titan.run import RankResult, TitanRun, train_rank

__all__ = ["BACKENDS", "CI_JOBS", "ENTRIES", "Entry", "Job", "compare", "entry", "job_param",
           "render", "world_rank"]

BACKENDS = ("partial_dtensor", "spmd_types", "full_dtensor")
"""Every spmd backend the matrix trains; an entry lists its own (:attr:`Entry.backends`)."""

CHECKPOINT_ROLE = "checkpoint-metadata"


@dataclass(frozen=True)
class Entry:
    """One configuration of the matrix (degrees of 1 are left at their defaults)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    model: str = "llama3"
    checkpoint: bool = True
    min_torch: tuple[int, int] = (2, 10)
    """Oldest torch stock torchtitan trains this entry on (below it the test skips)."""
    scenario: bool = False
    """Four trainings instead of two: commgroups and stock, then each resumed from the other's
    step-1 checkpoint (tests/test_torchtitan_train.py checks those)."""
    in_matrix: bool = True
    """Checked by the matrix test (False: trained only for another test's checks)."""
    backends: tuple[str, ...] = ("partial_dtensor", "spmd_types")
    """The spmd backends the matrix trains this entry under (full_dtensor, torchtitan 0.3.0's
    third backend, only on the few entries that show its meshes)."""

    def __post_init__(self) -> None:
        assert self.checkpoint or not self.scenario, f"{self.name}: a scenario resumes: checkpoint"

    @property
    def world_size(self) -> int:
        """Ranks the entry needs."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def run(self, root: Path, assets: Path, spmd_backend: str, registry: bool) -> TitanRun:
        """The TitanRun of this entry (commgroups or stock)."""
        return TitanRun(
            dump_folder=str(root / self.name / spmd_backend / ("registry" if registry else "stock")),
            assets=str(assets), model=self.model, registry=registry, cp=self.cp,
            dp_shard=self.dp_shard, tp=self.tp, ep=self.ep, dp_replicate=self.dp_replicate,
            pp=self.pp, spmd_backend=spmd_backend, steps=2,
            checkpoint_interval=1 if self.checkpoint else 0,
            # The fewest tokens that still train every configuration (start-up and tokens are the
            # cost on CPU; the checks need no more): CP needs a multiple of cp * 128, a pipeline
            # of 2 stages 2 microbatches.
            seq_len=128 * self.cp, local_batch_size=2 if self.pp > 1 else 1,
        )

    def busy_roles(self, spmd_backend: str) -> set[str]:
        """Roles torchtitan must communicate on in this entry (others may stay idle)."""
        roles = {dim for dim in ("dp_replicate", "cp", "tp", "pp") if getattr(self, dim) > 1}
        if spmd_backend in ("spmd_types", "full_dtensor") and self.cp == 1 and self.dp_shard > 1:
            roles.add("dp_shard")  # FSDP2 shards over dp_shard itself (no dp_shard x cp flatten)
        elif self.dp_shard * self.cp > 1:
            roles.add("fsdp")
        if self.dp_replicate * self.dp_shard * self.cp > 1:
            roles.add("loss")
        if self.ep > 1:
            roles |= {"ep", "efsdp"}
        return roles


ENTRIES: tuple[Entry, ...] = (
    # Pairs on 4 ranks: every two of dp_replicate, dp_shard, cp, tp, pp; tp mixed with each.
    # full_dtensor on three of them: HSDP (FSDP2 concatenates dp_replicate and dp_shard), FSDP2's
    # own dp_shard x cp flatten beside CP on its own axis, and FSDP x TP.
    Entry("dpr2-dps2", dp_replicate=2, dp_shard=2, backends=BACKENDS),
    Entry("dpr2-cp2", dp_replicate=2, cp=2, checkpoint=False),
    Entry("dpr2-tp2", dp_replicate=2, tp=2),
    # cp = world (the seed bug's layout) is also the resume scenario (CI time: dp_shard x cp resumed
    # and cross-loaded too until its 2 extra trainings, about 40 s, had to go).
    Entry("dps2-cp2", dp_shard=2, cp=2, backends=BACKENDS),
    Entry("cp4", cp=4, scenario=True),
    Entry("dps2-tp2", dp_shard=2, tp=2, checkpoint=False, backends=BACKENDS),
    Entry("cp2-tp2", cp=2, tp=2),
    # torchtitan 0.3.0 calls pipelining's step(arg_mbs=, kwarg_mbs=, target_mbs=), which torch
    # has from 2.14: on 2.13 stock fails before step 1 ("Expecting 2 arg_mbs but got 1").
    Entry("pp2-dpr2", pp=2, dp_replicate=2, checkpoint=False, min_torch=(2, 14)),
    Entry("pp2-dps2", pp=2, dp_shard=2, min_torch=(2, 14)),
    Entry("pp2-cp2", pp=2, cp=2, min_torch=(2, 14)),
    Entry("pp2-tp2", pp=2, tp=2, checkpoint=False, min_torch=(2, 14)),
    # Expert parallelism on the MoE debug model (qwen3, tests/titan/configs.py), mixed with tp, and
    # alone (efsdp x ep from the registry's view: tests/test_torchtitan_train.py checks its losses
    # and meshes). The experts' grad norm is one collective per step, as
    # stock's (DTensor merges efsdp x ep onto the efsdp_ep role; stock onto its world group).
    Entry("moe-dps4-ep2", dp_shard=4, ep=2, model="moe", checkpoint=False),
    Entry("moe-dps2-tp2-ep2", dp_shard=2, tp=2, ep=2, model="moe"),
    # A triple on 8 ranks.
    Entry("dps2-cp2-tp2", dp_shard=2, cp=2, tp=2),
)


def entry(name: str) -> Entry:
    """The entry called ``name``."""
    found = [e for e in ENTRIES if e.name == name]
    assert len(found) == 1, f"no entry {name!r}"
    return found[0]


@dataclass(frozen=True)
class Job:
    """An entry trained under one spmd backend: what a test asks a world for."""

    entry: Entry
    backend: str

    @property
    def id(self) -> str:
        """The test id: ``<entry>-<backend>``."""
        return f"{self.entry.name}-{self.backend}"

    def skip_reason(self, torch_version: tuple[int, int]) -> str | None:
        """Why stock torchtitan cannot train this job on ``torch_version`` (None: it can)."""
        if self.backend == "spmd_types" and torch_version < (2, 14):
            return (f"torchtitan's spmd_types backend needs torch >= 2.14 (this is "
                    f"{'.'.join(map(str, torch_version))}); partial_dtensor runs here")
        if self.entry.min_torch > torch_version:
            return (f"stock torchtitan needs torch >= {self.entry.min_torch} for {self.entry.name} "
                    f"(this is {'.'.join(map(str, torch_version))}; see tests/titan/matrix.py)")
        return None


def world_rank(rank: int, world_size: int, post: Any, jobs: tuple[Job, ...], root: str,
               assets: str) -> dict[str, dict[str, Any]]:
    """Train every job on this rank (commgroups first, then stock; a scenario entry then resumes
    each from the other's checkpoint); job id -> run name -> result. The spmd backend is a
    command-line option of each training, so one world trains jobs of every backend."""
    from tests.titan.scenario import scenario_rank

    results: dict[str, dict[str, Any]] = {}
    for job in jobs:
        entry, spmd_backend = job.entry, job.backend
        if entry.scenario:
            base = entry.run(Path(root), Path(assets), spmd_backend, registry=True)
            base = dataclasses.replace(base, dump_folder=str(Path(root) / entry.name / spmd_backend))
            results[job.id] = scenario_rank(rank, world_size, post, base)
            continue
        results[job.id] = {}
        for registry in (True, False):
            run = entry.run(Path(root), Path(assets), spmd_backend, registry)
            started = time.monotonic()
            result = train_rank(rank, world_size, post, run)
            result.notes["seconds"] = time.monotonic() - started
            results[job.id]["registry" if registry else "stock"] = result
    return results


def _by_ranks(counts: dict[GroupKey, int], leave_out: set[str]) -> dict[tuple[int, ...], int]:
    """Collectives per rank set (groups of one rank move nothing between ranks)."""
    totals: dict[tuple[int, ...], int] = {}
    for (name, ranks), count in counts.items():
        if name in leave_out or len(ranks) < 2:
            continue
        totals[ranks] = totals.get(ranks, 0) + count
    return totals


def compare(entry: Entry, registry: list[RankResult], stock: list[RankResult],
            spmd_backend: str) -> list[str]:
    """Every way commgroups' run of ``entry`` differs from stock's, or breaks isolation."""
    problems: list[str] = []
    for rank, (ours, theirs) in enumerate(zip(registry, stock)):
        where = f"{entry.name} rank {rank}"
        if not theirs.losses or not theirs.grad_norms:
            problems.append(f"{where}: stock logged no loss or grad norm")
        if ours.losses != theirs.losses:
            problems.append(f"{where}: losses {ours.losses!r} != stock {theirs.losses!r}")
        if ours.grad_norms != theirs.grad_norms:
            problems.append(f"{where}: grad norms {ours.grad_norms!r} != stock "
                            f"{theirs.grad_norms!r}")
        if ours.default_collectives != 0:
            problems.append(f"{where}: {ours.default_collectives} collectives on the default group")
        checkpoint_group = ours.role_groups[CHECKPOINT_ROLE]
        outside = sum(ours.windows.get(w, {}).get(checkpoint_group, 0)
                      for w in ("build", "train", "timeouts"))
        inside = ours.windows.get("checkpoint", {}).get(checkpoint_group, 0)
        if outside:
            problems.append(f"{where}: checkpoint-metadata carried {outside} collectives outside "
                            "DCP save/load")
        if entry.checkpoint and not inside:
            problems.append(f"{where}: checkpoint-metadata carried nothing during DCP save/load")
        if not entry.checkpoint and inside:
            problems.append(f"{where}: DCP ran without checkpointing ({inside} collectives)")
        trained = ours.windows.get("train", {})
        for role in sorted(entry.busy_roles(spmd_backend)):
            if not trained.get(ours.role_groups[role], 0):
                problems.append(f"{where}: role {role!r} carried no collective while training")
        for window in ("build", "train"):
            mine = _by_ranks(ours.windows.get(window, {}), {checkpoint_group[0]})
            reference = _by_ranks(theirs.windows.get(window, {}), set())
            if mine != reference:
                problems.append(f"{where}: collectives per rank set ({window}) {mine} != stock "
                                f"{reference}")
        repeated = sorted({m for m in ours.warnings if ours.warnings.count(m) > 1})
        if repeated:
            problems.append(f"{where}: commgroups warnings said more than once: {repeated}")
    return problems


def role_counts(result: RankResult) -> dict[str, dict[str, int]]:
    """Role -> window -> collectives on that role's group (commgroups runs)."""
    return {role: {w: counts.get(key, 0) for w, counts in result.windows.items()}
            for role, key in result.role_groups.items()}


def render(entry: Entry, registry: list[RankResult], stock: list[RankResult]) -> str:
    """A report of one entry: every loss and grad norm (repr) and the per-role counts of rank 0."""
    lines = [f"== {entry.name} (world {entry.world_size}, checkpoint {entry.checkpoint}): "
             f"commgroups {registry[0].notes['seconds']:.0f}s, stock {stock[0].notes['seconds']:.0f}s"]
    for rank, (ours, theirs) in enumerate(zip(registry, stock)):
        for step in sorted(theirs.grad_norms):
            lines.append(
                f"  rank {rank} step {step}: loss {ours.losses.get(step)!r} stock "
                f"{theirs.losses.get(step)!r}; grad norm {ours.grad_norms.get(step)!r} stock "
                f"{theirs.grad_norms[step]!r}")
    counts = role_counts(registry[0])
    shown = ", ".join(f"{role} {dict(sorted((w, n) for w, n in c.items() if n))}"
                      for role, c in counts.items())
    lines.append(f"  rank 0 collectives per role: {shown}")
    lines.append(f"  default group: commgroups {[r.default_collectives for r in registry]}, stock "
                 f"{[r.default_collectives for r in stock]}")
    return "\n".join(lines)


CI_JOBS: tuple[str, ...] = (
    # cp == world under partial_dtensor, the resume scenario: DeviceMesh would hand back the
    # default group for cp and for fsdp (dp_shard x cp); a stock checkpoint resumes through
    # commgroups and back; checkpoint metadata only inside DCP.
    "cp4-partial_dtensor",
    # full_dtensor (the registry's 5-D dense mesh, FSDP2's dp_shard_cp flatten) with FSDP x TP:
    # the grad-norm reduction DTensor merges over two dims, found by layout.
    "dps2-tp2-full_dtensor",
    # HSDP: FSDP2's replica all-reduce, a blocking call it has no hook for, run inside the
    # trainer's async-and-wait scope on the dp_replicate role.
    "dpr2-dps2-partial_dtensor",
    # Expert parallelism: the experts' grad norm merged over efsdp x ep (the efsdp_ep view role).
    "moe-dps4-ep2-partial_dtensor",
    # spmd_types with cp == world, the seed bug's own path (torch >= 2.14: CI's newest leg).
    "cp4-spmd_types",
)
"""The jobs CI trains on every submission (``pytest -m titan_ci``): each spmd backend once, each
isolation hazard once, one resume (``make test-titan`` trains every job before a release)."""


def job_param(job: Job) -> Any:
    """``job`` as a test parameter: its id, marked ``titan_ci`` where it is one of :data:`CI_JOBS`."""
    import pytest

    return pytest.param(job, marks=[pytest.mark.titan_ci] if job.id in CI_JOBS else [], id=job.id)
