"""torchtitan trains through the registry: same losses as stock, nothing on the default group.

The resume scenarios are matrix entries (tests/titan/matrix.py, ``scenario=True``) trained in the
matrix's shared worlds (tests/titan/worlds.py): on 4 CPU gloo ranks, through commgroups, stock,
commgroups resuming from stock's step-1 checkpoint, stock resuming from commgroups' step-1
checkpoint (tests/titan/scenario.py). torchtitan's llama3 debug model, 2 steps, a checkpoint each
step, ``--debug.seed``, one sequence of ``128 * cp`` tokens per rank. Skipped only when torchtitan is
not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    # The worlds have their own deadline; the first test of a world waits for all of its trainings.
    pytest.mark.timeout(3600),
    # torchtitan trainings against stock run beside the matrix (`make test-titan`, CI's torchtitan
    # step), not in `make test`: they take most of a 2-core machine's quarter hour.
    pytest.mark.titan_matrix,
    pytest.mark.world,
]

SINGLE_RANK_BACKEND = "cg_single"
# (entry, spmd backend); the newest CI leg runs the first (-k spmd_types): the seed bug's path.
# full_dtensor (torchtitan 0.3.0; runs on torch 2.13) resumes and cross-loads like the others.
SCENARIOS = (("cp4", "spmd_types"), ("cp4", "partial_dtensor"), ("cp4", "full_dtensor"))


def _jobs(pairs: tuple[tuple[str, str], ...]) -> list[Any]:
    if importlib.util.find_spec("torchtitan") is None:
        return []
    from tests.titan.matrix import Job, entry, job_param

    return [job_param(Job(entry(name), backend)) for name, backend in pairs]


@pytest.fixture(scope="module", params=_jobs(SCENARIOS))
def scenario(request: pytest.FixtureRequest, titan_worlds: Any) -> tuple[Any, Any]:
    job = request.param
    done = titan_worlds.runs(job)
    print(f"\n{job.id}: world took {done.world_seconds:.1f}s; per run (rank 0): " + ", ".join(
        f"{run} {results[0].notes['seconds']:.1f}s" for run, results in done.runs.items()))
    return job, done


def _steps(job: Any) -> tuple[list[int], list[int]]:
    """(every step, the steps a resumed run trains)."""
    from tests.titan.scenario import resume_step

    base = job.entry.run(Path("."), Path("."), job.backend, registry=True)
    return list(range(1, base.steps + 1)), list(range(resume_step(base) + 1, base.steps + 1))


def test_losses_identical_to_stock(scenario: tuple[Any, Any]) -> None:
    job, done = scenario
    runs = done.runs
    stock, registry = runs["stock"], runs["registry"]
    assert sorted(stock[0].losses) == _steps(job)[0]
    for rank in range(4):
        assert registry[rank].losses == stock[rank].losses  # bitwise: loss, max loss, grad norm


def test_default_group_idle_through_commgroups(scenario: tuple[Any, Any]) -> None:
    _, done = scenario
    runs = done.runs
    counts = [r.default_collectives for r in runs["registry"]]
    stock = [r.default_collectives for r in runs["stock"]]
    print(f"default-group collectives per rank: commgroups {counts}, stock {stock}")
    assert counts == [0, 0, 0, 0]
    # Stock keeps cp, fsdp and the loss (training) and DCP (checkpointing) on the default group.
    for result in runs["stock"]:
        for window in ("train", "checkpoint"):
            assert result.windows[window].get(result.default_group, 0) > 0, (window, result.windows)


def test_every_mesh_is_a_registry_group(scenario: tuple[Any, Any]) -> None:
    job, done = scenario
    runs = done.runs
    for result in runs["registry"]:
        for mesh_name, facts in result.meshes.items():
            assert not facts.get("default"), (mesh_name, facts)
            if facts["size"] == 1 and facts.get("group", True) is not None:
                # A size-1 dim costs no communicator: the single-rank backend, exact and local.
                assert facts["backend"] == SINGLE_RANK_BACKEND, (mesh_name, facts)
        assert all(result.notes["mesh_is_role_group"].values()), result.notes["mesh_is_role_group"]
        assert result.notes["fsdp_async_wait_modules"] > 0
        assert result.notes["registry_closed"]
        if job.backend in ("spmd_types", "full_dtensor"):
            assert result.notes["dp_shard_cp_is_fsdp"]  # FSDP2's own _flatten("dp_shard_cp")
        if job.backend == "spmd_types":
            # Every raw spmd_types collective reached the AsyncWaitDist, on the cp role's group.
            calls = result.notes["spmd_calls"]
            assert calls, "spmd_types issued no raw collective"
            assert {group for _, group, _ in calls} == {result.notes["roles"]["cp"]}
            assert {inner for _, _, inner in calls} == {"AsyncWaitDist"}
    # Stock puts at least one of them on the default group (that is the bug).
    assert any(f.get("default") for f in runs["stock"][0].meshes.values())


def test_resume_and_checkpoints_cross_load(scenario: tuple[Any, Any]) -> None:
    job, done = scenario
    runs = done.runs
    resumed = _steps(job)[1]
    assert resumed
    for rank in range(4):
        uninterrupted = runs["stock"][rank].losses
        # commgroups resumed from stock's step-1 checkpoint: the rest as if never interrupted.
        assert runs["registry_resume"][rank].losses == {s: uninterrupted[s] for s in resumed}
        # stock resumed from commgroups' step-1 checkpoint.
        assert runs["stock_resume"][rank].losses == {s: uninterrupted[s] for s in resumed}


def test_audit_is_one_switch(scenario: tuple[Any, Any]) -> None:
    """Launched with COMMGROUPS_AUDIT_DIR (no code change): every rank wrote its file over real
    steps (flex attention, CP, FSDP2, DCP load), and ``commgroups audit DIR`` merges them."""
    import subprocess
    import sys

    import commgroups as cg

    _, done = scenario
    directory = Path(done.runs["registry_resume"][0].notes["audit_dir"])
    assert sorted(p.name for p in directory.iterdir()) == [
        cg.audit.rank_file_name(rank) for rank in range(4)]
    report = cg.audit.merge_dir(directory)
    assert report.ranks == (0, 1, 2, 3)
    groups = report.summary["groups"]
    assert sum(g["calls"] for g in groups.values()) > 40
    assert not any(g["default"] and g["calls"] for g in groups.values()), groups
    assert {"cp", "fsdp", "loss"} <= {role for g in groups.values() for role in g["roles"]}
    assert [h.message for h in report.hazards if h.severity == "error"] == []
    # CP all-gathers FlexAttention's K/V inside a custom op: recorded, not only counted by gloo.
    assert [h.message for h in report.hazards if h.kind == "uncounted" and "cp" in h.roles] == []
    shown = subprocess.run([sys.executable, "-m", "commgroups", "audit", str(directory)],
                           capture_output=True, text=True, check=False)
    print(shown.stdout)
    assert shown.stdout.startswith("audit: 4 rank file(s), world size 4")


def test_checkpoints_bitwise_equal(scenario: tuple[Any, Any], tmp_path: Path) -> None:
    """The same step saved through commgroups and by stock holds the same tensors: the step the
    resumed runs loaded (model, optimizer, data loader) and the last (model only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    job, done = scenario
    root = done.folder

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix: tree}

    steps, resumed = _steps(job)
    for step in (resumed[0] - 1, steps[-1]):
        loaded = {}
        for run in ("stock", "registry"):
            out = tmp_path / f"{run}-{step}.pt"
            dcp_to_torch_save(root / run / "checkpoint" / f"step-{step}", out)
            loaded[run] = flat(torch.load(out, weights_only=False))
        stock, registry = loaded["stock"], loaded["registry"]
        assert stock.keys() == registry.keys(), step
        tensors = [k for k, v in stock.items() if isinstance(v, torch.Tensor)]
        assert len(tensors) > 10, step
        for key in tensors:
            assert torch.equal(stock[key], registry[key]), (step, key)


@pytest.mark.parametrize("job", _jobs((("moe-dps4-ep2", "partial_dtensor"),)))
def test_moe_expert_parallel_equals_stock(job: Any, titan_worlds: Any) -> None:
    """torchtitan's MoE debug model (qwen3), ep=2 on 4 ranks: efsdp x ep from the registry's view."""
    runs = titan_worlds.runs(job).runs
    for rank in range(4):
        registry, stock = runs["registry"][rank], runs["stock"][rank]
        assert sorted(stock.losses) == [1, 2]
        assert registry.losses == stock.losses
        assert registry.default_collectives == 0 and stock.default_collectives > 0
        for name in ("ep", "efsdp"):
            assert not registry.meshes[name]["default"]
            assert registry.notes["mesh_is_role_group"][name]  # the registry's ep / efsdp role
        assert registry.meshes["ep"]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert registry.meshes["efsdp"]["ranks"] == [rank % 2, rank % 2 + 2]
        assert not any(m.get("default") for m in registry.meshes.values())
