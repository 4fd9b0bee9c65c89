"""RCCL: ROCm's NCCL. torch names it "nccl" (ProcessGroupNCCL); ROCm is ``torch.version.hip``.

Everything but the availability check is the NCCL adapter's, so RCCL takes the same options and the
same fallbacks (:mod:`commgroups.torch_internals.nccl_classes`). Which class torch 2.15's "nccl"
is on a ROCm build (ProcessGroupNCCL2 as on CUDA, or the legacy one) is NOT CHECKED: no ROCm wheel
was captured in tests/data/nccl_class_attrs.json.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from commgroups.errors import BackendUnavailableError

from .nccl import NcclAdapter


class RcclAdapter(NcclAdapter):
    """RCCL groups: the NCCL adapter on a ROCm build (same options, same ``nccl`` torch backend)."""

    name: ClassVar[str] = "rccl"

    def check_available(self) -> None:
        """RCCL needs a ROCm build of torch and a visible GPU."""
        if torch.version.hip is None or not torch.cuda.is_available() or not (
            dist.is_nccl_available()
        ):
            raise BackendUnavailableError(
                "backend 'rccl' needs a ROCm build of torch and a visible GPU "
                f"(torch.version.hip={torch.version.hip!r}); fix: run on AMD GPUs, or set the "
                "role's backend to 'device' or 'gloo'"
            )
