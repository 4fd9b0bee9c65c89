"""The audit: records every collective (our wrapper, FSDP2, DCP, spmd_types) and names the hazards.

One real 4-rank gloo world runs three scenarios, each writing per-rank files the parent merges:
the seed's layout built the plain DeviceMesh way (flagged), the same layout through a registry
(clean), and ranks that recorded different sequences (flagged).

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_audit.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import commgroups as cg
from commgroups.audit import AUDIT_DIR_ENV
from commgroups.cli import main
from tests import torch_private
from tests.test_audit import SEED
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _train_step(model: nn.Module, rank: int) -> float:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    loss = model(x).sum()
    loss.backward()
    return float(loss.detach())


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _plain_device_mesh(rank: int, directory: str) -> dict[str, Any]:
    """The seed's layout the plain way: cp == world, so DeviceMesh hands back the default group."""
    import spmd_types as spmd
    from spmd_types.types import R, V
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp_shard", "cp"))
    fsdp_mesh = torch_private.flatten(mesh["dp_shard", "cp"])
    cp = mesh.get_group("cp")
    roles = {"cp": cp, "fsdp": fsdp_mesh.get_group()}
    model = _shard(_model(), fsdp_mesh)
    with cg.audit.from_env(roles, environ={AUDIT_DIR_ENV: directory}) as rec:
        assert rec is not None
        loss = _train_step(model, rank)  # FSDP2: blocking all-gathers / reduce-scatters (torch 2.13)
        spmd.all_gather(torch.ones(2) * rank, cp, src=V, dst=R)  # spmd_types CP: blocking
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(2), group=cp, async_op=True).wait()
    return {"cp_is_default": cp is torch_private.default_group(),
            "local": [h.kind for h in rec.hazards()], "loss": loss}


def _registry_layout(rank: int) -> dict[str, Any]:
    """The same layout through a registry: dedicated groups, everything async-and-wait."""
    import spmd_types as spmd
    import torch.distributed.checkpoint as dcp
    from spmd_types.types import R, V

    registry = cg.GroupRegistry(cg.load_layout(SEED)).create()
    try:
        model = _shard(_model(), registry.device_mesh("fsdp"))
        cp = registry.collectives("cp")
        # COMMGROUPS_AUDIT_DIR comes from the launcher (run_world's env): the whole-run switch
        with cg.audit.from_env(registry) as rec:
            assert rec is not None
            with cg.async_and_wait_scope():  # FSDP2 issues blocking collectives: make them async-and-wait
                loss = _train_step(model, rank)
            spmd.set_dist(cg.AsyncWaitDist())
            try:
                spmd.all_gather(torch.ones(2) * rank, registry.group("cp"), src=V, dst=R)
            finally:
                spmd.set_dist(None)
            out = torch.empty(8)
            cp.all_gather_into_tensor(out, torch.ones(2))
            work = cp.all_reduce(torch.ones(3), async_op=True)
            work.wait()
            checkpoint = Path(os.environ[AUDIT_DIR_ENV]).parent / "registry-ckpt"
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(checkpoint),
                     process_group=registry.group("checkpoint-metadata"))
        return {"local": [h.kind for h in rec.hazards()], "loss": loss,
                "groups": {role: registry.group(role).group_name for role in registry.role_names}}
    finally:
        registry.close()


def _mismatched(rank: int, directory: str) -> str:
    """Rank 3 starts recording one call late: the group's sequences differ across ranks."""
    registry = cg.GroupRegistry(cg.load_layout(SEED)).create()
    try:
        cp = registry.collectives("cp")
        if rank == 3:
            cp.all_reduce(torch.ones(4))
        with cg.audit.record(registry) as rec:
            if rank != 3:
                cp.all_reduce(torch.ones(4))
            cp.all_gather_into_tensor(torch.empty(8), torch.ones(2))
        rec.write(directory)
        return registry.group("cp").group_name
    finally:
        registry.close()


def _inside_custom_ops(rank: int) -> dict[str, Any]:
    """torch's context parallel all-gathers FlexAttention's K/V inside a custom op
    (``cplib::flex_cp_allgather``, and reduce-scatters the gradients in its backward op): the
    collectives in their bodies are recorded, not only counted by gloo."""
    # Importing it registers the cplib ops.
    torch_private.cp_custom_ops()

    registry = cg.GroupRegistry(cg.load_layout(SEED)).create()
    try:
        name = registry.group("cp").group_name
        k, v = (torch.ones(1, 2, 4, 4, requires_grad=True) * rank for _ in range(2))
        with cg.audit.record(registry) as rec:
            full_k, full_v = torch.ops.cplib.flex_cp_allgather(k, v, 2, name)
            torch.ops.cplib.flex_cp_allgather_backward(full_k, full_v, 2, name)
        return {"ops": [(r.op, r.roles) for r in rec.records],
                "hazards": [h.kind for h in rec.hazards()], "gathered": full_k.shape[2]}
    finally:
        registry.close()


def _audit_world(rank: int, world: int, plain: str, mismatch: str) -> dict[str, Any]:
    return {"plain": _plain_device_mesh(rank, plain), "registry": _registry_layout(rank),
            "mismatch_group": _mismatched(rank, mismatch), "custom_ops": _inside_custom_ops(rank)}


@pytest.fixture(scope="module")
def audit_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 4-rank gloo world; returns the per-rank results and the three audit directories."""
    pytest.importorskip("spmd_types")
    base = tmp_path_factory.mktemp("audit")
    dirs = {name: base / name for name in ("plain", "registry", "mismatch")}
    results = run_world(_audit_world, 4, str(dirs["plain"]), str(dirs["mismatch"]),
                        env={AUDIT_DIR_ENV: str(dirs["registry"])}, timeout=240)
    return {"results": results, **dirs}


# ------------------------------------------------------------------------------- the world
def test_plain_device_mesh_seed_layout_is_flagged(audit_run: dict[str, Any]) -> None:
    assert all(r["plain"]["cp_is_default"] for r in audit_run["results"])
    report = cg.audit.merge_dir(audit_run["plain"])
    assert report.ranks == (0, 1, 2, 3) and not report.ok
    kinds = {h.kind: h for h in report.hazards}
    aliasing = kinds["aliasing"]
    assert aliasing.group == "0" and set(aliasing.roles) == {"cp", "fsdp"}
    assert aliasing.ranks == (0, 1, 2, 3)
    streams = kinds["mixed_streams"]
    assert streams.group == "0" and streams.severity == "warning"  # latent on gloo
    assert streams.details["streams"].keys() == {"cpu", "group:0"}
    assert "c10d._allgather_base_" in streams.details["blocking_ops"]
    assert streams.details["async"] > 0  # FSDP2's collectives were seen
    # blocking callers: spmd_types' CP all-gather, and FSDP2 itself (torch 2.13 issues its
    # all-gathers and reduce-scatters async_op=False, from its own streams on CUDA)
    callers = streams.details["blocking_callers"]
    assert any("spmd_types/_collectives.py" in c for c in callers), callers
    assert any(c.split(":")[0].endswith("tests/test_audit_world.py") for c in callers), callers
    # every rank saw the same hazards locally, before any merge
    assert all(set(r["plain"]["local"]) == {"aliasing", "mixed_streams"}
               for r in audit_run["results"])
    fsdp_ops = {rec["op"] for rec in json.loads((audit_run["plain"] / "rank00000.json")
                                                 .read_text())["records"]}
    assert {"c10d._allgather_base_", "c10d._reduce_scatter_base_"} <= fsdp_ops


def test_registry_layout_has_no_hazard(audit_run: dict[str, Any]) -> None:
    report = cg.audit.merge_dir(audit_run["registry"])
    assert report.ok, report.render()
    assert all(r["registry"]["local"] == [] for r in audit_run["results"])
    groups = audit_run["results"][0]["registry"]["groups"]
    summary = report.summary["groups"]
    assert "0" not in summary  # nothing touched the default group
    assert summary[groups["cp"]]["blocking"] == 0 and summary[groups["cp"]]["calls"] >= 3
    assert summary[groups["fsdp"]]["calls"] > 0 and summary[groups["fsdp"]]["blocking"] == 0
    # DCP's plan exchange ran (blocking, gloo) on the checkpoint-metadata group only
    assert summary[groups["checkpoint-metadata"]]["calls"] > 0
    assert summary[groups["cp"]]["roles"] == ["cp"]
    # FSDP2 under async_and_wait trains exactly like plain FSDP2
    assert [r["registry"]["loss"] for r in audit_run["results"]] == [
        r["plain"]["loss"] for r in audit_run["results"]]


def test_collectives_inside_custom_ops_are_recorded(audit_run: dict[str, Any]) -> None:
    for result in audit_run["results"]:
        custom = result["custom_ops"]
        assert custom["gathered"] == 4 * 4, custom  # cp spans the seed layout's 4 ranks
        assert custom["ops"] == [("_c10d_functional.all_gather_into_tensor", ("cp",))] * 2 + [
            ("_c10d_functional.reduce_scatter_tensor", ("cp",))] * 2, custom
        assert custom["hazards"] == [], custom


def test_sequence_mismatch_is_named(audit_run: dict[str, Any]) -> None:
    report = cg.audit.merge_dir(audit_run["mismatch"])
    group = audit_run["results"][0]["mismatch_group"]
    hazards = [h for h in report.hazards if h.kind == "sequence_mismatch"]
    assert len(hazards) == 1 and hazards[0].group == group and hazards[0].roles == ("cp",)
    message = hazards[0].message
    assert "call #1" in message and "ranks 0..2: c10d.allreduce_" in message
    assert "ranks 3: c10d._allgather_base_" in message
    assert hazards[0].details["calls_per_rank"] == {0: 2, 1: 2, 2: 2, 3: 1}
    # per rank alone there is nothing to see
    for path in sorted(audit_run["mismatch"].glob("rank*.json")):
        assert cg.audit.find_hazards([json.loads(path.read_text())]) == []


def test_cli_prints_hazards_and_json(audit_run: dict[str, Any],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(audit_run["plain"])]) == 1
    text = capsys.readouterr().out
    assert "aliasing on group 0" in text and "mixed_streams on group 0" in text
    assert "group 0 (default group) roles=cp,fsdp backend=gloo" in text
    assert main(["audit", str(audit_run["registry"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["ranks"] == [0, 1, 2, 3] and data["hazards"] == []


def test_record_fields(audit_run: dict[str, Any]) -> None:
    data = json.loads((audit_run["registry"] / "rank00002.json").read_text())
    assert data["rank"] == 2 and data["world_size"] == 4 and data["default_group"] == "0"
    records = data["records"]
    for field in ("op", "group", "group_seq", "roles", "async_op", "stream", "exec_stream",
                  "shapes", "dtypes", "caller"):
        assert all(field in r for r in records), field
    ours = [r for r in records if r["op"] == "c10d._allgather_base_" and r["shapes"] == [[8], [2]]]
    assert ours and ours[0]["stream"] == "cpu" and ours[0]["dtypes"] == ["float32", "float32"]
    # the same all-gather from our wrapper and from spmd_types, told apart by caller
    assert {r["caller"].split(":")[0].rsplit("/", 1)[-1] for r in ours} == {
        "test_audit_world.py", "_collectives.py"}
    by_group: dict[str, list[int]] = {}
    for r in records:
        by_group.setdefault(r["group"], []).append(r["group_seq"])
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in by_group.values())
