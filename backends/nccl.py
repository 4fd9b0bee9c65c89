"""NCCL: CUDA collectives, with per-role ``ProcessGroupNCCL.Options``.

torch's ``nccl`` backend is ``ProcessGroupNCCL`` up to 2.14 and ``ProcessGroupNCCL2`` from 2.15
(``nccl-legacy`` or ``TORCH_DIST_USE_NCCL2=0`` keep the old class). This adapter reads nothing of
either class itself: :mod:`commgroups.torch_internals.nccl_classes` does, with the attributes it
reads and its fallback for each listed there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import constants

from commgroups import torch_internals
from commgroups.errors import BackendUnavailableError
from commgroups.layout.specs import RoleOptions

from .base import BackendAdapter

# NcclOptions field -> attribute of ProcessGroupNCCL.Options.config (ncclConfig_t).
_CONFIG_FIELDS = ("cga_cluster_size", "min_ctas", "max_ctas", "net_name", "split_share", "blocking")


def _nccl_version() -> str:
    """The NCCL version torch was built with (``torch.cuda.nccl.version()``), or "unknown"."""
    try:
        nccl: Any = torch.cuda.nccl  # its version() is untyped on every checked torch
        version = nccl.version()
    except Exception:  # a CPU build, or no NCCL library: only used in messages
        return "unknown"
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


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

        What was run: CI checks the call exists on torch 2.10-2.15 and that rebuild() reaches it
        (mocked NCCL, ``tests/test_gpu_rebuild_mocked.py``); the GPU check aborts a real one-rank
        NCCL group through it during a rebuild (``tests/test_gpu_rebuild.py``). Not run: an abort
        with a dead peer (one GPU holds no group with a peer to lose).
        """
        torch_internals.abort_group(group)

    def shrink_blocker(self, group: Any) -> str | None:
        """None when ``torch.distributed.shrink_group`` can shrink ``group`` here, else why not.

        Needs torch's public ``shrink_group`` (2.10+) with its ``SHRINK_ABORT`` flag, and the
        group's NCCL backend reporting ``supports_shrinking`` (ncclCommShrink, NCCL >= 2.27), read
        on the group's bound device (else cuda) as torch's own shrink_group reads it. It gates
        ``rebuild()``'s shrink path (:mod:`commgroups.creation.shrink`, asked of the group it would
        shrink). Not run on a GPU in CI (mocked there); the GPU check prints its machine's answer.
        """
        if not callable(getattr(dist, "shrink_group", None)):
            return f"torch {torch.__version__} has no torch.distributed.shrink_group (torch >= 2.10)"
        if torch_internals.shrink_abort_flag() is None:
            return (f"torch {torch.__version__} has no SHRINK_ABORT flag for shrink_group (a parent "
                    "with a dead peer must have its work aborted first)")
        device = getattr(group, "bound_device_id", None) or torch.device("cuda")
        supported = torch_internals.backend_supports_shrinking(group, device)
        if supported is None:
            return (f"torch cannot tell whether the group's backend on {device} can shrink (no "
                    "such backend, or no supports_shrinking property)")
        if not supported:
            return ("the group's NCCL backend reports supports_shrinking=False (ncclCommShrink "
                    f"needs NCCL >= 2.27; this torch was built with NCCL {_nccl_version()})")
        return None

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
        """A fresh ``ProcessGroupNCCL.Options`` (new_group mutates it, so never share one).

        The one Options class both NCCL implementations take: ``ProcessGroupNCCL`` (``nccl`` before
        2.15, ``nccl-legacy``) and ``ProcessGroupNCCL2`` (``nccl`` from 2.15), built by
        :func:`commgroups.torch_internals.nccl_options`, which refuses a config field this torch
        lacks, naming it. CI builds it against fakes with the real classes' attributes (mocked
        NCCL, ``tests/test_nccl.py``); not run on a GPU here.
        """
        section = options.nccl
        if section is None:
            return None
        config: dict[str, int | str] = {}
        for field in _CONFIG_FIELDS:
            value = getattr(section, field)
            if value is None:
                continue
            config[field] = int(value) if field in ("split_share", "blocking") else value
        nccl_options = torch_internals.nccl_options(section.high_priority_stream, config)
        torch_internals.set_options_timeout(nccl_options, timeout)
        return nccl_options
