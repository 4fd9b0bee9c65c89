"""The torchtitan isolation matrix (issue 16): every parallelism pair, stock against commgroups.

Each entry of :data:`tests.titan.matrix.ENTRIES` trains torchtitan's debug model (llama3; qwen3 MoE
for expert parallelism) through commgroups and stock, same seed, 2 steps: losses and grad norms
equal stock's as exact floats on every rank, 0 collectives on the default group, the
checkpoint-metadata group busy only inside DCP save/load, every role torchtitan communicates on
busy, and the collectives per rank set equal stock's (tests/titan/matrix.py says how each is
counted). Worlds are shared: one spawn trains every job of a world size. The jobs in
:data:`tests.titan.matrix.CI_JOBS` are also marked ``titan_ci`` (CI's subset).

Marked ``titan_matrix`` (excluded by default; ``make test-titan`` runs it, CI its ``titan_ci`` jobs). The
``spmd_types`` backend and pipeline parallelism (torchtitan 0.3.0 calls pipelining's
``step(arg_mbs=...)``) need torch >= 2.14 and are skipped below that. Three 4-rank entries also
train under ``full_dtensor`` (torchtitan 0.3.0's third backend; it runs on 2.13).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    pytest.mark.titan_matrix,
    pytest.mark.world,
    pytest.mark.timeout(3600),
]


def _jobs() -> list[Any]:
    if importlib.util.find_spec("torchtitan") is None:
        return []
    from tests.titan.matrix import ENTRIES, Job, job_param

    return [job_param(Job(entry, backend)) for entry in ENTRIES if entry.in_matrix
            for backend in entry.backends]


@pytest.mark.parametrize("job", _jobs())
def test_entry_equals_stock_and_stays_isolated(job: Any, titan_worlds: Any) -> None:
    from tests.titan.matrix import compare, render

    done = titan_worlds.runs(job)
    runs = done.runs
    print(f"[world of {job.entry.world_size} ranks ({', '.join(done.world_jobs)}) took "
          f"{done.world_seconds:.0f}s]")
    print(render(job.entry, runs["registry"], runs["stock"]))
    problems = compare(job.entry, runs["registry"], runs["stock"], job.backend)
    assert not problems, "\n".join(problems)
