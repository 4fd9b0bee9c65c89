"""Resolve a role's backend name to an adapter, detecting what ``device`` means on this machine."""

from __future__ import annotations

from types import MappingProxyType

import torch

from .base import BackendAdapter
from .fake import FakeAdapter
from .gloo import GlooAdapter
from .hccl import HcclAdapter, npu_available
from .nccl import NcclAdapter
from .rccl import RcclAdapter
from .single_rank import SingleRankAdapter

__all__ = ["adapter_for", "detect_device_backend", "resolve_backend"]

# Read-only: the set of backends is fixed at import time.
_ADAPTERS = MappingProxyType[str, type[BackendAdapter]]({
    "gloo": GlooAdapter,
    "nccl": NcclAdapter,
    "rccl": RcclAdapter,
    "hccl": HcclAdapter,
    "fake": FakeAdapter,
    "single": SingleRankAdapter,
})


def detect_device_backend() -> str:
    """What ``device`` means here: nccl on CUDA, rccl on ROCm, hccl on Ascend, else gloo."""
    if torch.cuda.is_available():
        return "rccl" if torch.version.hip is not None else "nccl"
    if npu_available():
        return "hccl"
    return "gloo"


def adapter_for(name: str) -> BackendAdapter:
    """The adapter of a concrete backend name (gloo, nccl, rccl, hccl, fake, single)."""
    try:
        return _ADAPTERS[name]()
    except KeyError:
        raise ValueError(
            f"no adapter for backend {name!r}; known: {', '.join(_ADAPTERS)}"
        ) from None


def resolve_backend(
    requested: str,
    default_group_backend: str | None = None,
    group_size: int | None = None,
    device_backend: str | None = None,
) -> BackendAdapter:
    """The adapter for a group asking for ``requested``.

    ``device_backend``: what ``device`` means here, when the caller detected it already
    (:func:`detect_device_backend` retries a failed torch_npu import each time: a walk of
    ``sys.path``, slow on shared filesystems).

    Under a ``fake`` default group every group is simulated on ``fake`` (torch allows no other
    subgroups there), so a layout written for GPUs can be planned and created at any world size.
    A group of one rank needs no communicator: it gets the single-rank backend, whose collectives
    are exact local copies, whatever was requested (a 1-rank NCCL communicator costs ~512 MiB).
    """
    if default_group_backend == "fake":
        return FakeAdapter()
    if group_size == 1:
        return SingleRankAdapter()
    if requested == "device":
        requested = device_backend if device_backend is not None else detect_device_backend()
    return adapter_for(requested)
