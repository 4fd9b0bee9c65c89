"""Collect: device memory that eagerly initialised NCCL communicators take (needs the GPU).

One trial per process (a fresh CUDA context, nothing left over from another trial): initialise the
one-rank world, then create dedicated groups one after another until 1, 2, 4 and 8 exist, each
brought up with a one-element all_reduce (NCCL >= 2.22 connects lazily, on first use), and read
``torch.cuda.mem_get_info`` and ``nvidia-smi`` at every step. torch's own allocator reserve is
recorded too, so the analysis can take it out: what remains is the communicators'.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tools.gpu_check.machine import smi_process_mib, smi_query
from tools.gpu_check.world import device, init_world, sync

__all__ = ["GROUP_COUNTS", "TRIALS", "MemoryTrial", "collect_memory_trial"]

GROUP_COUNTS: tuple[int, ...] = (1, 2, 4, 8)
CREATE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class MemoryTrial:
    """One way of creating the groups."""

    name: str
    method: str
    """``new_group`` or ``split_group``."""
    split_share: bool
    bound: bool
    """The default group is bound to the device (its communicator exists; new groups split it)."""


TRIALS: tuple[MemoryTrial, ...] = (
    MemoryTrial("new_group", "new_group", False, True),
    MemoryTrial("new_group split_share", "new_group", True, True),
    MemoryTrial("split_group", "split_group", False, True),
    MemoryTrial("split_group split_share", "split_group", True, True),
    MemoryTrial("new_group unbound", "new_group", False, False),
)
"""Every trial the GPU check runs, each in its own process."""


def _nccl_options(split_share: bool) -> Any:
    from commgroups import torch_internals

    # ProcessGroupNCCL.Options (ProcessGroupNCCL2 takes the same class); a config without
    # split_share is refused there, naming the field and the torch version.
    return torch_internals.nccl_options(False, {"split_share": 1} if split_share else None)


def _split_count() -> int | None:
    """How many ncclCommSplit the default group's NCCL backend has done (None: not exposed, as on
    ProcessGroupNCCL2, torch 2.15's "nccl", which has no comm_split_count)."""
    try:
        import torch.distributed as dist

        from commgroups import torch_internals

        # Evidence of which creation path torch took; nothing depends on it.
        return torch_internals.nccl_comm_split_count(dist.group.WORLD)  # type: ignore[arg-type]
    except Exception:  # any failure just means "not known"
        return None


def _nccl_class() -> str | None:
    """The default group's CUDA backend class: ProcessGroupNCCL, or ProcessGroupNCCL2 (2.15's
    "nccl"), so a reader knows which NCCL implementation the figures are of."""
    try:
        import torch.distributed as dist

        from commgroups import torch_internals

        return torch_internals.nccl_backend_class(dist.group.WORLD)  # type: ignore[arg-type]
    except Exception:  # any failure just means "not known"
        return None


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import resource

    return pages * resource.getpagesize() / 1e6


def _point(label: str, groups: int | None, smoke: bool, *, context: bool = True) -> dict[str, Any]:
    point: dict[str, Any] = {"label": label, "groups": groups}
    if not smoke and context:
        import torch

        free, total = torch.cuda.mem_get_info()
        point.update(device_used_bytes=int(total - free), device_total_bytes=int(total),
                     torch_reserved_bytes=int(torch.cuda.memory_reserved()),
                     split_count=_split_count(), nccl_class=_nccl_class())
    smi = smi_query("memory.used")
    point["smi_used_mib"] = float(smi[0]) if smi else None
    point["smi_process_mib"] = smi_process_mib()
    point["host_rss_mb"] = _rss_mb()
    return point


def _bring_up(group: Any, smoke: bool) -> None:
    import torch
    import torch.distributed as dist

    one = torch.ones(1, device=device(smoke))
    dist.all_reduce(one, group=group)
    sync(smoke)


def _create(trial: MemoryTrial, smoke: bool) -> Any:
    import torch.distributed as dist

    options = None if smoke else _nccl_options(trial.split_share)
    if trial.method == "split_group":
        if not hasattr(dist, "split_group"):
            raise RuntimeError("torch.distributed.split_group does not exist in this torch")
        return dist.split_group(split_ranks=[[0]], timeout=CREATE_TIMEOUT, pg_options=options,
                                group_desc="cg_memory_probe")
    return dist.new_group([0], timeout=CREATE_TIMEOUT, pg_options=options,
                          group_desc="cg_memory_probe")


def collect_memory_trial(name: str, smoke: bool) -> dict[str, Any]:
    """Run the trial called ``name`` (see :data:`TRIALS`) in this process.

    Returns ``{"trial", "method", "split_share", "bound", "points": [...], "error"}``; points carry
    the memory reads (``label`` start, context, default_group, then groups = 1, 2, 4, 8). An error
    part-way keeps the points read before it.
    """
    import torch
    import torch.distributed as dist

    trial = next((t for t in TRIALS if t.name == name), None)
    if trial is None:
        raise ValueError(f"unknown memory trial {name!r}; one of {[t.name for t in TRIALS]}")
    result: dict[str, Any] = {"trial": trial.name, "method": trial.method,
                              "split_share": trial.split_share, "bound": trial.bound,
                              "points": [], "error": None}
    points: list[dict[str, Any]] = result["points"]
    points.append(_point("start", None, smoke, context=False))
    groups: list[Any] = []
    try:
        if not smoke:
            torch.cuda.set_device(0)
            torch.ones(1, device="cuda")  # the CUDA context, before any communicator
            sync(smoke)
        points.append(_point("context", None, smoke))
        init_world("gloo" if smoke else ("nccl-bound" if trial.bound else "nccl"))
        _bring_up(None, smoke)  # the default group's communicator, up in either mode
        points.append(_point("default_group", None, smoke))
        for target in GROUP_COUNTS:
            while len(groups) < target:
                group = _create(trial, smoke)
                if group is None:
                    raise RuntimeError(f"{trial.method} returned None on rank 0 of a 1-rank world")
                _bring_up(group, smoke)
                groups.append(group)
            points.append(_point("groups", target, smoke))
    except Exception as error:  # recorded with the points read so far
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return result
