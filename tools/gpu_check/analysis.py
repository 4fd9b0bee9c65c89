"""Turn the GPU check's measurements into findings: stream verdicts, ratios, memory vs estimates.

Pure: reads the measurement dict (``measurements.json``) and the trimmed traces (``traces.json``)
that :mod:`tools.gpu_check.orchestrate` wrote, imports no torch, and can be re-run anywhere on
committed results (``python -m tools.gpu_check analyze DIR``). Four findings:

- streams: per variant, the stream of every collective GPU event against the caller's stream, and
  whether the caller's stream waited for it (a ``Stream Wait Event``, else the order of the marker
  kernel after it). A collective on the caller's own stream is flagged: that is the unfenced path
  that races the group's own stream when both drive one communicator.
- memory: device memory per communicator (``mem_get_info``, less what torch's allocator reserved,
  and ``nvidia-smi``), per trial, against :func:`commgroups.planning.memory.communicator_cost_mb`.
- async_wait_cost: per op and size, raw vs async-and-wait per-call time and their paired ratio.
- creation: per method, time to create the four roles' groups, as a ratio to new_group all_ranks.
- gloo_creation: the bench's creation tables on 4 and 8 gloo ranks with a CPU core each, and the
  registry's ratios to DeviceMesh there (the creation floor, measured where it is not CPU-bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from commgroups.bench.stats import number, paired_ratios, summarize
from commgroups.planning.memory import communicator_cost_mb
from tools.gpu_check.trace import ParsedTrace, parse_trace

__all__ = [
    "Analysis",
    "FLAGGED_VERDICTS",
    "StreamVerdict",
    "analyze",
    "fmt",
    "memory_cases",
    "stream_verdict",
    "summary_text",
]

ON_CALLER = "unfenced-on-caller-stream"
WAITED = "own-stream-waited"
NOT_WAITED = "own-stream-not-waited"
NO_WORK = "no-collective-gpu-work"
NO_TRACE = "no-trace"
FLAGGED_VERDICTS: tuple[str, ...] = (ON_CALLER, NOT_WAITED)
"""Verdicts that name a hazard: the caller's stream and the group's stream are not ordered."""
# The marker launched after the call may start this much before the collective's end (us) and still
# count as ordered behind it: Kineto's GPU timestamps are ns, rounded to 1 us in some exports.
ORDER_SLACK_US = 1.0
MB = 1e6
MIB = 1024 * 1024


@dataclass(frozen=True)
class StreamVerdict:
    """What the trace of one measured call says about its streams."""

    variant: str
    caller_stream: int | None
    collective_streams: tuple[int, ...]
    kernels: tuple[tuple[str, int], ...]
    """(short name, stream) of every collective GPU event of the call."""
    on_caller_stream: bool | None
    wait_event: bool | None
    """A Stream Wait Event put the caller's stream behind the collective's (None: not recorded)."""
    ordered_after: bool | None
    """The marker launched after the call started after the collective's GPU work ended."""
    verdict: str
    expected: str | None = None
    note: str = ""

    @property
    def flagged(self) -> bool:
        """True when the verdict names a hazard (see :data:`FLAGGED_VERDICTS`)."""
        return self.verdict in FLAGGED_VERDICTS

    @property
    def as_expected(self) -> bool | None:
        """Whether the verdict is the one the collector expected (None: no expectation)."""
        return None if self.expected is None else self.verdict == self.expected

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the derived ``flagged`` and ``as_expected``."""
        out = asdict(self)
        out["kernels"] = [list(k) for k in self.kernels]
        out["collective_streams"] = list(self.collective_streams)
        out.update(flagged=self.flagged, as_expected=self.as_expected)
        return out


def stream_verdict(variant: str, parsed: ParsedTrace, expected: str | None = None) -> StreamVerdict:
    """The stream verdict for one variant's parsed trace.

    Args:
        variant: the variant's name (for the report).
        parsed: its trace, from :func:`tools.gpu_check.trace.parse_trace`.
        expected: the verdict the collector expects (checked, not assumed).

    Returns:
        A :class:`StreamVerdict`. Where launches cannot be tied to the ``cg:*`` ranges, the first and
        last non-collective events stand in for the markers and every collective event for the call.
    """
    before = parsed.in_phase("cg:before", collective=False)
    after = parsed.in_phase("cg:after", collective=False)
    # Collective work launched by the call; failing that, any GPU work it launched (a copy whose
    # launch the trace cannot tie to a comm op is still the call's).
    call = parsed.in_phase("cg:call", collective=True) or parsed.in_phase("cg:call")
    note = ""
    if not (before and call):
        others = [e for e in parsed.gpu if not e.collective]
        before = before or others[:1]
        after = after or (others[-1:] if len(others) > 1 else [])
        call = call or [e for e in parsed.gpu if e.collective]
        if call or before:
            note = "phases inferred from event order (launches not tied to cg:* ranges)"
    caller = before[0].stream if before else None
    if not call:
        return StreamVerdict(variant, caller, (), (), None, None, None,
                             NO_WORK if parsed.gpu else NO_TRACE, expected, note)
    streams = tuple(sorted({e.stream for e in call}))
    kernels = tuple((e.short_name, e.stream) for e in call)
    on_caller = caller in streams if caller is not None else None
    end = max(e.end_us for e in call)
    ordered = (after[0].start_us >= end - ORDER_SLACK_US) if after else None
    wait_event: bool | None = None
    if parsed.sync_events_recorded and caller is not None:
        # Launched in the call, or (exports without launch records) anywhere: the control's own
        # late wait is launched after the marker, outside every range, and must not count.
        wait_event = any(w.stream == caller and w.phase in ("cg:call", None)
                         and (w.wait_on_stream is None or w.wait_on_stream in streams)
                         for w in parsed.waits if w.stream != w.wait_on_stream)
    if on_caller:
        verdict = ON_CALLER
    else:
        waited = wait_event if wait_event is not None else ordered
        verdict = WAITED if waited else NOT_WAITED
        if wait_event is not None and ordered is not None and wait_event != ordered:
            note = (note + "; " if note else "") + (
                "wait event and marker order disagree" if wait_event else
                "marker ran after the collective without a recorded wait event")
    return StreamVerdict(variant, caller, streams, kernels, on_caller, wait_event, ordered,
                         verdict, expected, note)


@dataclass
class Analysis:
    """Every finding of one GPU check, JSON-ready through :meth:`to_dict`."""

    smoke: bool
    machine: dict[str, Any]
    streams: list[StreamVerdict] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    memory_figures: list[dict[str, Any]] = field(default_factory=list)
    async_wait_cost: list[dict[str, Any]] = field(default_factory=list)
    creation: list[dict[str, Any]] = field(default_factory=list)
    pytest: dict[str, Any] = field(default_factory=dict)
    nccl_backends: list[dict[str, Any]] = field(default_factory=list)
    """Per torch NCCL backend name: the classes it built and each commgroups NCCL path's outcome."""
    megatron: dict[str, Any] = field(default_factory=dict)
    gloo_creation: dict[str, Any] = field(default_factory=dict)
    """The bench's creation on gloo ranks with a core each: cores, ratios by world, both tables."""
    errors: list[str] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``analysis.json``)."""
        out = asdict(self)
        out["streams"] = [s.to_dict() for s in self.streams]
        return out


def _part(measurements: Mapping[str, Any], name: str, errors: list[str]) -> Mapping[str, Any]:
    part = (measurements.get("parts") or {}).get(name)
    if part is None:
        errors.append(f"{name}: not run")
        return {}
    if part.get("error"):
        errors.append(f"{name}: {part['error']}")
    data: Mapping[str, Any] = part.get("data") or {}
    return data


def _streams(data: Mapping[str, Any], traces: Mapping[str, Any], errors: list[str],
             smoke: bool) -> list[StreamVerdict]:
    verdicts = []
    for variant in data.get("variants", []):
        name = variant["variant"]
        if smoke:  # no GPU work to judge: no expectation can be met or missed
            variant = {**variant, "expected": None}
        if variant.get("error"):
            errors.append(f"streams/{name}: {variant['error']}")
        trace = traces.get(variant.get("trace") or name)
        if trace is None:
            verdicts.append(StreamVerdict(name, None, (), (), None, None, None, NO_TRACE,
                                          variant.get("expected"), variant.get("error") or ""))
            continue
        verdicts.append(stream_verdict(name, parse_trace(trace), variant.get("expected")))
    return verdicts


def _used(point: Mapping[str, Any]) -> float | None:
    """Device bytes in use at a point, less torch's own allocator reserve (not communicators)."""
    used = point.get("device_used_bytes")
    if used is None:
        return None
    return float(used) - float(point.get("torch_reserved_bytes") or 0.0)


def _smi(point: Mapping[str, Any]) -> float | None:
    value = point.get("smi_used_mib")
    return None if value is None else float(value) * MIB


def memory_cases(trial: Mapping[str, Any]) -> str:
    """The estimate case of a memory trial: ``fresh``, ``split`` or ``split_share``.

    Under a device-bound default group, torch's ``new_group`` also builds its NCCL communicator with
    ``ncclCommSplit`` from the default group's, so only an unbound world gives a fresh one.
    """
    if trial.get("split_share"):
        return "split_share"
    return "split" if trial.get("bound", True) else "fresh"


def _memory(data: Mapping[str, Any], errors: list[str]) -> tuple[list[dict[str, Any]],
                                                                  list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    per_case: dict[str, list[float]] = {}
    trials: list[dict[str, Any]] = []
    for trial in data.get("trials", []):
        name = trial.get("trial", "?")
        if trial.get("error"):
            errors.append(f"memory/{name}: {trial['error']}")
        points = {p.get("label"): p for p in trial.get("points", [])}
        context, default = points.get("context"), points.get("default_group")
        case = memory_cases(trial)
        low, high, basis = communicator_cost_mb("nccl", 1, split_share=case == "split_share")
        if context is not None and default is not None:
            base_used, default_used = _used(context), _used(default)
            if base_used is not None and default_used is not None:
                rows.append({"trial": name, "case": "default group", "groups": 0,
                             "device_mb": (default_used - base_used) / MB,
                             "smi_mb": _delta(_smi(context), _smi(default)),
                             "per_comm_mb": (default_used - base_used) / MB,
                             "estimate_mb": communicator_cost_mb("nccl", 1)[1],
                             "basis": "default group (1 rank)"})
        if default is None:
            continue
        for point in trial.get("points", []):
            groups = point.get("groups")
            if not groups:
                continue
            used, start = _used(point), _used(default)
            if used is None or start is None:
                continue
            device_mb = (used - start) / MB
            per_comm = device_mb / groups
            rows.append({"trial": name, "case": case, "groups": groups, "device_mb": device_mb,
                         "smi_mb": _delta(_smi(default), _smi(point)), "per_comm_mb": per_comm,
                         "estimate_mb": high, "basis": basis})
            if groups == max(p.get("groups") or 0 for p in trial.get("points", [])):
                per_case.setdefault(case, []).append(per_comm)
                trials.append({"trial": name, "case": case, "groups": groups,
                               "per_comm_mb": per_comm})
    for row in rows:
        estimate = row["estimate_mb"]
        row["ratio"] = row["per_comm_mb"] / estimate if estimate else None
    figures = []
    for case, values in sorted(per_case.items()):
        low, high, basis = communicator_cost_mb("nccl", 1, split_share=case == "split_share")
        figures.append({"backend": "nccl", "case": case, "group_size": 1,
                        "mb": round(sum(values) / len(values), 1),
                        "trials": [t["trial"] for t in trials if t["case"] == case],
                        "estimate_mb": [round(low, 1), round(high, 1)], "estimate_basis": basis})
    return rows, figures


def _delta(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else (end - start) / MB


def _async_wait_cost(data: Mapping[str, Any], errors: list[str]) -> list[dict[str, Any]]:
    rows = []
    for case in data.get("cases", []):
        label = f"{case.get('op')} {case.get('bytes')} B"
        if case.get("error"):
            errors.append(f"async_wait_cost/{label}: {case['error']}")
        reps = case.get("reps") or []
        if not reps:
            continue
        row: dict[str, Any] = {"op": case["op"], "bytes": case["bytes"],
                               "calls": case.get("calls"), "timer": case.get("timer", "cuda_events")}
        raw = [float(r["raw_us"]) for r in reps]
        row["raw_us"] = summarize(raw).to_dict()
        for variant in ("manual_us", "collectives_us"):
            values = [float(r[variant]) for r in reps if r.get(variant) is not None]
            if len(values) != len(raw):
                continue
            row[variant] = summarize(values).to_dict()
            ratios = paired_ratios(values, raw)
            if ratios:
                row[variant.replace("_us", "_ratio")] = summarize(ratios).to_dict()
        rows.append(row)
    return rows


def _creation(data: Mapping[str, Any], errors: list[str]) -> list[dict[str, Any]]:
    rows = []
    for method in data.get("methods", []):
        name = method.get("method", "?")
        if method.get("error"):
            errors.append(f"creation/{name}: {method['error']}")
        seconds = [float(s) for s in method.get("create_s") or []]
        first = [float(s) for s in method.get("first_collective_s") or []]
        rows.append({"method": name, "calls": method.get("calls"),
                     "paths": method.get("paths"),
                     "create_ms": summarize(seconds).scaled(1e3).to_dict() if seconds else None,
                     "first_collective_ms": (summarize(first).scaled(1e3).to_dict()
                                             if first else None),
                     "error": method.get("error")})
    base = next((r for r in rows if r["method"] == "new_group all_ranks" and r["create_ms"]), None)
    for row in rows:
        if base and row["create_ms"]:
            row["ratio_vs_new_group_all_ranks"] = (row["create_ms"]["median"]
                                                   / base["create_ms"]["median"])
    return rows


def _megatron(data: Mapping[str, Any], errors: list[str]) -> dict[str, Any]:
    """The Megatron-Core part in a few facts; a failed stage or a non-registry group is an error."""
    if not data:
        return {}
    out: dict[str, Any] = {key: data.get(key) for key in (
        "ran", "skipped", "megatron_core", "default_backend", "layout", "loss",
        "all_fields_registry", "parallel_state_initialized", "seconds")}
    out["fields_used"] = [row["field"] for row in data.get("fields") or []]
    out["fields_not_registry"] = [row["field"] for row in data.get("fields") or []
                                  if row.get("set") and (not row.get("registry_group")
                                                         or row.get("default_group"))]
    out["module_groups_all_registry"] = all(
        held.get("all_registry") and not held.get("default_group")
        for held in (data.get("module_groups") or {}).values())
    for stage in ("build", "forward_backward", "ddp"):
        result = data.get(stage) or {}
        out[stage] = {key: result.get(key) for key in ("losses", "error", "seconds") if key in result}
        error = str(result.get("error") or "")
        if error and not error.startswith("skipped: "):
            errors.append(f"megatron/{stage}: {error}")
    if out["fields_not_registry"] or not out["module_groups_all_registry"]:
        errors.append("megatron: a group Megatron used is not its role's registry group: "
                      f"{', '.join(out['fields_not_registry']) or 'a module-held group'}")
    if out.get("parallel_state_initialized"):
        errors.append("megatron: parallel_state was initialised: groups may not all come from "
                      "the collection")
    return out


def _headline(analysis: Analysis) -> dict[str, Any]:
    head: dict[str, Any] = {}
    flagged = [s.variant for s in analysis.streams if s.flagged]
    unexpected = [s.variant for s in analysis.streams if s.as_expected is False]
    head["streams_flagged"] = flagged
    head["streams_unexpected"] = unexpected
    big = [r["collectives_ratio"]["median"] for r in analysis.async_wait_cost
           if "collectives_ratio" in r and r["bytes"] >= 64 * 1024]
    if big:
        head["async_wait_ratio_median_ge_64KiB"] = sorted(big)[len(big) // 2]
    for figure in analysis.memory_figures:
        head[f"memory_mb_per_{figure['case']}_communicator"] = figure["mb"]
    if analysis.megatron:
        head["megatron_ran"] = bool(analysis.megatron.get("ran"))
    for world, ratios in (analysis.gloo_creation.get("ratios") or {}).items():
        head[f"creation_ratio_vs_devicemesh_gloo{world}_core_each"] = ratios.get("steady")
        head[f"creation_first_ratio_vs_devicemesh_gloo{world}_core_each"] = ratios.get("first")
    return head


def analyze(measurements: Mapping[str, Any], traces: Mapping[str, Any] | None = None) -> Analysis:
    """Every finding of a GPU check.

    Args:
        measurements: the loaded ``measurements.json``.
        traces: the loaded ``traces.json`` (variant -> trimmed Chrome trace); None: no streams.

    Returns:
        An :class:`Analysis`; a part that failed or did not run leaves a line in ``errors``.

    Example::

        analysis = analyze(json.loads(m.read_text()), json.loads(t.read_text()))
        [s.verdict for s in analysis.streams]
    """
    errors: list[str] = []
    machine_part = (measurements.get("parts") or {}).get("machine") or {}
    analysis = Analysis(smoke=bool(measurements.get("smoke")),
                        machine=dict(machine_part.get("data") or measurements.get("machine") or {}))
    analysis.streams = _streams(_part(measurements, "streams", errors), traces or {}, errors,
                                analysis.smoke)
    analysis.memory, analysis.memory_figures = _memory(_part(measurements, "memory", errors),
                                                       errors)
    analysis.async_wait_cost = _async_wait_cost(_part(measurements, "async_wait_cost", errors), errors)
    analysis.creation = _creation(_part(measurements, "creation", errors), errors)
    analysis.pytest = dict(_part(measurements, "pytest", errors))
    if "nccl_backends" in (measurements.get("parts") or {}):  # absent from checks before it existed
        backends = _part(measurements, "nccl_backends", errors).get("backends") or []
        analysis.nccl_backends = [dict(b) for b in backends]
        errors += [f"nccl_backends {b.get('backend')}: {step['step']}: {step['error']}"
                   for b in backends for step in b.get("steps") or [] if not step.get("ok")]
    if "megatron" in (measurements.get("parts") or {}):  # results from before the part: no line
        analysis.megatron = _megatron(_part(measurements, "megatron", errors), errors)
    if "gloo_creation" in (measurements.get("parts") or {}):  # absent from checks before it
        analysis.gloo_creation = dict(_part(measurements, "gloo_creation", errors))
    analysis.errors = errors
    analysis.headline = _headline(analysis)
    return analysis


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a report cell ('-' for None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return number(float(value), digits)


def summary_text(cell: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``median [p25-p75]`` of a summarized cell ('-' when absent)."""
    if not cell:
        return "-"
    return f"{fmt(cell['median'], digits)} [{fmt(cell['p25'], digits)}-{fmt(cell['p75'], digits)}]"

