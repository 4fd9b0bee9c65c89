"""Collect: what async-and-wait costs per call on NCCL, 4 B to 256 MiB (needs the GPU).

Three variants on one one-rank NCCL group, timed with CUDA events on the caller's stream over a
batch of calls (so host launch cost counts where it dominates, as it does for a caller): the raw
blocking call, the same call issued ``async_op=True`` and waited by hand, and
:class:`~commgroups.RoleCollectives`, what ``registry.collectives(role)`` returns (the product's
path: the manual rule plus the wrapper), on a dedicated group (:func:`~tools.gpu_check.world.
dedicated_group`). Variants are
interleaved, their order rotated every repetition. The gloo smoke run uses the host clock instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from commgroups.bench.stats import interleaved
from tools.gpu_check.world import dedicated_group, device, init_world, sync

__all__ = ["GPU_SIZES", "SMOKE_SIZES", "calls_for", "collect_async_wait_cost"]

GPU_SIZES: tuple[int, ...] = (4, 64, 1024, 16 << 10, 256 << 10, 4 << 20, 64 << 20, 256 << 20)
SMOKE_SIZES: tuple[int, ...] = (4, 64 << 10)
VARIANTS: tuple[str, ...] = ("raw_us", "manual_us", "collectives_us")
# Aim for a batch of a few ms: long enough for event resolution, short enough for many repetitions.
BATCH_S = 2e-3
ASSUMED_BYTES_PER_S = 1e12
MIN_CALL_S = 10e-6


def calls_for(nbytes: int, *, smoke: bool = False) -> int:
    """Calls per timed batch for a message of ``nbytes``: 5 to 200 (3 to 20 in a smoke run)."""
    per_call = max(MIN_CALL_S, nbytes / ASSUMED_BYTES_PER_S)
    low, high = (3, 20) if smoke else (5, 200)
    return max(low, min(high, int(BATCH_S / per_call)))


def _timed(fn: Callable[[], None], calls: int, smoke: bool) -> float:
    """Microseconds per call over a batch of ``calls``."""
    if smoke:
        start_s = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start_s) / calls * 1e6
    import torch

    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()  # type: ignore[no-untyped-call]  # untyped in torch 2.10's stubs
    for _ in range(calls):
        fn()
    end.record()  # type: ignore[no-untyped-call]
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / calls  # type: ignore[no-untyped-call]


def _wait(work: Any) -> None:
    # torch >= 2.14 types async collectives Work | None (None: not a member); members get a Work.
    work.wait()


def _calls(op: str, group: Any, x: Any, out: Any) -> dict[str, Callable[[], Any]]:
    import torch.distributed as dist

    import commgroups as cg

    # What registry.collectives(role) returns, on the dedicated NCCL group (see world.py).
    role = cg.RoleCollectives(group, role="cp", async_and_wait=True)
    if op == "all_reduce":
        return {
            "raw_us": lambda: dist.all_reduce(x, group=group),
            "manual_us": lambda: _wait(dist.all_reduce(x, group=group, async_op=True)),
            "collectives_us": lambda: role.all_reduce(x),
        }
    return {
        "raw_us": lambda: dist.all_gather_into_tensor(out, x, group=group),
        "manual_us": lambda: _wait(dist.all_gather_into_tensor(out, x, group=group,
                                                               async_op=True)),
        "collectives_us": lambda: role.all_gather_into_tensor(out, x),
    }


def collect_async_wait_cost(smoke: bool, *, reps: int | None = None,
                      sizes: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Time every op, size and variant; returns ``{"cases": [...], "timer": ...}``.

    Each case: ``{"op", "bytes", "calls", "reps": [{"raw_us", "manual_us", "collectives_us"}, ...]}``
    or an ``error``; one failing case does not stop the others.
    """
    import torch
    import torch.distributed as dist

    reps = reps if reps is not None else (3 if smoke else 30)
    sizes = sizes if sizes is not None else (SMOKE_SIZES if smoke else GPU_SIZES)
    timer = "perf_counter (host)" if smoke else "cuda_events"
    init_world("gloo" if smoke else "nccl-bound")
    cases: list[dict[str, Any]] = []
    try:
        group = dedicated_group()
        for op in ("all_reduce", "all_gather_into_tensor"):
            for nbytes in sizes:
                case: dict[str, Any] = {"op": op, "bytes": nbytes, "timer": timer, "reps": [],
                                        "error": None}
                try:
                    x = torch.zeros(max(nbytes // 4, 1), device=device(smoke))
                    out = torch.empty_like(x)
                    calls = _calls(op, group, x, out)
                    case["calls"] = count = calls_for(nbytes, smoke=smoke)
                    for fn in calls.values():  # warm up every path (communicator, allocator)
                        for _ in range(3):
                            fn()
                    sync(smoke)
                    for rep in range(reps):
                        row = {name: _timed(calls[name], count, smoke)
                               for name in interleaved(VARIANTS, rep)}
                        case["reps"].append(row)
                    del x, out
                except Exception as error:  # recorded; the other cases still run
                    case["error"] = f"{type(error).__name__}: {error}"
                cases.append(case)
        return {"cases": cases, "timer": timer, "reps": reps}
    finally:
        dist.destroy_process_group()
