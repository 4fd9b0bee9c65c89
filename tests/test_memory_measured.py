"""commgroups.planning.memory with measured per-communicator figures (a GPU check's memory.json).

The figures come from the recorded sample (tests/data/gpu) through the real analysis, so this also
checks that what the GPU check writes is what ``commgroups plan --measured`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import commgroups as cg
from commgroups.cli import main
from commgroups.planning.memory import (
    MEASURED_SCHEMA,
    NCCL_SINGLE_RANK_MB,
    SINGLE_RANK,
    communicator_cost_mb,
    estimate_memory,
    load_measured,
    parse_measured,
)
from tools.gpu_check.outputs import MEMORY, write_derived

DATA = Path(__file__).parent / "data" / "gpu"


@pytest.fixture(scope="module")
def memory_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu")
    measurements = json.loads((DATA / "measurements.json").read_text())
    traces = json.loads((DATA / "traces.json").read_text())
    write_derived(out, measurements, traces)
    return out / MEMORY


def _layout() -> cg.Layout:
    # "solo" is one explicit rank: a real one-rank NCCL communicator, the case one GPU measures;
    # dp_shard has four ranks; tp is a regular one-rank role (single-rank backend, no communicator).
    return cg.Layout(dims={"dp_shard": 4, "tp": 1},
                     roles=[cg.RoleSpec(name="dp_shard", dims=["dp_shard"]),
                            cg.RoleSpec(name="tp", dims=["tp"]),
                            cg.RoleSpec(name="solo", ranks=[[0]])])


def test_measured_replaces_the_estimate_where_it_differs(memory_json: Path) -> None:
    measured = load_measured(memory_json)
    plain = estimate_memory(_layout())
    mixed = estimate_memory(_layout(), measured=measured)
    rows = {r.role: r for r in mixed.roles}
    assert rows["solo"].low_mb == rows["solo"].high_mb == pytest.approx(639.6, abs=0.1)
    assert "measured on NVIDIA H200" in rows["solo"].basis and "nccl#2363" in rows["solo"].basis
    # four ranks were never measured on one GPU: the published figure stays
    assert rows["dp_shard"] == {r.role: r for r in plain.roles}["dp_shard"]
    assert mixed.measured == str(memory_json)
    assert "measured figures from" in mixed.text() and mixed.to_dict()["measured"]
    assert plain.measured is None and plain.to_dict()["measured"] is None


def test_a_regular_one_rank_role_costs_no_communicator(memory_json: Path) -> None:
    for measured in (None, load_measured(memory_json)):
        estimate = estimate_memory(_layout(), measured=measured)
        tp = {r.role: r for r in estimate.roles}["tp"]
        assert (tp.backend, tp.communicators, tp.high_mb) == (SINGLE_RANK, 0, 0.0)
        assert estimate.device_communicators == 2  # dp_shard and solo


def test_split_cases_use_their_own_figures(memory_json: Path) -> None:
    measured = load_measured(memory_json)
    assert communicator_cost_mb("nccl", 1, split_share=True, measured=measured)[1] == \
        pytest.approx(6.3, abs=0.1)  # the estimate said 0
    assert communicator_cost_mb("nccl", 1, split=True, measured=measured)[1] == \
        pytest.approx(138.4, abs=0.1)
    # only regular roles are split: the explicit one-rank role keeps its fresh communicator
    split = estimate_memory(_layout(), creation="split", split_share=True, measured=measured)
    assert {r.role: r for r in split.roles}["solo"].high_mb == pytest.approx(639.6, abs=0.1)
    # without a figure for the backend nothing changes
    assert communicator_cost_mb("rccl", 1, measured=measured)[0] == NCCL_SINGLE_RANK_MB


def test_a_figure_inside_the_estimate_keeps_the_estimate() -> None:
    measured = parse_measured({"schema": MEASURED_SCHEMA, "source": {"gpu": "X"},
                               "communicators": [{"backend": "nccl", "case": "fresh",
                                                  "group_size": 1, "mb": 540.0}]})
    low, high, basis = communicator_cost_mb("nccl", 1, measured=measured)
    assert low == high == NCCL_SINGLE_RANK_MB
    assert "measured 540 MB agrees" in basis


@pytest.mark.parametrize(("document", "field"), [
    ({"schema": "other", "communicators": []}, "schema"),
    ({"schema": MEASURED_SCHEMA, "communicators": {}}, "communicators must be a list"),
    ({"schema": MEASURED_SCHEMA, "communicators": [
        {"backend": "nccl", "case": "shared", "group_size": 1, "mb": 1}]}, "communicators[0].case"),
    ({"schema": MEASURED_SCHEMA, "communicators": [
        {"backend": "gloo", "case": "fresh", "group_size": 1, "mb": 1}]}, "communicators[0].backend"),
    ({"schema": MEASURED_SCHEMA, "communicators": [
        {"backend": "nccl", "case": "fresh", "group_size": 0, "mb": 1}]}, "group_size must be >= 1"),
])
def test_bad_measured_file_names_the_field(document: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=r"fix|must") as error:
        parse_measured(document, "m.json")
    assert field in str(error.value) and "m.json" in str(error.value)


def test_plan_measured_flag(memory_json: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"dims": {"dp_shard": 4}, "roles": [
        {"name": "dp_shard", "dims": ["dp_shard"]}, {"name": "solo", "ranks": [[0]]}]}))
    assert main(["plan", str(layout), "--measured", str(memory_json)]) == 0
    out = capsys.readouterr().out
    assert "solo: 640 MB (nccl; measured on NVIDIA H200" in out
    assert "dp_shard: 544-688 MB (nccl; per communicator on 4xA100, nccl#964)" in out
    assert main(["plan", str(layout)]) == 0
    assert "measured" not in capsys.readouterr().out
    # one clean error line and exit status 2, never a traceback
    assert main(["plan", str(layout), "--measured", str(tmp_path / "missing.json")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "no such file; fix" in error[0] and error[0].count("fix:") == 1
