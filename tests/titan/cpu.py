"""Process-local patches that let stock torchtitan 0.3.0 train on CPU gloo ranks (tests only).

torchtitan targets accelerators; every patch below changes attributes of modules in this process
only (installed files are never edited) and is needed by stock torchtitan and by torchtitan through
commgroups alike, so the two runs stay comparable:

1. device type: torchtitan picks ``_get_available_device_type() or "cuda"`` when it is imported;
   it must see "cpu" (so this runs before torchtitan is imported).
2. device memory monitor: ``torch.cpu`` lacks get_device_name, get_device_properties,
   reset_peak_memory_stats, empty_cache and memory_stats.
3. flex attention: torch refuses FlexAttention backward on CPU in its device check though the eager
   path is differentiable, and torchtitan wraps it (and create_block_mask) in torch.compile; use
   eager flex attention.
4. FSDP gradient division: torchtitan sets the divide factor to 1.0, which FSDP2 issues as a
   PREMUL_SUM reduce-scatter that gloo lacks: :func:`force_sum_reduction` after the trainer is built.
5. ``set_pg_timeouts`` barriers with ``device_ids=[device_module.current_device()]``; ``torch.cpu``
   answers the string "cpu", which BarrierOptions refuses: the same function without device ids.
6. torch 2.13 lacks ``torch.distributed.set_timeout`` (its ``_set_pg_timeout`` has the signature).
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests import torch_private

__all__ = ["apply_cpu_patches", "force_sum_reduction"]

_APPLIED = "__commgroups_titan_cpu_patched__"


def _cpu_device_module() -> None:
    cpu = torch.cpu
    extras: dict[str, Any] = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(
            total_memory=64 * 1024**3, name="cpu"),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: {},
    }
    for name, fn in extras.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)


def _flex_attention_eager() -> None:
    import torch.nn.attention.flex_attention as flex

    target = torch_private.flex_validate_device_target()
    original = getattr(*target)

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "cpu":
            return  # eager flex attention is differentiable on CPU; only the check refuses
        original(query, key, value)

    setattr(*target, validate_device)

    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask


def _set_pg_timeouts_without_device_ids() -> None:
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        # Stock's body, minus barrier(device_ids=...) which gloo on CPU refuses.
        dist.barrier()
        groups = [mesh.get_group()
                  for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            dist.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def apply_cpu_patches() -> None:
    """Apply the patches above in this process (idempotent). Call before importing torchtitan."""
    if getattr(torch.cpu, _APPLIED, False):
        return
    if any(name == "torchtitan" or name.startswith("torchtitan.") for name in sys.modules):
        raise RuntimeError("apply_cpu_patches() must run before torchtitan is imported")
    if not hasattr(dist, "set_timeout"):  # torch 2.13
        def set_timeout(timeout: timedelta, group: Any = None) -> None:
            torch_private.set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout  # type: ignore[attr-defined]
    _cpu_device_module()
    with torch_private.replaced(torch_private.available_device_type_target(), lambda: "cpu"):
        import torchtitan.tools.utils  # noqa: F401  binds device_type = "cpu" at import
    import torchtitan.tools.utils as titan_utils

    assert titan_utils.device_type == "cpu", titan_utils.device_type
    _flex_attention_eager()
    _set_pg_timeouts_without_device_ids()
    setattr(torch.cpu, _APPLIED, True)


def force_sum_reduction(model_parts: list[torch.nn.Module]) -> int:
    """Make every FSDP module reduce with SUM (gloo has no PREMUL_SUM); returns how many."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                count += 1
    return count
