"""Benchmarks of group layouts, run by ``commgroups bench``.

Scenarios: :mod:`~commgroups.bench.creation` (registry vs DeviceMesh vs an all-ranks new_group loop),
:mod:`~commgroups.bench.planning`, :mod:`~commgroups.bench.async_wait_cost` (async-and-wait overhead),
:mod:`~commgroups.bench.checkpoint` (DCP and the metadata exchange) and
:mod:`~commgroups.bench.memory` (estimated communicator memory), :mod:`~commgroups.bench.rank_loss`
(a rank SIGKILLed mid-step to every survivor rebuilt, and what rebuilds leave behind),
:mod:`~commgroups.bench.rebuild` (rebuild against first creation, by phase) and
:mod:`~commgroups.bench.control_plane` (the control plane at 1,024-65,536 simulated ranks; alone:
``python -m commgroups.bench.control_plane [SIZES...]``). :func:`run_bench` runs them all for a
:class:`BenchConfig`; :mod:`~commgroups.bench.report` renders the result.

The names below are imported on first use: ``python -m commgroups.bench.<scenario>`` then runs
a scenario without the package having imported it first (runpy warns where it had).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commgroups.bench.config import BenchConfig, full_config, quick_config, smoke_config
    from commgroups.bench.runner import BenchResult, run_bench

__all__ = ["BenchConfig", "BenchResult", "full_config", "quick_config", "run_bench", "smoke_config"]

_HOMES = {"BenchConfig": "config", "full_config": "config", "quick_config": "config",
          "smoke_config": "config", "BenchResult": "runner", "run_bench": "runner"}


def __getattr__(name: str) -> Any:
    """The public names, from their modules on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
