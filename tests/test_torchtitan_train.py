"""torchtitan trains through the registry: same losses as stock, nothing on the default group.

One 4-rank CPU gloo world per configuration runs four trainings (tests/titan/scenario.py): through
commgroups, stock, commgroups resuming from stock's step-2 checkpoint, stock resuming from
commgroups' step-2 checkpoint. torchtitan's llama3 debug model, 4 steps, checkpoint every 2,
``--debug.seed``. Skipped only when torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from commgroups.local_world import run_local_world

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    # A world trains four times (minutes on 2 shared cores); the worlds have their own deadline.
    pytest.mark.timeout(1800),
    # torchtitan trainings against stock run beside the matrix (`make test-titan`, CI's torchtitan
    # step), not in `make test`: they take most of a 2-core machine's quarter hour.
    pytest.mark.titan_matrix,
]

SINGLE_RANK_BACKEND = "cg_single"
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
CONFIGS = {
    # name: (spmd_backend, dp_shard, cp)
    "spmd_types-cp4": ("spmd_types", 1, 4),
    "partial_dtensor-cp4": ("partial_dtensor", 1, 4),
    "partial_dtensor-dp2cp2": ("partial_dtensor", 2, 2),
}


@pytest.fixture(scope="session")
def titan_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.titan.assets import make_assets

    root = tmp_path_factory.mktemp("titan-assets")
    make_assets(root)
    return root


def _run_scenario(name: str, root: Path, assets: Path) -> dict[str, list[Any]]:
    from tests.titan.run import TitanRun
    from tests.titan.scenario import RUN_NAMES, scenario_rank

    backend, dp_shard, cp = CONFIGS[name]
    base = TitanRun(dump_folder=str(root), assets=str(assets), cp=cp, dp_shard=dp_shard,
                    spmd_backend=backend)
    started = time.monotonic()
    reports = run_local_world(scenario_rank, 4, base, timeout_s=1500,
                              preload=("torch", "torch.distributed", "commgroups"))
    failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    assert sorted(reports) == [0, 1, 2, 3], f"ranks missing: {sorted(reports)}"
    by_run = {run: [reports[r].value[run] for r in range(4)] for run in RUN_NAMES}
    print(f"\n{name}: world took {time.monotonic() - started:.1f}s; per run (rank 0): " + ", ".join(
        f"{run} {by_run[run][0].notes['seconds']:.1f}s" for run in RUN_NAMES))
    return by_run


@pytest.fixture(scope="module", params=list(CONFIGS))
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             titan_assets: Path) -> tuple[str, dict[str, list[Any]], Path]:
    name = request.param
    if CONFIGS[name][0] == "spmd_types" and TORCH < (2, 14):
        pytest.skip(f"torchtitan's spmd_types backend needs torch >= 2.14 (this is "
                    f"{torch.__version__}); the newest-torch CI leg runs it")
    root = tmp_path_factory.mktemp(name)
    return name, _run_scenario(name, root, titan_assets), root


def test_losses_identical_to_stock(scenario: tuple[str, dict[str, list[Any]], Path]) -> None:
    _, runs, _ = scenario
    stock, registry = runs["stock"], runs["registry"]
    assert sorted(stock[0].losses) == [1, 2, 3, 4]
    for rank in range(4):
        assert registry[rank].losses == stock[rank].losses  # bitwise: loss, max loss, grad norm


def test_default_group_idle_through_commgroups(
        scenario: tuple[str, dict[str, list[Any]], Path]) -> None:
    _, runs, _ = scenario
    counts = [r.default_collectives for r in runs["registry"]]
    stock = [r.default_collectives for r in runs["stock"]]
    print(f"default-group collectives per rank: commgroups {counts}, stock {stock}")
    assert counts == [0, 0, 0, 0]
    assert min(stock) >= 100  # stock keeps cp, fsdp, the loss and DCP on the default group


def test_every_mesh_is_a_registry_group(scenario: tuple[str, dict[str, list[Any]], Path]) -> None:
    name, runs, _ = scenario
    for result in runs["registry"]:
        for mesh_name, facts in result.meshes.items():
            assert not facts.get("default"), (mesh_name, facts)
            if facts["size"] == 1 and facts.get("group", True) is not None:
                # A size-1 dim costs no communicator: the single-rank backend, exact and local.
                assert facts["backend"] == SINGLE_RANK_BACKEND, (mesh_name, facts)
        assert all(result.notes["mesh_is_role_group"].values()), result.notes["mesh_is_role_group"]
        assert result.notes["fsdp_async_wait_modules"] > 0
        assert result.notes["registry_closed"]
        if CONFIGS[name][0] == "spmd_types":
            assert result.notes["dp_shard_cp_is_fsdp"]  # FSDP2's own _flatten("dp_shard_cp")
            # Every raw spmd_types collective reached the AsyncWaitDist, on the cp role's group.
            calls = result.notes["spmd_calls"]
            assert calls, "spmd_types issued no raw collective"
            assert {group for _, group, _ in calls} == {result.notes["roles"]["cp"]}
            assert {inner for _, _, inner in calls} == {"AsyncWaitDist"}
    # Stock puts at least one of them on the default group (that is the bug).
    assert any(f.get("default") for f in runs["stock"][0].meshes.values())


def test_resume_and_checkpoints_cross_load(
        scenario: tuple[str, dict[str, list[Any]], Path]) -> None:
    _, runs, _ = scenario
    for rank in range(4):
        uninterrupted = runs["stock"][rank].losses
        # commgroups resumed from stock's step-2 checkpoint: steps 3-4 as if never interrupted.
        assert runs["registry_resume"][rank].losses == {s: uninterrupted[s] for s in (3, 4)}
        # stock resumed from commgroups' step-2 checkpoint.
        assert runs["stock_resume"][rank].losses == {s: uninterrupted[s] for s in (3, 4)}


def test_audit_is_one_switch(scenario: tuple[str, dict[str, list[Any]], Path]) -> None:
    """Launched with COMMGROUPS_AUDIT_DIR (no code change): every rank wrote its file over real
    steps (flex attention, CP, FSDP2, DCP load), and ``commgroups audit DIR`` merges them."""
    import subprocess
    import sys

    import commgroups as cg

    _, runs, _ = scenario
    directory = Path(runs["registry_resume"][0].notes["audit_dir"])
    assert sorted(p.name for p in directory.iterdir()) == [
        cg.audit.rank_file_name(rank) for rank in range(4)]
    report = cg.audit.merge_dir(directory)
    assert report.ranks == (0, 1, 2, 3)
    groups = report.summary["groups"]
    assert sum(g["calls"] for g in groups.values()) > 40
    assert not any(g["default"] and g["calls"] for g in groups.values()), groups
    assert {"cp", "fsdp", "loss"} <= {role for g in groups.values() for role in g["roles"]}
    assert [h.message for h in report.hazards if h.severity == "error"] == []
    shown = subprocess.run([sys.executable, "-m", "commgroups", "audit", str(directory)],
                           capture_output=True, text=True, check=False)
    print(shown.stdout)
    assert shown.stdout.startswith("audit: 4 rank file(s), world size 4")


def test_checkpoints_bitwise_equal(scenario: tuple[str, dict[str, list[Any]], Path],
                                   tmp_path: Path) -> None:
    """The same step saved through commgroups and by stock holds the same tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, _, root = scenario
    loaded = {}
    for run in ("stock", "registry"):
        out = tmp_path / f"{run}.pt"
        dcp_to_torch_save(root / run / "checkpoint" / "step-2", out)
        loaded[run] = torch.load(out, weights_only=False)

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix: tree}

    stock, registry = flat(loaded["stock"]), flat(loaded["registry"])
    assert stock.keys() == registry.keys()
    tensors = [k for k, v in stock.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 10
    for key in tensors:
        assert torch.equal(stock[key], registry[key]), key


def test_moe_expert_parallel_equals_stock(titan_assets: Path, tmp_path: Path) -> None:
    """torchtitan's MoE debug model (qwen3), ep=2 on 4 ranks: efsdp x ep from the registry's view."""
    from tests.titan.run import TitanRun
    from tests.titan.scenario import pair_rank

    base = TitanRun(dump_folder=str(tmp_path), assets=str(titan_assets), model="moe",
                    dp_shard=4, ep=2, spmd_backend="partial_dtensor", checkpoint_interval=0,
                    seq_len=256, steps=2)
    started = time.monotonic()
    reports = run_local_world(pair_rank, 4, base, timeout_s=1500,
                              preload=("torch", "torch.distributed", "commgroups"))
    failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    print(f"\nmoe ep=2: world took {time.monotonic() - started:.1f}s")
    for rank in range(4):
        registry, stock = reports[rank].value["registry"], reports[rank].value["stock"]
        assert sorted(stock.losses) == [1, 2]
        assert registry.losses == stock.losses
        assert registry.default_collectives == 0 and stock.default_collectives > 0
        for name in ("ep", "efsdp"):
            assert not registry.meshes[name]["default"]
            assert registry.notes["mesh_is_role_group"][name]  # the registry's ep / efsdp role
        assert registry.meshes["ep"]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert registry.meshes["efsdp"]["ranks"] == [rank % 2, rank % 2 + 2]
        assert not any(m.get("default") for m in registry.meshes.values())
