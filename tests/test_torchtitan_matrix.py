"""The torchtitan isolation matrix (issue 16): every parallelism pair, stock against commgroups.

Each entry of :data:`tests.titan.matrix.ENTRIES` trains torchtitan's debug model (llama3; qwen3 MoE
for expert parallelism) through commgroups and stock, same seed, 2 steps: losses and grad norms
equal stock's as exact floats on every rank, 0 collectives on the default group, the
checkpoint-metadata group busy only inside DCP save/load, every role torchtitan communicates on
busy, and the collectives per rank set equal stock's (tests/titan/matrix.py says how each is
counted). Worlds are shared: one spawn trains every entry of a world.

Marked ``titan_matrix`` (excluded by default; ``make test-titan`` runs it, on CI's main leg). The
``spmd_types`` backend and pipeline parallelism (torchtitan 0.3.0 calls pipelining's
``step(arg_mbs=...)``) need torch >= 2.14 and are skipped below that.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from commgroups.local_world import run_local_world

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    pytest.mark.titan_matrix,
    pytest.mark.timeout(3600),
]

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
BACKENDS = ("partial_dtensor", "spmd_types")


def _entries() -> list[Any]:
    if importlib.util.find_spec("torchtitan") is None:
        return []
    from tests.titan.matrix import ENTRIES

    return list(ENTRIES)


@pytest.fixture(scope="module")
def matrix_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.titan.assets import make_assets

    root = tmp_path_factory.mktemp("titan-assets")
    make_assets(root)
    return root


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory,
                  matrix_assets: Path) -> Callable[[str, str], dict[str, Any]]:
    """(world, backend) -> entry name -> {"registry": [per rank], "stock": [per rank]}; each
    world runs once, on first use; a failed world's tracebacks come back as ``"error"``."""
    from tests.titan.matrix import matrix_rank, worlds

    grouped = worlds(tuple(_entries()))
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def get(world: str, backend: str) -> dict[str, Any]:
        if (world, backend) in done:
            return done[(world, backend)]
        entries = grouped[world]
        root = tmp_path_factory.mktemp(f"matrix-{world}-{backend}")
        started = time.monotonic()
        reports = run_local_world(matrix_rank, entries[0].world_size, entries, str(root),
                                  str(matrix_assets), backend, timeout_s=3000,
                                  preload=("torch", "torch.distributed", "commgroups"))
        seconds = time.monotonic() - started
        failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
        ranks = range(entries[0].world_size)
        if failed or sorted(reports) != list(ranks):
            out: dict[str, Any] = {"error": "\n".join(
                f"--- rank {r} ---\n{tb}" for r, tb in failed.items()) or
                f"ranks missing: {sorted(set(ranks) - set(reports))}"}
        else:
            out = {entry.name: {side: [reports[r].value[entry.name][side] for r in ranks]
                                for side in ("registry", "stock")} for entry in entries}
        out["seconds"] = seconds
        done[(world, backend)] = out
        return out

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", _entries(), ids=lambda e: e.name)
def test_entry_equals_stock_and_stays_isolated(
        entry: Any, backend: str, world_results: Callable[[str, str], dict[str, Any]]) -> None:
    from tests.titan.matrix import compare, render

    if backend == "spmd_types" and TORCH < (2, 14):
        pytest.skip(f"torchtitan's spmd_types backend needs torch >= 2.14 (this is "
                    f"{torch.__version__}); partial_dtensor runs here")
    if entry.min_torch > TORCH:
        pytest.skip(f"stock torchtitan needs torch >= {entry.min_torch} for {entry.name} (this is "
                    f"{torch.__version__}; see tests/titan/matrix.py)")
    results = world_results(entry.world, backend)
    assert "error" not in results, results.get("error")
    runs = results[entry.name]
    print(f"[{backend}, world {entry.world} took {results['seconds']:.0f}s]")
    print(render(entry, runs["registry"], runs["stock"]))
    problems = compare(entry, runs["registry"], runs["stock"], backend)
    assert not problems, "\n".join(problems)
