"""Collect: how long creating a four-role layout's groups takes on the bound default group.

Raw torch (``new_group`` for all ranks, ``new_group(use_local_synchronization=True)``,
``split_group``) against the registry's creation modes, on a one-rank device-bound NCCL world: four
groups per repetition, each brought up by a first one-element all_reduce (timed apart: NCCL may
connect lazily). The registry gives one-rank roles its single-rank backend (no communicator, local
copies), so its rows show what a size-1 role costs a job, against NCCL communicators from raw torch;
``paths`` names the backend and creation path each took. Member-only creation is known to hang
with a device-bound NCCL default group on several ranks, so the orchestrator runs it in its own
process under its own timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tools.gpu_check.world import FOUR_ROLES, device, four_role_layout, init_world, sync

__all__ = ["METHODS", "collect_creation"]

METHODS: tuple[str, ...] = ("new_group all_ranks", "new_group local", "split_group",
                            "registry all_ranks", "registry split", "registry auto")
TIMEOUT = timedelta(seconds=120)


def _options(smoke: bool) -> Any:
    if smoke:
        return None
    from commgroups import torch_internals

    # ProcessGroupNCCL.Options, which ProcessGroupNCCL2 (torch 2.15's "nccl") takes too; a fresh
    # one per group: new_group mutates it.
    return torch_internals.nccl_options()


def _raw(method: str, smoke: bool) -> Callable[[str], Any]:
    import torch.distributed as dist

    if method == "split_group":
        return lambda role: dist.split_group(split_ranks=[[0]], timeout=TIMEOUT,
                                             pg_options=_options(smoke), group_desc=role)
    local = method == "new_group local"
    return lambda role: dist.new_group([0], timeout=TIMEOUT, pg_options=_options(smoke),
                                       use_local_synchronization=local, group_desc=role)


def _first_collective(groups: list[Any], smoke: bool) -> float:
    import torch
    import torch.distributed as dist

    one = torch.ones(1, device=device(smoke))
    start = time.perf_counter()
    for group in groups:
        dist.all_reduce(one, group=group)
    sync(smoke)
    return time.perf_counter() - start


def _measure(method: str, reps: int, smoke: bool, keep: list[Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import commgroups as cg

    row: dict[str, Any] = {"method": method, "create_s": [], "first_collective_s": [],
                           "calls": len(FOUR_ROLES), "paths": None, "error": None}
    for _ in range(reps):
        start = time.perf_counter()
        if method.startswith("registry"):
            registry = cg.GroupRegistry(four_role_layout(), creation_mode=method.split()[1]).create()
            sync(smoke)
            row["create_s"].append(time.perf_counter() - start)
            groups = [registry.group(role) for role in FOUR_ROLES]
            row["paths"] = sorted({f"{registry.resolved_backend(role)}/{registry.creation_method(role)}"
                                   for role in FOUR_ROLES})
            row["first_collective_s"].append(_first_collective(groups, smoke))
            registry.close()
            continue
        make = _raw(method, smoke)
        groups = [make(role) for role in FOUR_ROLES]
        sync(smoke)
        row["create_s"].append(time.perf_counter() - start)
        if any(g is None for g in groups):
            raise RuntimeError(f"{method} returned None on rank 0 of a 1-rank world")
        row["first_collective_s"].append(_first_collective(groups, smoke))
        if method == "new_group local":
            # Never destroyed here: torch would hand the next member-only group the same hashed
            # name, whose stale rendezvous keys hang creation (see commgroups.creation.role_groups).
            keep.extend(groups)
        else:
            for group in groups:
                dist.destroy_process_group(group)
    return row


def collect_creation(smoke: bool, methods: tuple[str, ...] = METHODS,
                     reps: int | None = None) -> dict[str, Any]:
    """Time each of ``methods``; returns ``{"methods": [...]}``, one failing method recorded."""
    import torch.distributed as dist

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown creation methods {unknown}; use some of {list(METHODS)}")
    reps = reps if reps is not None else (2 if smoke else 3)
    init_world("gloo" if smoke else "nccl-bound")
    rows: list[dict[str, Any]] = []
    keep: list[Any] = []
    try:
        for method in methods:
            try:
                rows.append(_measure(method, reps, smoke, keep))
            except Exception as error:  # recorded; the other methods still run
                rows.append({"method": method, "error": f"{type(error).__name__}: {error}"})
        return {"methods": rows, "reps": reps}
    finally:
        dist.destroy_process_group()
