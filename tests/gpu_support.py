"""The one skip guard of the GPU-only test modules: a CUDA device and a torch build with NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def require_cuda_and_nccl(needs: str) -> None:
    """Skip the calling test module (at import) without a CUDA device or NCCL.

    Args:
        needs: what the module needs the device for, shown in the skip reason.
    """
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA device ({needs}); torch.cuda.is_available() is False here",
                    allow_module_level=True)
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL; this torch build has none", allow_module_level=True)
