"""commgroups.audit.merge: per-rank audit files merged into one report; bad directories and files named.

Pure inputs (per-rank recordings written as JSON files); no process group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from commgroups.audit.merge import AuditFileError, load_dir, merge, merge_dir
from commgroups.audit.records import (
    FILE_FORMAT,
    rank_file_name,
)
from commgroups.cli import main
from tests.test_hazards import _rank_data, _rec


def test_bad_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(AuditFileError, match="no such directory"):
        merge_dir(tmp_path / "missing")
    with pytest.raises(AuditFileError, match="no rank"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text("{not json")
    with pytest.raises(AuditFileError, match="cannot read"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(AuditFileError, match="not a commgroups audit file"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text(json.dumps(_rank_data(0, [])))
    (tmp_path / "rank00001.json").write_text(json.dumps(_rank_data(0, [])))
    with pytest.raises(AuditFileError, match="more than one file"):
        merge_dir(tmp_path)
    assert main(["audit", str(tmp_path / "missing")]) == 2


# -------------------------------------------------------------------- merging per-rank files
def _write_run(directory: Path, datas: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for data in datas:
        (directory / rank_file_name(data["rank"])).write_text(json.dumps(data))


def test_merge_of_per_rank_files(tmp_path: Path) -> None:
    # each rank: a blocking and an async call on cp's group 1, and one async call on the default group
    datas = [_rank_data(rank, [_rec("c10d.allreduce_", False), _rec("c10d.allreduce_", True),
                               _rec("c10d.allreduce_", True, group="0")]) for rank in (1, 0)]
    _write_run(tmp_path, datas)
    assert [d["rank"] for d in load_dir(tmp_path)] == [0, 1]
    report = merge_dir(tmp_path)
    assert report.ranks == (0, 1) and report.world_size == 2 and not report.ok
    groups = report.summary["groups"]
    assert groups["1"] == {"ranks": [0, 1], "backend": "gloo", "default": False, "roles": ["cp"],
                           "calls": 4, "blocking": 2, "async": 2}
    assert (groups["0"]["calls"], groups["0"]["default"]) == (2, True)
    assert [(h.kind, h.ranks) for h in report.hazards] == [
        ("aliasing", (0, 1)), ("mixed_streams", (0, 1))]
    assert report == merge(sorted(datas, key=lambda d: d["rank"]))
    text = report.render().splitlines()
    assert text[0] == "audit: 2 rank file(s), world size 2; calls per group, summed over ranks:"
    assert text[1] == "  group 0 (default group) roles=- backend=gloo calls=2 blocking=0 async=2"
    assert text[2] == "  group 1 roles=cp backend=gloo calls=4 blocking=2 async=2"
    assert text[3] == "2 hazard(s):"
    assert text[4].startswith("- [error] aliasing on group 0 (ranks 0,1): 1 collective(s) ran")
    assert text[5].startswith("- [warning] mixed_streams on group 1 (ranks 0,1): one communicator")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["ranks"] == [0, 1]
    assert [h["kind"] for h in data["hazards"]] == ["aliasing", "mixed_streams"]


def test_functional_collectives_are_counted_apart_from_dist_module_calls() -> None:
    """spmd_types 0.3 issues some collectives as functional ones, 0.2.3 every one through the
    dist module: the summary says how many of a group's calls were functional."""
    datas = [_rank_data(rank, [_rec("c10d.allgather_", True),
                               _rec("_c10d_functional.all_reduce", True),
                               _rec("_c10d_functional.reduce_scatter_tensor", True)])
             for rank in range(2)]
    report = merge(datas)
    group = report.summary["groups"]["1"]
    assert (group["calls"], group["async"], group["functional"]) == (6, 6, 4)
    assert "  group 1 roles=cp backend=gloo calls=6 blocking=0 async=6 functional=4" in (
        report.render().splitlines())


def test_merge_of_a_clean_run_and_bad_entries(tmp_path: Path) -> None:
    clean = [_rank_data(rank, [_rec("c10d.allreduce_", True)]) for rank in range(2)]
    report = merge(clean)
    assert report.ok and report.render().endswith("no hazards found")
    with pytest.raises(AuditFileError, match="rank data #1: not a commgroups audit file"):
        merge([clean[0], {"format": "other"}])
    assert clean[0]["format"] == FILE_FORMAT
