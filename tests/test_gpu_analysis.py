"""The GPU check's analysis on a recorded sample (tests/data/gpu): no GPU, no torch needed.

The sample is hand-made in Kineto's Chrome-trace shape (kernels and copies with ``args.stream`` and
``correlation``, CUDA runtime/driver launches, ``cuda_sync`` Stream Wait Events, the ``cg:*``
record_function ranges) with NCCL work on two streams, plus a measurement file of every part.

Its tests that start processes are in ``tests/test_gpu_analysis_world.py`` (marked ``world``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from commgroups.planning.memory import load_measured
from tools.gpu_check.analysis import (
    NOT_WAITED,
    ON_CALLER,
    WAITED,
    analyze,
    stream_verdict,
)
from tools.gpu_check.outputs import MEMORY, REPORT_MD, REPORT_PNG, write_derived
from tools.gpu_check.trace import OUTSIDE, parse_trace, trim_trace

# GPU-result analysis imports no torch: CI runs it on the main torch leg only.
pytestmark = pytest.mark.version_independent

DATA = Path(__file__).parent / "data" / "gpu"


@pytest.fixture(scope="module")
def sample() -> tuple[dict[str, Any], dict[str, Any]]:
    measurements = json.loads((DATA / "measurements.json").read_text())
    traces = json.loads((DATA / "traces.json").read_text())
    return measurements, traces


def test_trace_streams_and_phases(sample: tuple[dict[str, Any], dict[str, Any]]) -> None:
    parsed = parse_trace(sample[1]["role_collectives"])
    call = parsed.in_phase("cg:call", collective=True)
    assert [(e.short_name, e.stream) for e in call] == [("ncclDevKernel_AllGather_RING_LL", 24)]
    assert [e.stream for e in parsed.in_phase("cg:before")] == [20]
    assert [e.stream for e in parsed.in_phase("cg:after")] == [20]
    assert parsed.sync_events_recorded
    assert {(w.stream, w.wait_on_stream, w.phase) for w in parsed.waits} == {
        (24, 20, "cg:call"), (20, 24, "cg:call")}
    # A one-rank NCCL all-gather is a plain copy: collective because a comm op launched it.
    blocking = parse_trace(sample[1]["raw_blocking"]).in_phase("cg:call")
    assert [(e.category, e.collective, e.stream) for e in blocking] == [("gpu_memcpy", True, 20)]
    late = [w for w in parse_trace(sample[1]["raw_async_no_wait"]).waits if w.stream == 20]
    assert [w.phase for w in late] == [OUTSIDE]


def test_blocking_flagged_async_and_wait_not(sample: tuple[dict[str, Any], dict[str, Any]]) -> None:
    traces = sample[1]
    blocking = stream_verdict("raw_blocking", parse_trace(traces["raw_blocking"]), ON_CALLER)
    assert blocking.verdict == ON_CALLER and blocking.flagged and blocking.as_expected
    assert blocking.on_caller_stream and blocking.collective_streams == (20,)
    waited = stream_verdict("role_collectives", parse_trace(traces["role_collectives"]))
    assert waited.verdict == WAITED and not waited.flagged
    assert waited.caller_stream == 20 and waited.collective_streams == (24,)
    assert waited.wait_event is True and waited.ordered_after is True
    control = stream_verdict("raw_async_no_wait", parse_trace(traces["raw_async_no_wait"]))
    assert control.verdict == NOT_WAITED and control.flagged
    assert control.wait_event is False and control.ordered_after is False
    inferred = stream_verdict("async_wait_dist", parse_trace(traces["async_wait_dist"]))
    assert inferred.verdict == WAITED and inferred.wait_event is None
    assert "inferred" in inferred.note


def test_a_blocking_call_on_the_callers_stream_is_flagged_whatever_its_name() -> None:
    """No NCCL in any name, no launch records: order alone still finds the unfenced call."""
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 5.0,
               "args": {"stream": 7, "correlation": corr}}
              for name, ts, corr in (("marker", 0.0, 1), ("copy", 10.0, 2), ("marker2", 20.0, 3))]
    events[1]["name"] = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    verdict = stream_verdict("x", parse_trace({"traceEvents": events}))
    assert verdict.verdict == ON_CALLER and verdict.flagged


def test_trim_keeps_what_the_analysis_reads(sample: tuple[dict[str, Any], dict[str, Any]]) -> None:
    for trace in sample[1].values():
        trimmed = trim_trace(trace)
        assert parse_trace(trimmed) == parse_trace(trace)
        assert all(e["cat"] != "python_function" for e in trimmed["traceEvents"])


def test_analysis_of_the_sample(sample: tuple[dict[str, Any], dict[str, Any]]) -> None:
    analysis = analyze(*sample)
    assert analysis.headline["streams_flagged"] == ["raw_blocking", "raw_async_no_wait"]
    assert analysis.headline["streams_unexpected"] == ["functional_all_gather"]
    small = next(r for r in analysis.async_wait_cost if r["bytes"] == 4)
    assert small["collectives_ratio"]["median"] == pytest.approx(14.0 / 9.8)
    assert small["manual_ratio"]["median"] == pytest.approx(12.1 / 9.8)
    figures = {f["case"]: f["mb"] for f in analysis.memory_figures}
    assert figures == {"fresh": pytest.approx(639.6, abs=0.1), "split": pytest.approx(138.4, abs=0.1),
                       "split_share": pytest.approx(6.3, abs=0.1)}
    split = next(r for r in analysis.creation if r["method"] == "split_group")
    assert split["ratio_vs_new_group_all_ranks"] == pytest.approx(0.41 / 0.80)
    assert any("new_group local: timed out" in e for e in analysis.errors)
    assert any("functional_all_gather" in e for e in analysis.errors)


def test_report_and_measured_memory_written(
    sample: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    written = write_derived(tmp_path, *sample)
    assert {p.name for p in written} >= {REPORT_MD, MEMORY, REPORT_PNG, "analysis.json"}
    report = (tmp_path / REPORT_MD).read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines()
            if line.startswith("| ")}
    assert "**unfenced-on-caller-stream** (flagged)" in rows["raw_blocking"]
    assert "(flagged)" not in rows["role_collectives"]
    assert "NVIDIA H200" in report and "nccl 2.27.7" in report
    assert (tmp_path / REPORT_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = load_measured(tmp_path / MEMORY)
    assert measured.lookup("nccl", "split", 1) is not None
    assert "NVIDIA H200" in measured.source and "nccl 2.27.7" in measured.source


def test_nccl_backends_in_the_analysis_and_report(
    sample: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """The nccl_backends part (hand-made here: no GPU has run it yet): a row per torch backend,
    a failed path in Errors; a measurement file from before the part existed has no such error."""
    measurements, traces = sample
    assert not analyze(measurements, traces).nccl_backends
    assert not any("nccl_backends" in e for e in analyze(measurements, traces).errors)
    steps = [{"step": "all_reduce", "ok": True, "value": "1.0"},
             {"step": "split count (comm_split_count)", "ok": True, "value": None}]
    with_part = {**measurements, "parts": {**measurements["parts"], "nccl_backends": {
        "error": None, "seconds": 1.0, "data": {"backends": [
            {"backend": "nccl", "default_class": "ProcessGroupNCCL2",
             "group_class": "ProcessGroupNCCL2", "steps": steps},
            {"backend": "nccl-legacy", "default_class": "ProcessGroupNCCL",
             "group_class": "ProcessGroupNCCL",
             "steps": [{"step": "split_group", "ok": False, "error": "RuntimeError: boom"}]},
            {"backend": "nccl2", "skipped": "torch 2.13.0 has no ProcessGroupNCCL2"}]}}}}
    analysis = analyze(with_part, traces)
    assert [b["backend"] for b in analysis.nccl_backends] == ["nccl", "nccl-legacy", "nccl2"]
    assert "nccl_backends nccl-legacy: split_group: RuntimeError: boom" in analysis.errors
    write_derived(tmp_path, with_part, traces)
    report = (tmp_path / REPORT_MD).read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines()
            if line.startswith("| ")}
    assert "ProcessGroupNCCL2" in rows["nccl"] and "all_reduce: 1.0" in rows["nccl"]
    assert "split_group: FAILED" in rows["nccl-legacy"]
    assert "no ProcessGroupNCCL2" in rows["nccl2"]
