"""Smoke test of ``commgroups bench``: the smallest run of every scenario, keys and sane numbers.

No timing assertions: the numbers of a smoke run are meaningless; only their shape is checked.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_bench_smoke.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from commgroups.cli import main

pytestmark = pytest.mark.world


TABLES = ("creation", "creation_first", "kill_to_rebuilt", "rebuild_resources", "rebuild", "planning",
          "async_and_wait", "checkpoint_dcp", "checkpoint_exchange", "memory")


def _numbers(cell: Any) -> list[float]:
    if isinstance(cell, dict) and "median" in cell:
        return [cell["median"], cell["p25"], cell["p75"]]
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return [float(cell)]
    return []


class _Counting:
    def __init__(self) -> None:
        self.total = 0
        self.done = 0

    def add_total(self, units: int) -> None:
        self.total += units

    def advance(self, units: int = 1) -> None:
        self.done += units

    def describe(self, text: str) -> None:
        pass


# One smoke run for every check of it: a run takes 40-50 s on 2 cores (two runs took half of the
# suite's slowest minute).
def test_bench_smoke_json_and_plots_and_progress(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    progress = _Counting()  # --no-progress's bar: the run announces its total, then advances
    monkeypatch.setattr("commgroups.bench.progress.NullProgress", lambda: progress)
    assert main(["bench", "--smoke", "--no-progress", "--json", str(out), "--plot", str(plots),
                 "--markdown", str(tmp_path / "bench.md")]) == 0
    assert progress.total == progress.done > 0
    data = json.loads(out.read_text())
    for key in ("async_and_wait_overhead_ratio", "creation_ratio_vs_devicemesh"):
        assert isinstance(data[key], float) and math.isfinite(data[key]) and data[key] > 0, key
    assert set(TABLES) <= set(data["tables"])
    assert data["machine"]["nproc"] >= 1 and data["machine"]["torch"]
    assert data["config"]["name"] == "smoke"
    for name in TABLES:
        table = data["tables"][name]
        assert table["rows"], name
        # A growth is signed: a count taken while a connection still closes can fall later
        # (torch 2.15's gloo: fds after create varied 45-51 over rebuilds, a growth of -1 once).
        signed = {i for i, column in enumerate(table["columns"]) if column.endswith("growth")}
        for row in table["rows"]:
            assert len(row) == len(table["columns"])
            for index, cell in enumerate(row):
                for value in _numbers(cell):
                    assert math.isfinite(value) and (value >= 0 or index in signed), (name, row)
    # Timing cells are strictly positive; a zero would mean nothing was timed.
    for name, column in (("creation", "time ms"), ("creation", "close ms"),
                         ("creation_first", "time ms"), ("planning", "time ms"),
                         ("async_and_wait", "raw us"), ("async_and_wait", "async-and-wait us"),
                         ("checkpoint_dcp", "time ms"), ("checkpoint_exchange", "time ms")):
        index = data["tables"][name]["columns"].index(column)
        assert all(row[index]["median"] > 0 for row in data["tables"][name]["rows"]), name
    # The registry gives every role its own group; DeviceMesh aliases the world-spanning fsdp dim.
    creation = data["tables"]["creation"]
    cols = creation["columns"]
    for row in creation["rows"]:
        cells = dict(zip(cols, row))
        if cells["variant"].startswith("registry"):
            assert cells["roles aliasing default group"] == 0
        if cells["variant"] == "devicemesh":
            assert cells["roles aliasing default group"] >= 1
    # Rebuild: every phase measured on the gloo world and the simulated one, as a ratio too.
    rebuild = data["tables"]["rebuild"]
    whats = {(row[0], row[2]) for row in rebuild["rows"]}
    for world in (4, 64):
        assert {(world, w) for w in ("create", "rebuild", "phase check_in", "phase retire",
                                     "phase create", "phase meshes")} <= whats
    assert data["summary"]["rebuild_ratio_vs_create_gloo4"] > 0
    # Kill to rebuilt: both variants on 4 ranks, every part; the headline figure in the JSON.
    kill = data["tables"]["kill_to_rebuilt"]
    parts = {(row[0], row[1], row[2]) for row in kill["rows"]}
    for variant in ("rebuild()", "rebuild(alive=)"):
        assert {(4, variant, what) for what in ("kill -> rebuilt", "detection", "phase check_in",
                                                "phase create", "phase release")} <= parts
    assert set(data["kill_to_rebuilt_s"]) == {"4"} and data["kill_to_rebuilt_s"]["4"] > 0
    # Control plane: the check-in decided the one lost virtual rank out, through the real store,
    # at a per-rank request count that a job's size does not change.
    assert set(data["control_plane_check_in_s"]) == {"64"}
    assert 0 < data["control_plane_check_in_s"]["64"] < 60
    assert data["control_plane_requests_per_rank_s"]["64"] <= 1.0
    (row,) = data["tables"]["control_plane"]["rows"]
    assert 5 <= float(dict(zip(data["tables"]["control_plane"]["columns"], row))[
        "check-in req/rank"]) <= 20
    # Resources: counted at every stage, growth and one generation's cost side by side.
    resources = {row[0]: dict(zip(data["tables"]["rebuild_resources"]["columns"], row))
                 for row in data["tables"]["rebuild_resources"]["rows"]}
    assert {"fds", "threads", "process groups", "store keys"} <= set(resources)
    assert resources["process groups"]["one generation's cost"] > 0
    assert sorted(p.name for p in plots.glob("*.png")) == [
        "async_and_wait.png", "checkpoint.png", "creation.png", "memory.png", "planning.png"]
    assert "async_and_wait_overhead_ratio" in capsys.readouterr().out


def test_a_scenario_runs_alone_without_the_package_importing_it_first() -> None:
    """``python -m commgroups.bench.control_plane`` warned (runpy's "found in sys.modules")
    once per process when the package imported every scenario up front."""
    code = ("import sys, commgroups.bench as b; "
            "print(sorted(m for m in sys.modules if m.startswith('commgroups.bench.'))); "
            "print(b.run_bench.__module__, b.quick_config().name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "commgroups.bench.runner quick"], out
