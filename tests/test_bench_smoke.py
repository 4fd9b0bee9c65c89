"""Smoke test of ``commgroups bench``: the smallest run of every scenario, keys and sane numbers.

No timing assertions: the numbers of a smoke run are meaningless; only their shape is checked.

Its tests that start processes are in ``tests/test_bench_smoke_world.py`` (marked ``world``).
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from commgroups.bench import smoke_config, stats
from commgroups.bench.stats import Summary, interleaved, paired_ratios, summarize
from commgroups.cli import main
from commgroups.layout.specs import HcclOptions, Layout, RoleOptions, RoleSpec
from commgroups.planning.memory import SPLIT_PARENT, estimate_memory


def test_stats_helpers() -> None:
    assert summarize([3.0, 1.0, 2.0]) == Summary(2.0, 1.5, 2.5, 3)
    assert paired_ratios([2.0, 3.0], [1.0, 0.0]) == [2.0]
    assert doctest.testmod(stats).failed == 0
    variants = ("a", "b", "c", "d", "e")
    orders = [interleaved(variants, r) for r in range(2 * len(variants))]
    assert all(sorted(order) == list(variants) for order in orders)
    for first in variants:  # every pair in both orders equally often, every variant first twice
        assert sum(order[0] == first for order in orders) == 2
        for second in variants:
            if first != second:
                before = [order.index(first) < order.index(second) for order in orders]
                assert sum(before[:2]) == 1 and sum(before) == len(variants)
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


def _survivor(rank: int, place: str, failed: float, rebuilt: float, sum_: float = 2.0,
              lost: tuple[int, ...] = (3,)) -> dict[str, object]:
    seconds = dict.fromkeys(("check_in", "replan", "retire", "create", "meshes", "release"), 0.1)
    return {"rank": rank, "place": place, "failed_at": failed, "rebuilt_at": rebuilt,
            "seconds": seconds, "lost": list(lost), "members": [0, 1], "sum": sum_}


def test_rank_loss_sample_is_the_slowest_member_and_checks_the_rebuild() -> None:
    from commgroups.bench import rank_loss
    from commgroups.bench.world import WorldFailed

    seen = [_survivor(0, "member", 100.01, 100.9), _survivor(1, "member", 100.02, 101.0),
            _survivor(2, "dropped", 100.005, 100.5)]
    sample = rank_loss._sample(4, "rebuild()", 3, 100.0, 0.05, seen)
    assert sample["kill_to_rebuilt"] == pytest.approx(1.0)  # rank 1, not the dropped rank 2
    assert sample["detection"] == pytest.approx(0.02)
    assert sample["unaccounted"] == pytest.approx(1.0 - 0.02 - 0.6)
    assert sample["first_detection"] == pytest.approx(0.005)
    assert (sample["members"], sample["dropped"]) == (2, 1)
    with pytest.raises(WorldFailed, match="rebuilt wrongly"):
        rank_loss._sample(4, "rebuild()", 3, 100.0, 0.05,
                          [_survivor(0, "member", 100.01, 100.9, sum_=3.0)])
    with pytest.raises(WorldFailed, match="saw no failure"):
        rank_loss._sample(4, "rebuild()", 3, 100.0, 0.05, [{"rank": 0}])


def test_rank_loss_tables_report_growth_against_one_generation() -> None:
    from commgroups.bench import rank_loss

    def counts(fds: int, keys: int, ours: int) -> dict[str, int | None]:
        return {"fds": fds, "threads": None, "process groups": 5, "store keys": keys,
                "store keys, commgroups'": ours, "store keys, others' (torch's)": keys - ours}

    stages = {"before create": counts(20, 10, 5), "after create": counts(40, 30, 20),
              "after 1 rebuild": counts(41, 40, 21), "after 2 rebuilds": counts(42, 50, 21),
              "after close": counts(40, 35, 6), "registry dropped": counts(20, 35, 6)}
    other = {**stages, "after 2 rebuilds": counts(45, 50, 21)}
    resources = {"world": 4, "cycles": 2, "ranks": [stages, other]}
    samples = [rank_loss._sample(4, variant, 3, 100.0, 0.05,
                                 [_survivor(0, "member", 100.01, 100.0 + end),
                                  _survivor(1, "member", 100.01, 100.5)])
               for variant, end in (("rebuild()", 1.0), ("rebuild()", 2.0), ("rebuild(alive=)", 0.7))]
    tables, summary = rank_loss.tables(samples, resources)
    assert summary["kill_to_rebuilt_s"] == {"4": pytest.approx(1.5)}
    assert summary["kill_to_rebuilt_s_gloo4_max"] == pytest.approx(2.0)
    assert summary["rebuild_growth_fds"] == 5  # the largest over ranks
    assert summary["generation_cost_fds"] == 20
    assert summary["rebuild_growth_threads"] is None  # not counted: never a made-up number
    assert summary["rebuild_growth_store_keys_ours"] == 1
    assert summary["rebuild_growth_store_keys_torch"] == 19
    kill, resource_table = tables
    assert {row[1] for row in kill.rows} == {"rebuild()", "rebuild(alive=)"}
    assert resource_table.column("resource")[:2] == ["fds", "threads"]
    ratio = rank_loss.ratio_result(samples, 4)
    assert len(ratio["samples"]["rebuild"]) == 1  # only the rebuild(alive=) world
