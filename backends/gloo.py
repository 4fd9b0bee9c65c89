"""Gloo: CPU collectives; the default for checkpoint metadata and the fallback device backend."""

from __future__ import annotations

from typing import ClassVar

from .base import BackendAdapter


class GlooAdapter(BackendAdapter):
    """Gloo groups take no options; ``wait()`` blocks the calling thread, so async-and-wait == sync.

    After a rank loss their blocked collectives are freed by shutting their sockets down
    (``severs``): gloo's own ``abort()`` frees none.
    """

    name: ClassVar[str] = "gloo"
    torch_backend: ClassVar[str] = "gloo"
    device_type: ClassVar[str] = "cpu"
    connects_on_create: ClassVar[bool] = True
    severs: ClassVar[bool] = True

