"""Communicator backends: one adapter per backend (gloo, nccl, rccl, hccl, fake, single) and detection.

Installed as ``commgroups.backends``; the source folder sits beside ``commgroups/``.
"""

from .base import BackendAdapter, GroupArgs
from .detection import adapter_for, detect_device_backend, resolve_backend

__all__ = ["BackendAdapter", "GroupArgs", "adapter_for", "detect_device_backend", "resolve_backend"]
