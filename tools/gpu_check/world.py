"""The one-rank world every GPU check part runs in, and the layouts it creates.

One GPU means one NCCL rank (NCCL refuses two ranks on one device), so each part is a world of size
one in its own process, and its collectives run on :func:`dedicated_group` (the registry would give a
one-rank role no communicator at all): ``nccl-bound`` (``init_process_group(device_id=cuda:0)``: the default
group's communicator is created eagerly and new groups split from it), ``nccl`` (unbound: each
group's communicator is created on its first collective) or ``gloo`` (the CPU smoke run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from commgroups.layout.specs import Layout

__all__ = ["FOUR_ROLES", "WORLD_MODES", "dedicated_group", "device", "four_role_layout", "init_world",
           "sync"]

WORLD_MODES: tuple[str, ...] = ("nccl-bound", "nccl", "gloo")
FOUR_ROLES: tuple[str, ...] = ("cp", "dp_shard", "tp", "fsdp")
"""The roles of :func:`four_role_layout`, in creation order."""


def init_world(mode: str) -> None:
    """Initialise a one-rank default group in this process (``mode`` from :data:`WORLD_MODES`)."""
    import torch
    import torch.distributed as dist

    if mode not in WORLD_MODES:
        raise ValueError(f"world mode {mode!r} is not one of {', '.join(WORLD_MODES)}")
    store = dist.HashStore()  # type: ignore[attr-defined]  # re-exported at runtime
    if mode == "gloo":
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return
    torch.cuda.set_device(0)
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if mode == "nccl-bound" else {}
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, **kwargs)


def dedicated_group() -> Any:
    """A new group over rank 0 on the default group's backend: a real NCCL communicator (gloo in a
    smoke run), split from the default group's when that is bound to the device.

    Not a registry role: the registry gives every one-rank group its single-rank backend (local
    copies, no communicator), which is right for jobs and would leave nothing NCCL to observe here.
    What ``registry.collectives(role)`` adds on top of the group is :class:`~commgroups.
    RoleCollectives`, which the parts wrap around this group themselves.
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group([0], timeout=timedelta(seconds=120), group_desc="cg_gpu_check")


def device(smoke: bool) -> torch.device:
    """cuda:0, or the CPU in a smoke run."""
    import torch

    return torch.device("cpu") if smoke else torch.device("cuda", 0)


def sync(smoke: bool) -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if not smoke:
        import torch

        torch.cuda.synchronize()


def four_role_layout() -> Layout:
    """A one-rank layout with four device roles: cp, dp_shard, tp and fsdp (dp_shard x cp).

    Every dim has size 1, so every role has one group, [0]; each is still a dedicated communicator.
    """
    from commgroups.layout.specs import Layout, RoleSpec

    return Layout(
        dims={"dp_shard": 1, "cp": 1, "tp": 1},
        roles=[RoleSpec(name="cp", dims=["cp"]), RoleSpec(name="dp_shard", dims=["dp_shard"]),
               RoleSpec(name="tp", dims=["tp"]), RoleSpec(name="fsdp", dims=["dp_shard", "cp"])],
    )
