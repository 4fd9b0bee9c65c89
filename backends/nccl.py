"""NCCL: CUDA collectives, with per-role ``ProcessGroupNCCL.Options``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import constants

from commgroups import torch_internals
from commgroups.errors import BackendUnavailableError
from commgroups.specs import RoleOptions

from .base import BackendAdapter

# NcclOptions field -> attribute of ProcessGroupNCCL.Options.config (ncclConfig_t).
_CONFIG_FIELDS = ("cga_cluster_size", "min_ctas", "max_ctas", "net_name", "split_share", "blocking")


class NcclAdapter(BackendAdapter):
    """NCCL groups; options come from the role's ``options.nccl`` section."""

    name: ClassVar[str] = "nccl"
    torch_backend: ClassVar[str] = "nccl"
    device_type: ClassVar[str] = "cuda"
    supports_split: ClassVar[bool] = True
    connects_on_create: ClassVar[bool] = True
    aborts: ClassVar[bool] = True

    def abort(self, group: Any) -> None:
        """``ncclCommAbort`` through c10d (:func:`commgroups.torch_internals.abort_group`).

        Not run on a GPU by commgroups' tests (one GPU holds no group with a peer to lose); the
        call itself is checked to exist on torch 2.10-2.15.
        """
        torch_internals.abort_group(group)

    def check_available(self) -> None:
        """NCCL needs a CUDA build of torch with NCCL and a visible CUDA device."""
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"backend {self.name!r} needs a CUDA device and a torch build with NCCL "
                f"(nccl available: {dist.is_nccl_available()}, cuda available: "
                f"{torch.cuda.is_available()}); fix: run on GPUs, or set the role's backend to "
                "'device' (falls back to gloo) or 'gloo'"
            )

    def default_timeout(self) -> timedelta:
        """torch's NCCL default (10 minutes) where defined, else the general default."""
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout

    def make_options(self, options: RoleOptions, timeout: timedelta) -> Any | None:
        """A fresh ``ProcessGroupNCCL.Options``: new_group mutates it, so never share one."""
        section = options.nccl
        if section is None:
            return None
        nccl_options = dist.ProcessGroupNCCL.Options(
            is_high_priority_stream=section.high_priority_stream
        )
        for field in _CONFIG_FIELDS:
            value = getattr(section, field)
            if value is None:
                continue
            if field in ("split_share", "blocking"):
                value = int(value)
            setattr(nccl_options.config, field, value)
        torch_internals.set_options_timeout(nccl_options, timeout)
        return nccl_options
