"""The files a GPU check leaves, and how to rebuild the derived ones from the measured ones.

Measured (written by the orchestrator): ``measurements.json`` and ``traces.json``. Derived (pure,
rebuilt by :func:`write_derived` or ``python -m tools.gpu_check analyze DIR``):
``analysis.json``, ``report.md``, ``report.png`` and ``memory.json``, the measured per-communicator
figures that ``commgroups plan --measured`` reads (schema in :mod:`commgroups.planning.memory`). No torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from commgroups.planning.memory import MEASURED_SCHEMA
from tools.gpu_check.analysis import Analysis, analyze
from tools.gpu_check.report import markdown, write_png

__all__ = [
    "ANALYSIS",
    "MEASUREMENTS",
    "MEMORY",
    "REPORT_MD",
    "REPORT_PNG",
    "TRACES",
    "load_and_write",
    "measured_memory",
    "write_derived",
]

MEASUREMENTS = "measurements.json"
TRACES = "traces.json"
ANALYSIS = "analysis.json"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
MEMORY = "memory.json"


def measured_memory(analysis: Analysis) -> dict[str, Any] | None:
    """The ``memory.json`` document for :func:`commgroups.planning.memory.load_measured`; None when the
    check measured no communicator (a smoke run, or the memory part failed)."""
    if analysis.smoke or not analysis.memory_figures:
        return None
    machine = analysis.machine
    source = {k: machine.get(k) for k in ("gpu", "driver", "cuda", "torch", "nccl", "date_utc")}
    return {
        "schema": MEASURED_SCHEMA,
        "source": source,
        "how": ("commgroups GPU check: device memory per eagerly initialised communicator on one "
                "GPU (mem_get_info less torch's allocator reserve), 8 groups per trial"),
        "communicators": [
            {k: figure[k] for k in ("backend", "case", "group_size", "mb", "trials",
                                    "estimate_mb")}
            for figure in analysis.memory_figures
        ],
    }


def write_derived(directory: str | Path, measurements: Mapping[str, Any],
                  traces: Mapping[str, Any]) -> list[Path]:
    """Analyse and write analysis.json, report.md, report.png (with matplotlib) and memory.json.

    Returns:
        The paths written.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    analysis = analyze(measurements, traces)
    written = [out / ANALYSIS, out / REPORT_MD]
    (out / ANALYSIS).write_text(json.dumps(analysis.to_dict(), indent=1, default=str) + "\n")
    (out / REPORT_MD).write_text(markdown(analysis))
    png = write_png(analysis, traces, out / REPORT_PNG)
    if png is not None:
        written.append(png)
    memory = measured_memory(analysis)
    if memory is not None:
        (out / MEMORY).write_text(json.dumps(memory, indent=1) + "\n")
        written.append(out / MEMORY)
    return written


def load_and_write(directory: str | Path) -> list[Path]:
    """Re-analyse the measured files in ``directory`` (``analyze DIR``) and rewrite the derived."""
    folder = Path(directory)
    measurements = json.loads((folder / MEASUREMENTS).read_text())
    traces_path = folder / TRACES
    traces = json.loads(traces_path.read_text()) if traces_path.exists() else {}
    return write_derived(folder, measurements, traces)
