"""HCCL: Ascend NPU collectives through torch_npu, imported lazily.

torch_npu is never a hard dependency: without the Ascend CANN toolkit it fails to import (ImportError,
or RuntimeError when libhccl.so is missing), so every import of it lives in a function here.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any, ClassVar

from commgroups import torch_internals
from commgroups.errors import BackendUnavailableError
from commgroups.layout.specs import RoleOptions

from .base import BackendAdapter

logger = logging.getLogger(__name__)


def import_torch_npu() -> ModuleType:
    """Import torch_npu, turning every way it can fail into BackendUnavailableError."""
    try:
        import torch_npu  # type: ignore[import-not-found]
    except (ImportError, RuntimeError, OSError) as error:
        raise BackendUnavailableError(
            f"backend 'hccl' needs torch_npu and the Ascend CANN toolkit ({error}); fix: install "
            "commgroups[npu] on an Ascend machine with CANN, or set the role's backend to 'device' "
            "or 'gloo'"
        ) from error
    return torch_npu  # type: ignore[no-any-return]


def npu_available() -> bool:
    """True when torch_npu imports and an NPU is visible; never raises.

    Where ``import torch`` loads device extensions (torch's default), an installed torch_npu is
    imported already (its ``torch.backends`` entry point): not imported means not installed, and
    no import is tried. A failed import walks ``sys.path`` each time (1 ms of create()'s CPU
    per rank here; slow on shared filesystems).
    """
    if "torch_npu" not in sys.modules and torch_internals.device_backend_autoload_enabled():
        return False
    try:
        torch_npu = import_torch_npu()
        return bool(torch_npu.npu.is_available())
    except (BackendUnavailableError, AttributeError):
        return False


class HcclAdapter(BackendAdapter):
    """HCCL groups; options come from the role's ``options.hccl`` section.

    Member-only creation hangs on HCCL, so groups are always created by every rank.
    """

    name: ClassVar[str] = "hccl"
    torch_backend: ClassVar[str] = "hccl"
    device_type: ClassVar[str] = "npu"
    supports_local_creation: ClassVar[bool] = False
    aborts: ClassVar[bool] = True

    def abort(self, group: Any) -> None:
        """Free ``group``'s HCCL communicators after a rank loss, without its peers.

        Through c10d (:func:`commgroups.torch_internals.abort_group`): for a non-default group,
        ``_abort_process_group`` calls ``ProcessGroup.abort()``, which reaches the C++
        ``ProcessGroupHCCL::abort()`` override (it destroys the group's communicators; torch_npu
        also binds ``abort_hccl_comm`` on its ``ProcessGroupHCCL``, which commgroups does not use).
        Needs no torch_npu import. NOT RUN anywhere by commgroups: torch_npu needs the Ascend
        CANN toolkit, never installed in CI, and no NPU check exists; CI checks only that
        rebuild() routes an HCCL group here (mocked HCCL, ``tests/test_gpu_rebuild_mocked.py``).
        """
        torch_internals.abort_group(group)

    def check_available(self) -> None:
        """HCCL needs torch_npu and a visible NPU."""
        torch_npu = import_torch_npu()
        if not torch_npu.npu.is_available():
            raise BackendUnavailableError(
                "backend 'hccl' found torch_npu but no NPU; fix: run on Ascend NPUs, or set the "
                "role's backend to 'device' or 'gloo'"
            )

    def make_options(self, options: RoleOptions, timeout: timedelta) -> Any | None:
        """A fresh ``ProcessGroupHCCL.Options``; ``hccl_config`` is assigned as one whole dict."""
        section = options.hccl
        if section is None:
            return None
        import_torch_npu()
        hccl_options = torch_internals.hccl_process_group_class().Options()
        # torch_npu reads hccl_config only when assigned whole; item assignment is silently lost.
        hccl_options.hccl_config = section.hccl_config()
        torch_internals.set_options_timeout(hccl_options, timeout)
        return hccl_options
