"""The audit on what real models run: flex attention (a higher-order operator), a fullgraph
torch.compile (torch's context parallel compiles create_block_mask that way), DTensor's functional
collectives, compiled code issuing a collective, and raw c10d calls, all inside one recording.

One real 2-rank gloo world. The ground truth for "every collective was recorded" is gloo's own
per-group sequence number, which counts every collective the group ran, functional ones included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world

WORLD = 2
SEQ = 128  # flex attention's block size: one block per sequence


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def _allow_flex_backward_on_cpu() -> None:
    # torch refuses FlexAttention backward on CPU in a device check, though the eager path is
    # differentiable (torchtitan's CPU runs patch the same check). Tests only, in a rank process.
    setattr(*torch_private.flex_validate_device_target(), lambda *tensors: None)


def _real_model_step(rank: int, world: int) -> dict[str, Any]:
    funcol = torch_private.functional_collectives()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _allow_flex_backward_on_cpu()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = mesh.get_group("cp")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled_reduce(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", cp) + 1

    # gloo counts every collective a group runs; it is the ground truth for "every one recorded"
    before = torch_private.sequence_number(cp)
    with cg.audit.record({"cp": cp}) as rec:
        # as torch's context parallel does: a fullgraph compile inside the recording. The
        # recording meets dynamo's trace, not inductor's code: aot_eager traces the same graph
        # and skips inductor's C++ build (about 25 s of this world's 30 on 2 cores).
        mask = torch.compile(create_block_mask, backend="aot_eager", fullgraph=True)(
            _causal, 1, 1, SEQ, SEQ, device="cpu")
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, 2, SEQ, 16, generator=gen, requires_grad=True)
                   for _ in range(3))
        out = flex_attention(q, k, v, block_mask=mask)  # the flex_attention higher-order operator
        out.sum().backward()  # and its backward one
        assert q.grad is not None
        dist.all_reduce(q.grad, group=cp)  # raw c10d, blocking
        sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])  # c10d scatter
        full = sharded.redistribute(mesh, [Replicate()]).to_local()  # functional all-gather
        reduced = compiled_reduce(torch.ones(2))  # a collective issued by compiled code
    after = torch_private.sequence_number(cp)
    return {
        "ops": [r.op for r in rec.records],
        "groups": {r.group for r in rec.records},
        "cp": cp.group_name,
        "ran": after - before,
        "callers": [r.caller for r in rec.records],
        "full": full.tolist(),
        "reduced": reduced.tolist(),
        "out_finite": bool(torch.isfinite(out).all()),
        "hazards": [h.kind for h in rec.hazards()],
    }


@pytest.fixture(scope="module")
def real_model_results() -> list[dict[str, Any]]:
    """Every rank's recording of one step (the compiles make this the slow part)."""
    return run_world(_real_model_step, WORLD, timeout=400)


def test_flex_attention_and_fullgraph_compile_run_inside_the_recording(
    real_model_results: list[dict[str, Any]],
) -> None:
    for out in real_model_results:
        assert out["out_finite"]
        assert out["full"] == [float(i) for i in range(8)]
        assert out["reduced"] == [2.0 * WORLD + 1] * 2


def test_every_collective_is_recorded_once(real_model_results: list[dict[str, Any]]) -> None:
    for out in real_model_results:
        assert out["groups"] == {out["cp"]}
        assert len(out["ops"]) == out["ran"] == 4, out["ops"]
        ops = out["ops"]
        assert ops[:2] == ["c10d.allreduce_", "c10d.scatter_"]  # raw c10d, DTensor's distribute
        assert ops[2] == "_c10d_functional.all_gather_into_tensor"  # DTensor's redistribute
        assert ops[3] in {"_c10d_functional.all_reduce", "_c10d_functional.all_reduce_"}
        # the raw all_reduce is attributed to this file, not to torch
        assert out["callers"][0].split(":")[0].endswith("tests/test_audit_real_models.py")
        # a plain 1-D DeviceMesh over the world hands back the default group, and the step mixes
        # blocking and async calls on it: the analysis still names both
        assert out["cp"] == "0" and out["hazards"] == ["aliasing", "mixed_streams"]

