"""GPU only: where a collective runs, read from a CUDA profiler trace (1-rank NCCL group).

A raw blocking collective (``async_op=False``) runs on the caller's current stream (torch >= 2.8);
the async-and-wait one (``registry.collectives(role)``'s rule) runs on the group's own stream. No
public API names a collective's stream, so the trace does: the stream of the GPU work each call
launched, against the stream of a marker kernel launched just before on the current stream.
Skips without CUDA or NCCL. Prints the trace figures (run with ``-s``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (NCCL group + CUDA profiler trace); torch.cuda.is_available() "
                "is False here", allow_module_level=True)
if not dist.is_nccl_available():
    pytest.skip("needs NCCL; this torch build has none", allow_module_level=True)

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[dist.ProcessGroup]:
    """A real 1-rank NCCL world in this process and one dedicated group on it."""
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="nccl")
    finally:
        dist.destroy_process_group()


def _gpu_events(trace: Path) -> list[dict[str, Any]]:
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and "stream" in e.get("args", {})]
    return sorted(gpu, key=lambda e: e["ts"])


def _profile(call: Callable[[], None], tmp: Path, name: str) -> dict[str, Any]:
    """Launch a marker kernel on a side stream, then ``call()`` there; return the trace's streams."""
    side = torch.cuda.Stream()
    marker = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.cuda.stream(side):
            marker.mul_(3.0)  # a kernel on the current (side) stream
            call()
        torch.cuda.synchronize()
    trace = tmp / f"{name}.json"
    prof.export_chrome_trace(str(trace))
    events = _gpu_events(trace)
    marks = [e for e in events if "mul" in e["name"].lower() or "elementwise" in e["name"].lower()]
    assert marks, f"{name}: no marker kernel in the trace: {[e['name'] for e in events]}"
    current = marks[0]["args"]["stream"]
    collective = [e for e in events if e["ts"] > marks[0]["ts"] and e is not marks[0]]
    assert collective, f"{name}: the collective launched no GPU work: {[e['name'] for e in events]}"
    return {
        "current_stream": current,
        "collective": [(e["name"][:60], e["args"]["stream"], round(float(e.get("dur", 0.0)), 2))
                       for e in collective],
        "streams": sorted({e["args"]["stream"] for e in collective}),
    }


def test_blocking_on_current_stream_async_wait_on_group_stream(
    nccl_group: dist.ProcessGroup, tmp_path: Path,
) -> None:
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)  # out of place: a 1-rank NCCL group still moves bytes
    collectives = cg.RoleCollectives(nccl_group, role="cp", async_and_wait=True)
    # warm up: the communicator is created lazily on first use
    dist.all_gather_into_tensor(out, x, group=nccl_group)
    collectives.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()

    raw = _profile(lambda: dist.all_gather_into_tensor(out, x, group=nccl_group), tmp_path, "raw")
    safe = _profile(lambda: collectives.all_gather_into_tensor(out, x), tmp_path, "async_wait")
    print(f"\nraw blocking all_gather: current stream {raw['current_stream']}, "
          f"collective GPU work {raw['collective']}")
    print(f"async-and-wait all_gather: current stream {safe['current_stream']}, "
          f"collective GPU work {safe['collective']}")
    assert raw["streams"] == [raw["current_stream"]], raw
    assert safe["current_stream"] not in safe["streams"], safe
    assert torch.equal(out, x)


def test_audit_names_the_live_hazard(nccl_group: dist.ProcessGroup) -> None:
    x = torch.ones(1024, device="cuda")
    out = torch.empty_like(x)
    with cg.audit.record({"cp": nccl_group}) as rec:
        dist.all_gather_into_tensor(out, x, group=nccl_group)  # blocking: the caller's stream
        dist.all_gather_into_tensor(out, x, group=nccl_group, async_op=True).wait()
    torch.cuda.synchronize()
    streams = [h for h in rec.hazards() if h.kind == "mixed_streams"]
    print(f"\naudit on NCCL: {[(r.op, r.async_op, r.stream, r.exec_stream) for r in rec.records]}")
    assert len(streams) == 1 and streams[0].severity == "error", rec.hazards()
    assert isinstance(rec.records[0].stream, int)
