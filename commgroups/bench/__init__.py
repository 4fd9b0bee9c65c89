"""Benchmarks of group layouts, run by ``commgroups bench``.

Scenarios: :mod:`~commgroups.bench.creation` (registry vs DeviceMesh vs an all-ranks new_group loop),
:mod:`~commgroups.bench.planning`, :mod:`~commgroups.bench.async_wait_cost` (async-and-wait overhead),
:mod:`~commgroups.bench.checkpoint` (DCP and the metadata exchange) and
:mod:`~commgroups.bench.memory` (estimated communicator memory), :mod:`~commgroups.bench.rank_loss`
(a rank SIGKILLed mid-step to every survivor rebuilt, and what rebuilds leave behind) and
:mod:`~commgroups.bench.rebuild` (rebuild against first creation, by phase). :func:`run_bench` runs
them all for a :class:`BenchConfig`; :mod:`~commgroups.bench.report` renders the result.
"""

from commgroups.bench.config import BenchConfig, full_config, quick_config, smoke_config
from commgroups.bench.runner import BenchResult, run_bench

__all__ = ["BenchConfig", "BenchResult", "full_config", "quick_config", "run_bench", "smoke_config"]
