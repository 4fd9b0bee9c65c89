"""Role isolation: no role's traffic on another role's group, and the audit sees (and names) every
collective a step issues.

One real 4-rank gloo world (``dp_shard=2 x tp=2``: the torchtitan trial's shape, tp mixed with
another dim) runs every check, each in its own recording:

- DTensor's merged reduction over ``dp_shard x tp`` (torchtitan's gradient-norm path) runs as one
  reduction per dim on the dp_shard and tp roles' groups, never on checkpoint-metadata's, and its
  result is bitwise the one a stock ``init_device_mesh`` mesh gives;
- the misrouting itself, reproduced by registering the checkpoint group as a flattening as the
  registry used to: the audit names it (``off_purpose`` on checkpoint-metadata);
- collectives DTensor issues *inside* its dispatch (an op that needs a redistribute) are recorded;
- c10d calls, object collectives, send/recv, functional collectives and spmd_types' calls are
  recorded once each: gloo's own per-group count agrees (no ``uncounted`` hazard), and a collective
  issued on another thread is reported as ``uncounted``;
- DCP's exchange on the checkpoint group is its purpose (no hazard); the same group used outside
  DCP is ``off_purpose``; a group the registry did not make is ``foreign_group``; the default group
  is ``default_group`` (or ``aliasing`` where a role spans the same ranks).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import torch_internals
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world

WORLD = 4
LAYOUT = {"dp_shard": 2, "tp": 2}


def _kinds(recorder: Any) -> list[str]:
    return sorted(h.kind for h in recorder.hazards())


def _by_role(recorder: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in recorder.records:
        key = "+".join(record.roles) or record.group
        counts[key] = counts.get(key, 0) + 1
    return counts


def _merged_reduction(mesh: Any, rank: int) -> torch.Tensor:
    """What torchtitan's grad-norm does: a Partial x Partial DTensor reduced to Replicate."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    local = torch.linspace(0.1, 1.0, 7) * (rank + 1) / 3.0  # bits depend on the reduction order
    x = DTensor.from_local(local, mesh, [Partial(), Partial()])
    return x.redistribute(mesh, [Replicate(), Replicate()]).to_local()


def _isolation_world(rank: int, world: int, checkpoint_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from commgroups.integrations import dcp

    out: dict[str, Any] = {}
    stock_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out["stock"] = _merged_reduction(stock_mesh, rank).tolist()
    with cg.GroupRegistry(cg.Layout(dims=LAYOUT)) as registry:
        mesh = registry.device_mesh(["dp_shard", "tp"])
        ckpt = registry.group("checkpoint-metadata")
        # whatever DTensor can find by layout on a registry mesh is a compute role's group
        out["flattenings"] = sorted(
            {m.get_group().group_name for m in torch_private.flatten_mapping(mesh).values()}
        )
        out["compute_groups"] = sorted(registry.group(r).group_name for r in registry.role_names
                                       if registry.spec(r).purpose == "compute")
        out["checkpoint_group"] = ckpt.group_name
        try:
            registry.device_mesh("checkpoint-metadata")
        except cg.errors.LayoutError as error:
            out["mesh_refused"] = str(error)

        # 1. the merged reduction: one per dim on the roles' groups, bitwise equal to stock
        with cg.audit.record(registry) as rec:
            out["registry"] = _merged_reduction(mesh, rank).tolist()
        out["reduction_roles"] = _by_role(rec)
        out["reduction_hazards"] = _kinds(rec)

        # 2. collectives DTensor issues inside its dispatch (x * x needs a redistribute)
        with cg.audit.record(registry) as rec:
            x = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial(), Partial()])
            product = (x * x).to_local()
        out["dispatch_records"] = len(rec.records)
        out["dispatch_product"] = product.tolist()

        # 3. every kind of call, recorded once each; gloo's own counts agree
        tp = registry.group("tp")
        collectives = registry.collectives("tp")
        with cg.audit.record(registry) as rec:
            dist.all_reduce(torch.ones(2), group=tp)  # c10d, blocking
            collectives.all_reduce(torch.ones(2))  # through the registry, async-and-wait
            funcol = torch_private.functional_collectives()

            funcol.all_reduce(torch.ones(2), "sum", tp).wait()  # functional
            objects: list[Any] = [None] * 2
            dist.all_gather_object(objects, rank, group=tp)  # object collective (2 calls)
            peer = dist.get_global_rank(tp, 1 - tp.rank())
            if tp.rank() == 0:
                dist.send(torch.ones(1), peer, group=tp)  # pipeline-style point-to-point
            else:
                dist.recv(torch.ones(1), peer, group=tp)
            dist.barrier(group=tp)
        out["kinds_ops"] = [r.op for r in rec.records]
        out["kinds_hazards"] = _kinds(rec)
        out["kinds_sequence"] = rec.to_dict()["sequence"].get(tp.group_name)

        # spmd_types' raw calls (through the async-and-wait dist) on the tp role's group
        import spmd_types as spmd

        from commgroups.integrations.spmd import activate

        with activate(registry, ["tp"]), cg.audit.record(registry) as rec:
            gathered = spmd.all_gather(torch.arange(2.0) + rank, "tp", src=spmd.V, dst=spmd.R)
            spmd.all_reduce(torch.ones(2), "tp", src=spmd.P, dst=spmd.R)
        out["spmd_roles"] = _by_role(rec)
        out["spmd_async"] = all(r.async_op for r in rec.records)
        out["spmd_hazards"] = _kinds(rec)
        out["spmd_gathered"] = gathered.tolist()

        # 4. a collective on another thread is invisible to the dispatch mode: reported
        with cg.audit.record(registry) as rec:
            worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=tp))
            worker.start()
            worker.join()
        out["thread_hazards"] = [(h.kind, h.details) for h in rec.hazards()]

        # 5. DCP on the checkpoint group is its purpose; the same group elsewhere is not
        state = {"w": torch.arange(4.0) + rank}
        with cg.audit.record(registry) as rec:
            dcp.save(state, checkpoint_id=checkpoint_dir, registry=registry)
        out["dcp_records"] = sum(r.group == ckpt.group_name for r in rec.records)
        out["dcp_in_checkpoint"] = all(r.in_checkpoint for r in rec.records)
        out["dcp_hazards"] = _kinds(rec)
        with cg.audit.record(registry) as rec:
            registry.collectives("checkpoint-metadata").all_reduce(torch.ones(1))
        out["misuse_hazards"] = [(h.kind, h.roles) for h in rec.hazards()]

        # 6. the misrouting, reproduced: the checkpoint group registered as a flattening of the
        # full mesh, as the registry did before roles had a purpose
        other = registry.device_mesh(["dp_shard", "tp"])
        torch_internals.register_flattened_mesh(other, ("dp_shard", "tp"), "dp_shard_tp", ckpt)
        with cg.audit.record(registry) as rec:
            out["misrouted"] = _merged_reduction(other, rank).tolist()
        out["misrouted_hazards"] = [(h.kind, h.roles, h.details.get("calls"))
                                    for h in rec.hazards()]
        out["merged_on_checkpoint"] = any(r.group == ckpt.group_name for r in rec.records)
        torch_internals.clear_flatten_mapping(other)

        # 7. a group the registry did not make, and the default group
        mine = dist.new_group([0, 1, 2, 3])
        with cg.audit.record(registry) as rec:
            dist.all_reduce(torch.ones(1), group=mine)
            dist.all_reduce(torch.ones(1))
        out["foreign"] = [(h.kind, h.severity) for h in rec.hazards()]
        dist.destroy_process_group(mine)
    # a layout without a world-spanning role: default-group traffic is its own hazard
    no_world_role = cg.Layout(dims=LAYOUT, roles=[cg.RoleSpec(name="tp", dims=["tp"])])
    with cg.GroupRegistry(no_world_role) as registry, cg.audit.record(registry) as rec:
        dist.all_reduce(torch.ones(1))
    out["default"] = [(h.kind, h.details.get("calls")) for h in rec.hazards()]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def isolation(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint_dir = Path(tmp_path_factory.mktemp("isolation")) / "step-1"
    return run_world(_isolation_world, WORLD, str(checkpoint_dir), timeout=300)


def test_checkpoint_group_is_never_a_flattening_or_mesh_axis(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert out["checkpoint_group"] not in out["flattenings"]
        assert set(out["flattenings"]) <= set(out["compute_groups"])
        assert "purpose 'checkpoint'" in out["mesh_refused"]


def test_merged_reduction_runs_per_dim_on_the_roles_and_equals_stock(
    isolation: list[dict[str, Any]],
) -> None:
    for out in isolation:
        assert out["reduction_roles"] == {"dp_shard": 1, "tp": 1}, out["reduction_roles"]
        assert out["reduction_hazards"] == []
        assert out["registry"] == out["stock"]  # exact floats: same reductions in the same order


def test_collectives_inside_dtensor_dispatch_are_recorded(isolation: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(isolation):
        assert out["dispatch_records"] >= 1
        assert out["dispatch_product"] == [10.0 * (rank + 1)] * 4  # one operand was reduced


def test_every_kind_of_call_is_recorded_once(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        ops = out["kinds_ops"]
        assert ops[0] == "c10d.allreduce_" and ops[1] == "c10d.allreduce_"
        assert ops[2] in {"_c10d_functional.all_reduce", "_c10d_functional.all_reduce_"}
        # all_gather_object: sizes, then the pickled objects (list all-gather; 2.15: into a tensor)
        assert ops[3] == ops[4] and ops[3] in {"c10d.allgather_", "c10d._allgather_base_"}
        assert ops[5] in {"c10d.send", "c10d.recv_"}
        assert ops[6] == "c10d.barrier"
        start, end = out["kinds_sequence"]
        assert end - start == len(ops) == 7
        # blocking and async calls on one group (latent on gloo); nothing uncounted
        assert out["kinds_hazards"] == ["mixed_streams"]


def test_spmd_types_calls_are_recorded_on_their_role(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert out["spmd_roles"]["tp"] >= 2, out["spmd_roles"]
        assert set(out["spmd_roles"]) == {"tp"}
        assert out["spmd_async"] and out["spmd_hazards"] == []


def test_a_collective_the_audit_cannot_see_is_reported(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert out["thread_hazards"] == [("uncounted", {"recorded": 0, "counted": 1})]


def test_checkpoint_group_carries_dcp_only(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert out["dcp_records"] > 0 and out["dcp_in_checkpoint"]
        assert out["dcp_hazards"] == []
        assert out["misuse_hazards"] == [("off_purpose", ("checkpoint-metadata",))]


MERGES_BY_LAYOUT = torch_private.merges_reductions_by_layout()
"""DTensor merges reductions over several mesh dims onto a flattening it finds by layout (private
``_redistribute._get_flattened_mesh_by_layout``): present on 2.13 and 2.15, absent on 2.10, which
reduces per dim whatever is registered."""


def test_the_misrouting_is_named(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert out["merged_on_checkpoint"] == MERGES_BY_LAYOUT
        if out["merged_on_checkpoint"]:
            assert out["misrouted_hazards"] == [("off_purpose", ("checkpoint-metadata",), 1)]
            # the bug's symptom: a 4-rank reduction differs from two 2-rank ones in the last bits
            assert out["misrouted"] != out["stock"]
        else:
            assert out["misrouted_hazards"] == [] and out["misrouted"] == out["stock"]


def test_foreign_and_default_group_traffic_is_named(isolation: list[dict[str, Any]]) -> None:
    for out in isolation:
        assert sorted(out["foreign"]) == [("aliasing", "error"), ("foreign_group", "warning")]
        assert out["default"] == [("default_group", 1)]
