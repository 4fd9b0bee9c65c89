"""The fake backend: simulate any world size in one process (collectives move no data)."""

from __future__ import annotations

from typing import ClassVar

from .base import BackendAdapter


class FakeAdapter(BackendAdapter):
    """Groups on torch's ``fake`` backend; used for every role when the default group is fake.

    Registering the backend needs ``import torch.testing._internal.distributed.fake_pg``; under a fake
    default group only fake subgroups can be made, so every role is created on it.
    """

    name: ClassVar[str] = "fake"
    torch_backend: ClassVar[str] = "fake"
    device_type: ClassVar[str] = "cpu"
    # Fake collectives move no data and never wait: there is no timeout to change, and torch warns
    # ("only supported for either nccl or gloo") when asked to.
    has_timeout: ClassVar[bool] = False

