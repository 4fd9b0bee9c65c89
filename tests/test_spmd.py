"""spmd_types under ``activate``: axis names resolve to the registry's groups, nothing is blocking,
and spmd_types is left exactly as it was. One 4-rank gloo world runs every check.

Observed at the c10d op level with :class:`tests.test_dcp_world.C10dRecorder`; a negative
control (plain ``set_current_mesh`` on an ``init_device_mesh`` mesh) shows the recorder does see
blocking calls on the default group, so "none is blocking" is not a blind spot.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups import GroupRegistry
from commgroups.demo.config import seed_layout
from commgroups.torch_internals.version import torch_version
from tests import torch_private
from tests.test_dcp_world import C10dRecorder
from tests.worlds import run_world

pytestmark = pytest.mark.world

spmd = pytest.importorskip("spmd_types")

WORLD = 4

#: What the world records for a call gloo refuses (torch 2.10 has no gloo list all_to_all).
_GLOO_NO_ALLTOALL = "gloo has no list all_to_all"


def _spmd_world(rank: int, world: int) -> dict[str, Any]:
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh

    from commgroups.collectives.async_wait import AsyncWaitDist
    from commgroups.demo.model import ModelConfig, TinyTransformer
    from commgroups.demo.train import spmd_seq_gather
    from commgroups.integrations.spmd import activate, current_dist

    out: dict[str, Any] = {"default": torch_private.default_group().group_name}
    x = torch.arange(3.0) + rank
    plain = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    with GroupRegistry(seed_layout(world)) as registry:
        out["cp"] = registry.group("cp").group_name
        out["before"] = (spmd.current_mesh(), current_dist() is dist)

        # negative control: plain DeviceMesh and spmd_types' own dist
        rec = C10dRecorder()
        with spmd.set_current_mesh(plain), rec:
            spmd.all_gather(x, "cp", src=spmd.V, dst=spmd.R)
        out["plain_ops"] = rec.ops

        with activate(registry, ["cp"]) as mesh:
            out["scope_dist"] = type(current_dist()).__name__
            out["mesh_group"] = mesh.get_group("cp").group_name
            rec = C10dRecorder()
            with rec:
                leaf = x.clone().requires_grad_()
                stacked = spmd.all_gather(leaf, "cp", src=spmd.V, dst=spmd.R)  # raw path
                (stacked * (rank + 1)).sum().backward()  # raw reduce_scatter in backward
                sharded = spmd.all_gather(x, "cp", src=spmd.Shard(0), dst=spmd.R)
                reduced = spmd.all_reduce(x.clone(), "cp", src=spmd.P, dst=spmd.R)
            out["scope_ops"] = rec.ops
            out["values"] = (stacked.tolist(), leaf.grad.tolist(), sharded.tolist(),
                             reduced.tolist())
        out["after"] = (spmd.current_mesh(), current_dist() is dist)

        # which path each collective takes, as the audit records it (guide: "Which spmd_types calls
        # go through the dist module"): one audit block per call
        import commgroups as cg

        calls: dict[str, Any] = {
            "all_gather stack": lambda: spmd.all_gather(x, "cp", src=spmd.V, dst=spmd.R),
            "all_gather shard": lambda: spmd.all_gather(x, "cp", src=spmd.Shard(0), dst=spmd.R),
            "all_reduce": lambda: spmd.all_reduce(x.clone(), "cp", src=spmd.P, dst=spmd.R),
            "reduce_scatter stack": lambda: spmd.reduce_scatter(
                torch.ones(WORLD, 2), "cp", src=spmd.P, dst=spmd.V),
            "reduce_scatter shard": lambda: spmd.reduce_scatter(
                torch.ones(WORLD * 2), "cp", src=spmd.P, dst=spmd.Shard(0)),
            "all_to_all stack": lambda: spmd.all_to_all(
                torch.ones(WORLD, 2), "cp", src=spmd.V, dst=spmd.V),
        }
        out["paths"] = {}
        with activate(registry, ["cp"]):
            for label, call in calls.items():
                with cg.audit.record(registry) as audited:
                    try:
                        call()
                    except RuntimeError as err:
                        # gloo's list all_to_all is missing on the oldest torch we support (2.10
                        # raises before any communication, on every rank alike)
                        if "does not support alltoall" not in str(err):
                            raise
                        out["paths"][label] = _GLOO_NO_ALLTOALL
                        continue
                out["paths"][label] = [(r.op, r.async_op, r.roles) for r in audited.records]

        # restored when the body raises
        try:
            with activate(registry, "cp"):
                raise KeyError("boom")
        except KeyError:
            pass
        out["after_error"] = (spmd.current_mesh(), current_dist() is dist)

        # nested in a user's mesh and dist: both come back, and a later call uses the user's mesh
        mine = AsyncWaitDist()
        spmd.set_dist(mine)
        try:
            with spmd.set_current_mesh(plain):
                with activate(registry, "cp"):
                    out["inner_dist_is_ours"] = current_dist() is not mine
                out["outer_dist_back"] = current_dist() is mine
                rec = C10dRecorder()
                with rec:
                    spmd.all_gather(x, "cp", src=spmd.V, dst=spmd.R)
                out["outer_ops"] = rec.ops
        finally:
            spmd.set_dist(None)

        # dist-only: the caller owns the current mesh (a registry mesh here, as torchtitan does)
        with spmd.set_current_mesh(registry.device_mesh("cp")):
            with activate(registry, None) as none_mesh:
                out["dist_only"] = (none_mesh, type(current_dist()).__name__)
                rec = C10dRecorder()
                with rec:
                    spmd.all_gather(x, "cp", src=spmd.V, dst=spmd.R)
                out["dist_only_ops"] = rec.ops
            out["dist_only_after"] = current_dist() is dist

        # context parallel through activate gives the single-rank transformer's logits and grads
        torch.manual_seed(0)
        model = TinyTransformer(ModelConfig(max_seq=16))
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
        ref = model(tokens[:, :16])
        ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
        lo = rank * 4
        with activate(registry, ["cp"]):
            logits = model(tokens[:, lo:lo + 4], lo, spmd_seq_gather("cp"))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64),
                                                     tokens[:, lo + 1:lo + 5].reshape(-1))
            grads = torch.autograd.grad(loss, list(model.parameters()))
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=registry.group("fsdp"), async_op=True).wait()
        out["cp_logits_match"] = torch.allclose(logits, ref[:, lo:lo + 4], atol=1e-5)
        out["cp_grads_match"] = torch.allclose(
            flat / world, torch.cat([g.reshape(-1) for g in ref_grads]), atol=1e-5)
    return out


@pytest.fixture(scope="module")
def spmd_results() -> list[dict[str, Any]]:
    """Every rank's observations from one world."""
    return run_world(_spmd_world, WORLD, timeout=180)


def test_recorder_sees_blocking_calls_on_a_plain_mesh(spmd_results: list[dict[str, Any]]) -> None:
    for out in spmd_results:
        ops = out["plain_ops"]
        assert ops and all(op.async_op is False for op in ops)
        assert {op.group_name for op in ops} == {out["default"]}


def test_collectives_under_activate_use_the_registry_group_and_none_blocks(
    spmd_results: list[dict[str, Any]],
) -> None:
    for out in spmd_results:
        assert out["scope_dist"] == "AsyncWaitDist"
        assert out["mesh_group"] == out["cp"] != out["default"]
        ops = out["scope_ops"]
        # raw all_gather, its backward's reduce_scatter, and the functional ones
        assert len(ops) >= 4, ops
        assert {op.group_name for op in ops} == {out["cp"]}
        assert all(op.async_op is True for op in ops), ops


def test_dist_only_keeps_the_callers_mesh_and_waits(spmd_results: list[dict[str, Any]]) -> None:
    for out in spmd_results:
        assert out["dist_only"] == (None, "AsyncWaitDist") and out["dist_only_after"]
        ops = out["dist_only_ops"]
        assert ops and {op.group_name for op in ops} == {out["cp"]}
        assert all(op.async_op is True for op in ops), ops


# spmd-types 0.3 moved shard-semantics all_gather / reduce_scatter and out-of-place all_reduce to
# functional collectives; 0.2.x issues every one through the dist module.
_FUNCTIONAL_SINCE_0_3 = {"all_gather shard", "all_reduce", "reduce_scatter shard"}


def test_audit_tells_the_dist_path_from_the_functional_one(
    spmd_results: list[dict[str, Any]],
) -> None:
    from importlib.metadata import version

    newer = tuple(int(p) for p in version("spmd-types").split(".")[:2]) >= (0, 3)
    for out in spmd_results:
        for label, records in out["paths"].items():
            if records == _GLOO_NO_ALLTOALL:
                # torch 2.10's gloo has no list all_to_all; 2.13 and 2.15 have it (checked in CI)
                assert label.startswith("all_to_all") and torch_version() < (2, 13, 0), (label, records)
                continue
            assert records, label
            assert all(roles == ("cp",) and async_op is True for _, async_op, roles in records), (
                label, records)
            namespaces = {op.split(".")[0] for op, _, _ in records}
            expected = ("_c10d_functional" if newer and label in _FUNCTIONAL_SINCE_0_3 else "c10d")
            assert namespaces == {expected}, (label, records)


def test_results_are_right(spmd_results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(spmd_results):
        stacked, grad, sharded, reduced = out["values"]
        expected = [[float(r + i) for i in range(3)] for r in range(WORLD)]
        assert stacked == expected
        assert sharded == [v for row in expected for v in row]
        assert reduced == [float(sum(r + i for r in range(WORLD))) for i in range(3)]
        # d/d(leaf_r) of sum_k (k+1) * stack: every rank's weight summed
        assert grad == [float(sum(k + 1 for k in range(WORLD)))] * 3, rank


def test_spmd_types_is_restored(spmd_results: list[dict[str, Any]]) -> None:
    for out in spmd_results:
        assert out["before"] == (None, True)
        assert out["after"] == (None, True)
        assert out["after_error"] == (None, True)
        assert out["inner_dist_is_ours"] and out["outer_dist_back"]
        # after the inner scope, "cp" resolves through the user's plain mesh again
        assert {op.group_name for op in out["outer_ops"]} == {out["default"]}


def test_context_parallel_matches_the_single_rank_model(spmd_results: list[dict[str, Any]]) -> None:
    for out in spmd_results:
        assert out["cp_logits_match"] and out["cp_grads_match"]
