"""Collect: which stream each way of issuing a collective runs on (needs the GPU; gloo smoke runs).

On a one-rank NCCL group of a device-bound world, each variant below is called once to warm up, then
once under the profiler on a side stream (the "caller's stream", as FSDP2's all-gather stream or a
user's stream would be), bracketed by marker kernels (see :mod:`tools.gpu_check.trace`). The
trimmed trace of each variant is the evidence; :mod:`tools.gpu_check.analysis` reads it.

FSDP2 itself skips its collectives when the shard group has one rank (``world_size == 1`` paths in
``_fsdp_collectives``), so its comms are called directly, the way FSDP2 calls them: its default
all-gather / reduce-scatter (issued blocking) and the async-and-wait ones that
``fully_shard_on_role`` installs.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from tools.gpu_check.analysis import NOT_WAITED, ON_CALLER, WAITED
from tools.gpu_check.trace import parse_trace, trim_trace
from tools.gpu_check.world import dedicated_group, device, init_world, sync

__all__ = ["DEFAULT_BYTES", "collect_streams", "profile_call"]

DEFAULT_BYTES = 512 * 1024 * 1024
"""Message size: large enough (a 1-rank all-gather is a device copy of ~250 us at H200 bandwidth)
that a caller that did not wait visibly runs its next kernel while the collective still runs."""

Variant = tuple[str, str, str, Callable[[], Any]]


def _sync_events_config() -> Any:
    """Profiler config that records cuda_sync events (Stream Wait Event); None if unsupported."""
    from commgroups import torch_internals

    return torch_internals.cuda_sync_events_config()


def _functional_all_gather(x: Any, group: Any) -> Callable[[], Any]:
    """DTensor's path: the functional all-gather op, then wait_tensor on the caller's stream."""
    from commgroups import torch_internals

    # Called as ops because the Python wrappers were renamed across the supported versions.
    ops = torch_internals.functional_collective_ops()

    def call() -> Any:
        return ops.wait_tensor(ops.all_gather_into_tensor(x, group.size(), group.group_name))

    return call


def _fsdp_variants(group: Any, x: Any, out: Any, rs_out: Any) -> list[Variant]:
    import torch.distributed as dist

    from commgroups import torch_internals

    # FSDP2's default comms (as commgroups.integrations.fsdp uses them); missing on older torch: the
    # FSDP variants are then recorded as unavailable.
    classes = torch_internals.fsdp_default_comm_classes()
    if classes is None:
        raise RuntimeError("this torch has no FSDP2 default comm classes")
    DefaultAllGather, DefaultReduceScatter = classes

    from commgroups.integrations.fsdp import async_and_wait_comms

    comms = async_and_wait_comms()
    if comms is None:
        raise RuntimeError("this torch has no FSDP2 custom-comm hooks")
    ag, rs = comms
    default_ag, default_rs = DefaultAllGather(), DefaultReduceScatter()
    sum_op = dist.ReduceOp.SUM
    return [
        ("fsdp_default_all_gather", ON_CALLER, "FSDP2's default all-gather comm (blocking)",
         lambda: default_ag(out, x, group)),
        ("fsdp_async_wait_all_gather", WAITED, "fully_shard_on_role's async-and-wait all-gather",
         lambda: ag(out, x, group)),
        ("fsdp_default_reduce_scatter", ON_CALLER, "FSDP2's default reduce-scatter (blocking)",
         lambda: default_rs(rs_out, x, group, sum_op)),
        ("fsdp_async_wait_reduce_scatter", WAITED,
         "fully_shard_on_role's async-and-wait reduce-scatter", lambda: rs(rs_out, x, group, sum_op)),
    ]


def _variants(group: Any, x: Any, out: Any, rs_out: Any) -> list[Variant]:
    import torch.distributed as dist

    import commgroups as cg

    # What registry.collectives(role) returns, on the dedicated NCCL group (see world.py).
    collectives = cg.RoleCollectives(group, role="cp", async_and_wait=True)
    wrapped = cg.AsyncWaitDist()

    def scope() -> None:
        with cg.async_and_wait_scope():
            dist.all_gather_into_tensor(out, x, group=group)

    variants: list[Variant] = [
        ("raw_blocking", ON_CALLER, "dist.all_gather_into_tensor(async_op=False)",
         lambda: dist.all_gather_into_tensor(out, x, group=group)),
        ("raw_async_no_wait", NOT_WAITED,
         "control: async_op=True, waited only after the next kernel was launched",
         lambda: dist.all_gather_into_tensor(out, x, group=group, async_op=True)),
        ("raw_async_wait", WAITED, "async_op=True, then work.wait() at once",
         lambda: dist.all_gather_into_tensor(  # type: ignore[union-attr]  # 2.14+: Work | None
             out, x, group=group, async_op=True).wait()),
        ("role_collectives", WAITED,
         "RoleCollectives (registry.collectives(role)).all_gather_into_tensor",
         lambda: collectives.all_gather_into_tensor(out, x)),
        ("async_wait_dist", WAITED, "cg.AsyncWaitDist().all_gather_into_tensor",
         lambda: wrapped.all_gather_into_tensor(out, x, group=group)),
        ("async_and_wait_scope", WAITED, "dist.all_gather_into_tensor inside cg.async_and_wait_scope()",
         scope),
        ("functional_all_gather", WAITED,
         "DTensor's functional all_gather_into_tensor + wait_tensor", _functional_all_gather(x, group)),
    ]
    return variants


def _caller_stream(smoke: bool) -> AbstractContextManager[Any]:
    """A fresh side stream made current (nothing on the CPU): the caller's stream in the trace."""
    if smoke:
        return nullcontext()
    import torch

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(side)


def profile_call(call: Callable[[], Any], marker: Any, smoke: bool, tmp: Path, name: str) -> Any:
    """Profile ``call()`` on a fresh caller's stream between two marker kernels; the Chrome trace.

    Args:
        call: the collective call; if it returns a Work, that is waited only after the second
            marker (the no-wait control).
        marker: a device tensor the markers update in place.
        smoke: CPU only (no CUDA activity, no side stream).
        tmp: a folder for the exported trace file.
        name: the trace file's name.

    Returns:
        The loaded trace JSON, ready for :func:`tools.gpu_check.trace.parse_trace`.
    """
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] if smoke else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    config = None if smoke else _sync_events_config()
    kwargs: dict[str, Any] = {} if config is None else {"experimental_config": config}
    context = _caller_stream(smoke)
    with profile(activities=activities, **kwargs) as prof:
        with context:
            with record_function("cg:before"):
                marker.mul_(1.0)
            with record_function("cg:call"):
                pending = call()
            with record_function("cg:after"):
                marker.add_(1.0)
            if hasattr(pending, "wait"):  # the no-wait control's Work, waited only now
                pending.wait()
        sync(smoke)
    path = tmp / f"{name}.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def collect_streams(smoke: bool, size_bytes: int = DEFAULT_BYTES) -> dict[str, Any]:
    """Profile every variant; returns ``{"variants": [...], "size_bytes": n, "traces": {...}}``.

    A variant that fails records its error; the others still run.
    """
    import torch
    import torch.distributed as dist

    init_world("gloo" if smoke else "nccl-bound")
    results: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    try:
        group = dedicated_group()
        dev = device(smoke)
        numel = max(size_bytes // 4, 1)
        x = torch.ones(numel, device=dev)
        out, rs_out = torch.empty_like(x), torch.empty_like(x)
        marker = torch.ones(1 << 16, device=dev)
        variants = _variants(group, x, out, rs_out)
        try:
            variants += _fsdp_variants(group, x, out, rs_out)
        except (ImportError, RuntimeError, AttributeError) as error:
            results.append({"variant": "fsdp_comms", "expected": None, "trace": None,
                            "description": "FSDP2 comms", "error": f"{type(error).__name__}: {error}"})
        with tempfile.TemporaryDirectory(prefix="cg-gpu-trace-") as tmp:
            for name, expected, description, call in variants:
                entry: dict[str, Any] = {"variant": name, "expected": expected,
                                         "description": description, "error": None, "trace": None}
                try:
                    warm = call()  # communicator and lazy state first, outside the trace
                    if hasattr(warm, "wait"):
                        warm.wait()
                    sync(smoke)
                    trace = profile_call(call, marker, smoke, Path(tmp), name)
                    traces[name] = trim_trace(trace)
                    entry["trace"] = name
                    entry["gpu_events"] = len(parse_trace(traces[name]).gpu)
                except Exception as error:  # recorded: one variant must not lose the others
                    entry["error"] = f"{type(error).__name__}: {error}"
                results.append(entry)
        return {"variants": results, "size_bytes": size_bytes, "traces": traces}
    finally:
        dist.destroy_process_group()
