"""The torchtitan benchmark's tables from made-up measurements (tools/titan_bench.py): which
figure is divided by which, per repetition, and the start-up difference in seconds."""

from __future__ import annotations

import pytest

from tools.titan_bench import VARIANTS, tables

pytestmark = pytest.mark.version_independent


def _measured() -> dict[str, object]:
    # Two repetitions; stock's step time drifts between them, and commgroups follows it.
    steps = {"commgroups": [1.01, 2.02], "commgroups-no-flight": [1.0, 2.0],
             "commgroups+audit": [1.1, 2.2], "stock": [1.0, 2.0]}
    build = {v: [2.0, 2.0] for v in VARIANTS}
    build["commgroups"] = [2.5, 2.3]
    first = {v: [10.0, 12.0] for v in VARIANTS}
    return {"steps": steps, "build": build, "first_step": first, "backend": "partial_dtensor",
            "world": 4}


def test_ratios_are_per_repetition_and_start_up_is_a_difference() -> None:
    result, summary = tables(_measured(), None, 65_536)
    assert [t.name for t in result] == ["torchtitan_steps", "torchtitan_startup",
                                        "torchtitan_meshes"]
    assert summary["torchtitan_step_ratio"] == pytest.approx(1.01)
    assert summary["torchtitan_flight_recorder_step_ratio"] == pytest.approx(1.01)
    assert summary["torchtitan_audit_step_ratio"] == pytest.approx(1.1 / 1.01)
    # build 2.5 and 2.3 against stock's 2.0, the same step 1: 0.5 s and 0.3 s later
    assert summary["torchtitan_startup_delta_s"] == pytest.approx(0.4)
    startup = result[1]
    assert startup.column("variant") == list(VARIANTS)
    assert startup.column("start-up s")[0].median == pytest.approx((12.5 + 14.3) / 2)


def test_not_run_says_why_in_every_table() -> None:
    result, summary = tables(None, None, 65_536, reason="torchtitan is not installed")
    assert summary == {}
    assert all(t.notes == ["not run: torchtitan is not installed"] for t in result)
