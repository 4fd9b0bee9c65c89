"""Collect: every NCCL path commgroups takes, on each NCCL implementation torch offers (needs the GPU).

torch 2.15's ``nccl`` is ``ProcessGroupNCCL2``; ``nccl-legacy`` is ``ProcessGroupNCCL`` (2.14: ``nccl``
is the legacy class and ``nccl2`` the new one). One process per backend name (a world is initialised
once per process): a one-rank device-bound world on that backend, then each path commgroups uses,
through the same :mod:`commgroups.torch_internals` functions the package calls, each recorded as ok
(with its value) or its error: the classes torch built, a group with commgroups' NCCL options, a
collective on it, the split count, the shrink answer, a copy of the backend options, a new timeout,
a ``split_group`` child with a collective, and an abort. A smoke run does the same on gloo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tools.gpu_check.world import device, sync

__all__ = ["NCCL_BACKENDS", "collect_nccl_backend"]

NCCL_BACKENDS: tuple[str, ...] = ("nccl", "nccl-legacy", "nccl2")
"""The names tried, one process each; a torch without ProcessGroupNCCL2 (before 2.14) runs ``nccl``
only and says so for the others."""
TIMEOUT = timedelta(seconds=60)


def _step(steps: list[dict[str, Any]], name: str, call: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    try:
        value = call()
    except Exception as error:  # recorded; the next path still runs
        steps.append({"step": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:300],
                      "seconds": round(time.perf_counter() - start, 3)})
        return None
    steps.append({"step": name, "ok": True, "value": None if value is None else str(value)[:200],
                  "seconds": round(time.perf_counter() - start, 3)})
    return value


def collect_nccl_backend(backend: str, smoke: bool) -> dict[str, Any]:
    """Run commgroups' NCCL paths on a one-rank world of ``backend`` (gloo in a smoke run)."""
    import torch
    import torch.distributed as dist

    from commgroups import torch_internals

    if backend not in NCCL_BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(NCCL_BACKENDS)}")
    if not smoke and backend != "nccl" and not hasattr(dist, "ProcessGroupNCCL2"):
        return {"backend": backend, "skipped": f"torch {torch.__version__} has no "
                f"ProcessGroupNCCL2: only 'nccl' (ProcessGroupNCCL) exists here"}
    name = "gloo" if smoke else backend
    store = dist.HashStore()  # type: ignore[attr-defined]  # re-exported at runtime
    if smoke:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    on = device(smoke)
    world: Any = dist.group.WORLD
    steps: list[dict[str, Any]] = []
    data: dict[str, Any] = {"backend": backend, "ran_on": name, "torch": torch.__version__,
                            "steps": steps}
    try:
        data["default_class"] = torch_internals.nccl_backend_class(world, on)
        data["bound"] = getattr(world, "bound_device_id", None) is not None

        def make_group() -> Any:
            options = None if smoke else torch_internals.nccl_options(True, {"split_share": 1})
            return dist.new_group([0], timeout=TIMEOUT, pg_options=options,
                                  group_desc="cg_nccl_backends")

        group = _step(steps, "new_group with commgroups' NCCL options", make_group)
        data["group_class"] = None if group is None else torch_internals.nccl_backend_class(group, on)
        if group is not None:
            steps[-1]["value"] = data["group_class"]

        def all_reduce(target: Any) -> float:
            one = torch.ones(1, device=on)
            dist.all_reduce(one, group=target)
            sync(smoke)
            return float(one.item())

        if group is not None:
            _step(steps, "all_reduce", lambda: all_reduce(group))
            _step(steps, "split count (comm_split_count)",
                  lambda: torch_internals.nccl_comm_split_count(world))
            _step(steps, "supports_shrinking",
                  lambda: torch_internals.backend_supports_shrinking(group, on))
            _step(steps, "backend options copy", lambda: type(
                torch_internals.backend_options_copy(group, on)).__name__)
            _step(steps, "set_timeout", lambda: torch_internals.set_group_timeout(
                group, timedelta(seconds=90)))
            _step(steps, "all_reduce after set_timeout", lambda: all_reduce(group))
        if hasattr(dist, "split_group") and not smoke:
            child = _step(steps, "split_group", lambda: dist.split_group(
                split_ranks=[[0]], timeout=TIMEOUT, group_desc="cg_nccl_backends_split"))
            if child is not None:
                _step(steps, "all_reduce on the split child", lambda: all_reduce(child))
        if group is not None:
            _step(steps, "abort (_abort_process_group)", lambda: torch_internals.abort_group(group))
    finally:
        dist.destroy_process_group()
    data["ok"] = all(step["ok"] for step in steps)
    return data
