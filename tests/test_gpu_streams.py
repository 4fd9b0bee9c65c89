"""GPU only: where a collective runs, read from a CUDA profiler trace (1-rank NCCL group).

A raw blocking collective (``async_op=False``) runs on the caller's current stream (torch >= 2.8);
the async-and-wait one (``registry.collectives(role)``'s rule) runs on the group's own stream and
the caller's stream waits for it. No public API names a collective's stream, so the trace does:
each call is profiled on a side stream between two marker kernels and judged by the same analysis
the GPU check uses (:mod:`tools.gpu_check.trace`, :func:`~tools.gpu_check.analysis.
stream_verdict`). Skips without CUDA or NCCL. Prints the trace figures (run with ``-s``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests.gpu_support import require_cuda_and_nccl

pytestmark = pytest.mark.gpu

require_cuda_and_nccl("NCCL group + CUDA profiler trace")

from tools.gpu_check.analysis import ON_CALLER, WAITED, stream_verdict  # noqa: E402
from tools.gpu_check.streams import profile_call  # noqa: E402
from tools.gpu_check.trace import parse_trace  # noqa: E402
from tools.gpu_check.world import dedicated_group  # noqa: E402


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[dist.ProcessGroup]:
    """A real 1-rank NCCL world in this process and one dedicated NCCL group on it.

    Not a registry role: the registry gives one-rank roles its single-rank backend (no
    communicator); the streams under test are an NCCL communicator's.
    """
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dedicated_group()
    finally:
        dist.destroy_process_group()


def test_blocking_on_current_stream_async_wait_on_group_stream(
    nccl_group: dist.ProcessGroup, tmp_path: Path,
) -> None:
    group = nccl_group
    x = torch.arange(1 << 24, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)  # out of place: a 1-rank NCCL group still moves bytes
    marker = torch.ones(1 << 16, device="cuda")
    collectives = cg.RoleCollectives(group, role="cp", async_and_wait=True)  # registry.collectives
    # warm up: the communicator is created lazily on first use
    dist.all_gather_into_tensor(out, x, group=group)
    collectives.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()

    raw = stream_verdict("raw", parse_trace(profile_call(
        lambda: dist.all_gather_into_tensor(out, x, group=group), marker, False, tmp_path, "raw")))
    safe = stream_verdict("async_wait", parse_trace(profile_call(
        lambda: collectives.all_gather_into_tensor(out, x), marker, False, tmp_path, "safe")))
    print(f"\nraw blocking all_gather: {raw.to_dict()}")
    print(f"async-and-wait all_gather: {safe.to_dict()}")
    assert raw.verdict == ON_CALLER and raw.flagged, raw
    assert safe.verdict == WAITED and not safe.flagged, safe
    assert safe.caller_stream not in safe.collective_streams
    assert torch.equal(out, x)


def test_audit_names_the_live_hazard(nccl_group: dist.ProcessGroup) -> None:
    group = nccl_group
    x = torch.ones(1024, device="cuda")
    out = torch.empty_like(x)
    with cg.audit.record({"cp": group}) as rec:
        dist.all_gather_into_tensor(out, x, group=group)  # blocking: the caller's stream
        dist.all_gather_into_tensor(out, x, group=group, async_op=True).wait()
    torch.cuda.synchronize()
    streams = [h for h in rec.hazards() if h.kind == "mixed_streams"]
    print(f"\naudit on NCCL: {[(r.op, r.async_op, r.stream, r.exec_stream) for r in rec.records]}")
    assert len(streams) == 1 and streams[0].severity == "error", rec.hazards()
    assert isinstance(rec.records[0].stream, int)
