"""What the GPU check ran on: GPU, driver, CUDA, torch, NCCL and Python versions; nvidia-smi reads.

Every probe answers None rather than raising: a missing nvidia-smi or a CPU-only torch is a fact to
record, not a failure.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

__all__ = ["machine_info", "smi_process_mib", "smi_query"]

SMI_TIMEOUT_S = 20.0


def smi_query(fields: str) -> list[str] | None:
    """``nvidia-smi --query-gpu=<fields>`` for GPU 0 as strings; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.strip().splitlines()[0] if out.strip() else ""
    return [cell.strip() for cell in line.split(",")] if line else None


def smi_process_mib(pid: int | None = None) -> float | None:
    """Device memory (MiB) nvidia-smi charges to process ``pid`` (this one by default); None if
    nvidia-smi is missing or does not list it (containers often hide other pid namespaces)."""
    if shutil.which("nvidia-smi") is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0] == str(pid):
            try:
                return float(cells[1])
            except ValueError:
                return None
    return None


def machine_info() -> dict[str, Any]:
    """Versions and the GPU; imports torch but creates no CUDA context unless CUDA is available."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "executable": sys.executable,
    }
    smi = smi_query("name,driver_version,memory.total")
    if smi is not None and len(smi) == 3:
        info.update(gpu=smi[0], driver=smi[1], smi_memory_total_mib=smi[2])
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:
        info["torch"] = f"unavailable: {error}"
        return info
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    info["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    if info["cuda_available"]:
        try:
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (RuntimeError, AttributeError) as error:
            info["nccl"] = f"unknown: {error}"
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = info.get("gpu") or props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
    for name in ("pydantic", "numpy", "spmd_types"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "present")
        except ImportError:
            info[name] = None
    return info
