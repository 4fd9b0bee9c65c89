"""Smoke test of ``commgroups bench``: the smallest run of every scenario, keys and sane numbers.

No timing assertions: the numbers of a smoke run are meaningless; only their shape is checked.

Its tests that start processes are in ``tests/test_bench_smoke_world.py`` (marked ``world``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commgroups.bench import smoke_config
from commgroups.bench.stats import Summary, interleaved, paired_ratios, summarize
from commgroups.cli import main
from commgroups.layout.specs import HcclOptions, Layout, RoleOptions, RoleSpec
from commgroups.planning.memory import SPLIT_PARENT, estimate_memory


def test_stats_helpers() -> None:
    assert summarize([3.0, 1.0, 2.0]) == Summary(2.0, 1.5, 2.5, 3)
    assert paired_ratios([2.0, 3.0], [1.0, 0.0]) == [2.0]
    assert [interleaved(("a", "b", "c"), r)[0] for r in range(3)] == ["a", "b", "c"]
    assert smoke_config().gloo_worlds == (4,)


def test_memory_estimate() -> None:
    layout = Layout(dims={"dp_shard": 2, "cp": 4})
    nccl = estimate_memory(layout, device_backend="nccl")
    assert nccl.device_communicators == 3  # dp_shard, cp, fsdp; checkpoint-metadata is gloo
    assert (nccl.low_mb, nccl.high_mb) == (3 * 544.0, 3 * 688.0)
    shared = estimate_memory(layout, device_backend="nccl", creation="split", split_share=True)
    assert [r.role for r in shared.roles][-1] == SPLIT_PARENT
    assert (shared.low_mb, shared.high_mb) == (544.0, 688.0)
    # split_share needs split creation: under all_ranks it changes nothing.
    assert estimate_memory(layout, split_share=True).high_mb == nccl.high_mb
    hccl = estimate_memory(layout, device_backend="hccl")
    assert hccl.high_mb == 600.0
    small = Layout(dims={"cp": 4}, roles=[
        RoleSpec(name="cp", dims=["cp"], options=RoleOptions(hccl=HcclOptions(buffer_size_mb=50))),
        RoleSpec(name="solo", ranks=[[0]]),
    ])
    estimate = estimate_memory(small, 0, device_backend="hccl")
    assert [r.high_mb for r in estimate.roles] == [50.0, 200.0]
    solo = estimate_memory(small, 0, device_backend="nccl").roles[1]
    assert solo.low_mb == pytest.approx(536.87, abs=0.01)  # 512 MiB, nccl#2363
    assert estimate_memory(small, 1, device_backend="nccl").roles[1].communicators == 0


def test_plan_command_shows_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "layout.toml"
    path.write_text('dims = { dp_shard = 2, cp = 4 }\n')
    assert main(["plan", str(path)]) == 0
    assert "estimated communicator memory on rank 0 (device = nccl" in capsys.readouterr().out
    assert main(["plan", str(path), "--json", "--device", "hccl"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["high_mb"] == 600.0
