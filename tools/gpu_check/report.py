"""Render an :class:`~tools.gpu_check.analysis.Analysis` as markdown and one PNG.

Pure (no torch). The PNG has four panels: the GPU timeline of each stream variant (caller's stream
vs others), communicator memory measured vs estimated, the async-and-wait cost ratio per message size, and
creation time per method. matplotlib is optional: without it the PNG is skipped and the markdown
says so. Charts use matplotlib's object API with the Agg canvas (no pyplot, nothing global changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from commgroups.util.text_table import markdown_table
from tools.gpu_check.analysis import Analysis, fmt, summary_text
from tools.gpu_check.trace import parse_trace

__all__ = ["markdown", "write_png"]

# Where nothing is measured the report says so instead of leaving a table out silently.
NOTHING = "_nothing measured (see Errors)_"


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _machine(machine: Mapping[str, Any]) -> str:
    keys = ("gpu", "driver", "cuda", "torch", "nccl", "python", "hostname", "date_utc")
    return ", ".join(f"{k} {machine[k]}" for k in keys if machine.get(k) not in (None, ""))


def _streams(analysis: Analysis) -> list[str]:
    lines = ["## Streams: where each collective ran (profiler trace, 1-rank NCCL group)", ""]
    if not analysis.streams:
        return [*lines, NOTHING]
    rows = []
    for s in analysis.streams:
        work = ", ".join(f"{name}: {stream}" for name, stream in s.kernels) or "-"
        verdict = f"**{s.verdict}** (flagged)" if s.flagged else s.verdict
        expected = "-" if s.expected is None else ("yes" if s.as_expected else f"NO ({s.expected})")
        rows.append([s.variant, _yn(s.caller_stream), work, _yn(s.on_caller_stream),
                     _yn(s.wait_event), _yn(s.ordered_after), verdict, expected])
    lines += markdown_table(["variant", "caller stream", "collective GPU work (name: stream)",
                             "on caller stream", "wait event", "marker after", "verdict",
                             "expected"], rows)
    notes = [f"{s.variant}: {s.note}" for s in analysis.streams if s.note]
    lines += ["", "- flagged: the collective ran on the caller's own stream (unfenced: the path that "
              "races the group's stream when both drive one communicator), or on another stream "
              "the caller never waited for",
              "- wait event: a Stream Wait Event put the caller's stream behind the collective's "
              "(- where the profiler recorded no sync events); marker after: the kernel launched "
              "after the call started only once the collective's GPU work had ended",
              *[f"- {n}" for n in notes]]
    return lines


def _yn(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _memory(analysis: Analysis) -> list[str]:
    lines = ["## Communicator memory: eager-initialised groups on one GPU", ""]
    if not analysis.memory:
        return [*lines, NOTHING]
    lines += markdown_table(
        ["trial", "case", "groups", "device MB (mem_get_info)", "nvidia-smi MB",
         "MB per communicator", "estimate MB", "measured / estimate"],
        [[str(row["trial"]), str(row["case"]), str(row["groups"]), fmt(row["device_mb"], 4),
          fmt(row["smi_mb"], 4), fmt(row["per_comm_mb"], 4), fmt(row["estimate_mb"], 4),
          fmt(row.get("ratio"))] for row in analysis.memory])
    lines += ["", "- device MB: change in used device memory (mem_get_info) since the default group "
              "was up, less torch's allocator reserve; default group rows: since the CUDA context",
              "- cases: fresh = new_group on an unbound world (ncclCommInitRank); split = child of "
              "the bound default group (new_group or split_group, ncclCommSplit); split_share = the "
              "same with split_share=1",
              "- estimates: commgroups.planning.memory (1 MB = 10^6 bytes)"]
    if analysis.memory_figures:
        lines += ["", "Measured per-communicator figures (`memory.json`, read by "
                  "`commgroups plan --measured`):", ""]
        lines += [f"- {f['backend']} {f['case']}, {f['group_size']} rank: {fmt(f['mb'], 4)} MB "
                  f"(estimate {fmt(f['estimate_mb'][1], 4)} MB, {f['estimate_basis']})"
                  for f in analysis.memory_figures]
    return lines


def _async_wait_cost(analysis: Analysis) -> list[str]:
    lines = ["## Async-and-wait cost: raw blocking vs async-and-wait, per call", ""]
    if not analysis.async_wait_cost:
        return [*lines, NOTHING]
    lines += markdown_table(
        ["op", "size", "calls / rep", "raw us", "manual async+wait us", "RoleCollectives us",
         "manual / raw", "RoleCollectives / raw"],
        [[str(row["op"]), _size(int(row["bytes"])), str(row.get("calls"))]
         + [summary_text(row.get(key)) for key in
            ("raw_us", "manual_us", "collectives_us", "manual_ratio", "collectives_ratio")]
         for row in analysis.async_wait_cost])
    timer = analysis.async_wait_cost[0].get("timer", "cuda_events")
    lines += ["", f"- per-call time on the caller's stream ({timer}), median [p25-p75] over "
              "repetitions; ratios per repetition (variants interleaved)"]
    return lines


def _creation(analysis: Analysis) -> list[str]:
    lines = ["## Creation: the four roles' groups on the bound default group", ""]
    if not analysis.creation:
        return [*lines, NOTHING]
    lines += markdown_table(
        ["method", "creation calls", "paths", "create ms", "first collective ms",
         "ratio vs new_group all_ranks", "error"],
        [[str(row["method"]), str(row.get("calls") or "-"),
          ", ".join(row.get("paths") or []) or "-", summary_text(row.get("create_ms")),
          summary_text(row.get("first_collective_ms")),
          fmt(row.get("ratio_vs_new_group_all_ranks")), (row.get("error") or "-")[:80]]
         for row in analysis.creation])
    return lines


def _nccl_backends(analysis: Analysis) -> list[str]:
    lines = ["## NCCL implementations: commgroups' NCCL paths on each (1-rank bound world)", ""]
    if not analysis.nccl_backends:
        return [*lines, NOTHING]
    rows = []
    for backend in analysis.nccl_backends:
        if backend.get("skipped") or backend.get("error"):
            rows.append([backend.get("backend", "-"), "-", "-",
                         backend.get("skipped") or f"ERROR {backend['error']}"])
            continue
        steps = "; ".join(f"{s['step']}: {s.get('value') if s['ok'] else 'FAILED'}"
                          for s in backend.get("steps") or [])
        rows.append([backend["backend"], backend.get("default_class") or "-",
                     backend.get("group_class") or "-", steps or "-"])
    lines += markdown_table(["torch backend", "default group's class", "new group's class",
                             "paths (value, or FAILED: see Errors)"], rows)
    return lines


def _megatron(analysis: Analysis) -> list[str]:
    lines = ["## Megatron-Core through the registry's collection", ""]
    mg = analysis.megatron
    if not mg:
        return [*lines, "not run"]
    if mg.get("skipped"):
        return [*lines, f"skipped: {mg['skipped']}"]
    fb, ddp = mg.get("forward_backward") or {}, mg.get("ddp") or {}
    losses = ", ".join(fmt(v, 4) for v in fb.get("losses") or []) or "-"
    ddp_losses = ", ".join(fmt(v, 4) for v in ddp.get("losses") or []) or "-"
    used = ", ".join(mg.get("fields_used") or []) or "-"
    lines += [
        f"- megatron-core {mg.get('megatron_core')}, layout {mg.get('layout')}, default group "
        f"{mg.get('default_backend')}; ran on the GPU: {_yn(mg.get('ran'))}",
        f"- GPTModel forward/backward losses (SGD steps): {losses}"
        + (f" ({fb['error']})" if fb.get("error") else ""),
        f"- through Megatron's DistributedDataParallel (finish_grad_sync): {ddp_losses}"
        + (f" ({ddp['error']})" if ddp.get("error") else ""),
        f"- fields Megatron read: {used}; every one its role's registry group, never the default "
        f"group: {_yn(bool(mg.get('all_fields_registry')) and not mg.get('fields_not_registry'))}; "
        f"module-held groups all registry groups: {_yn(mg.get('module_groups_all_registry'))}",
        f"- parallel_state initialised: {_yn(mg.get('parallel_state_initialized'))}; "
        f"{fmt(mg.get('seconds'), 2)} s",
    ]
    return lines


def _gloo_creation(analysis: Analysis) -> list[str]:
    data = analysis.gloo_creation
    lines = ["## Creation on gloo ranks with a CPU core each: the registry against DeviceMesh", ""]
    if not data or data.get("skipped"):
        return [*lines, f"skipped: {data['skipped']}" if data.get("skipped") else "not run"]
    lines.append(f"- {data.get('nproc')} CPU cores; the bench's scenarios "
                 "(`commgroups.bench.creation`): every variant once in each of "
                 f"{data.get('steady_worlds')} fresh worlds, and {data.get('first_pairs')} pairs "
                 "of first creations in fresh worlds")
    for world, ratios in (data.get("ratios") or {}).items():
        lines.append(f"- {world} ranks: the registry {fmt(ratios.get('steady'))}x DeviceMesh "
                     f"(every variant in one world; {fmt(ratios.get('steady_vs_devicemesh_own_fsdp'))}x "
                     f"DeviceMesh with its own fsdp group), {fmt(ratios.get('first'))}x as the first "
                     "creation in a fresh world")
    for key in ("steady", "first"):
        table = data.get(key) or {}
        if table.get("rows"):
            lines += ["", f"### {table.get('title', key)}", ""]
            lines += markdown_table([str(c) for c in table["columns"]],
                                    [[summary_text(cell) if isinstance(cell, dict) else str(cell)
                                      for cell in row] for row in table["rows"]])
    return lines


def markdown(analysis: Analysis) -> str:
    """The whole report as markdown (``report.md``)."""
    title = "# GPU check" + (" (CPU smoke run: plumbing only, no GPU figures)" if analysis.smoke
                             else "")
    lines = [title, "", f"Machine: {_machine(analysis.machine) or 'unknown'}.", ""]
    head = analysis.headline
    if head.get("streams_flagged") is not None:
        lines.append(f"- flagged stream variants: {', '.join(head['streams_flagged']) or 'none'}")
        lines.append("- variants not as expected: "
                     f"{', '.join(head.get('streams_unexpected') or []) or 'none'}")
    if "async_wait_ratio_median_ge_64KiB" in head:
        lines.append("- async-and-wait ratio (RoleCollectives / raw, median over sizes >= 64 KiB): "
                     f"{fmt(head['async_wait_ratio_median_ge_64KiB'])}")
    for section in (_streams, _memory, _async_wait_cost, _creation, _nccl_backends, _megatron):
        lines += ["", *section(analysis)]
    pytest = analysis.pytest
    lines += ["", "## GPU-only tests (streams, isolation)", "",
              f"{pytest.get('summary') or 'not run'} (exit code {pytest.get('returncode', '-')})"]
    lines += ["", *_gloo_creation(analysis)]
    lines += ["", "## Errors", ""]
    lines += [f"- {e}" for e in analysis.errors] or ["none"]
    return "\n".join(lines) + "\n"


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=80)
    FigureCanvasAgg(figure)
    return figure


def _timeline(axes: Any, analysis: Analysis, traces: Mapping[str, Any]) -> None:
    names = [s.variant for s in analysis.streams]
    for row, verdict in enumerate(analysis.streams):
        trace = traces.get(verdict.variant)
        events = parse_trace(trace).gpu if trace is not None else ()
        if not events:
            continue
        origin = events[0].start_us
        for event in events:
            colour = ("#d9534f" if event.stream == verdict.caller_stream and event.collective
                      else "#4a78b5" if event.collective else "#999999")
            axes.broken_barh([(event.start_us - origin, max(event.end_us - event.start_us, 0.5))],
                             (row - 0.35, 0.7), color=colour)
    axes.set_yticks(range(len(names)))
    axes.set_yticklabels(names, fontsize=6)
    axes.invert_yaxis()
    axes.set_xlabel("us since the first GPU event", fontsize=7)
    axes.set_title("GPU work per variant: grey markers, blue collective on its own stream, "
                   "red on the caller's", fontsize=7)


def _memory_panel(axes: Any, analysis: Analysis) -> None:
    rows = [r for r in analysis.memory if r["groups"] and r["groups"] == max(
        x["groups"] for x in analysis.memory if x["trial"] == r["trial"])]
    labels = [r["trial"] for r in rows]
    positions = list(range(len(rows)))
    axes.barh([p - 0.2 for p in positions], [r["per_comm_mb"] for r in rows], height=0.4,
              color="#4a78b5", label="measured")
    axes.barh([p + 0.2 for p in positions], [r["estimate_mb"] for r in rows], height=0.4,
              color="#c9d7ee", label="estimate")
    axes.set_yticks(positions)
    axes.set_yticklabels(labels, fontsize=6)
    axes.invert_yaxis()
    axes.set_xlabel("MB per communicator", fontsize=7)
    axes.set_title("Communicator memory (most groups per trial)", fontsize=8)
    if rows:
        axes.legend(fontsize=6)


def _async_wait_panel(axes: Any, analysis: Analysis) -> None:
    for op in sorted({r["op"] for r in analysis.async_wait_cost}):
        rows = [r for r in analysis.async_wait_cost if r["op"] == op and "collectives_ratio" in r]
        axes.plot([r["bytes"] for r in rows], [r["collectives_ratio"]["median"] for r in rows],
                  marker="o", label=op)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message bytes", fontsize=7)
    axes.set_ylabel("RoleCollectives / raw", fontsize=7)
    axes.set_title("Async-and-wait cost per call", fontsize=8)
    if analysis.async_wait_cost:
        axes.legend(fontsize=6)


def _creation_panel(axes: Any, analysis: Analysis) -> None:
    rows = [r for r in analysis.creation if r.get("create_ms")]
    axes.barh(range(len(rows)), [r["create_ms"]["median"] for r in rows], color="#4a78b5")
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels([r["method"] for r in rows], fontsize=6)
    axes.invert_yaxis()
    axes.set_xlabel("ms to create 4 roles' groups (median)", fontsize=7)
    axes.set_title("Creation", fontsize=8)


def write_png(analysis: Analysis, traces: Mapping[str, Any], path: str | Path) -> Path | None:
    """Write the four-panel PNG; None (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    figure = _figure(11.0, 7.5)
    (streams, memory), (cost, creation) = figure.subplots(2, 2)
    _timeline(streams, analysis, traces)
    _memory_panel(memory, analysis)
    _async_wait_panel(cost, analysis)
    _creation_panel(creation, analysis)
    for axes in (streams, memory, cost, creation):
        axes.tick_params(labelsize=6)
        if not axes.has_data():
            axes.text(0.5, 0.5, "nothing measured", ha="center", va="center",
                      transform=axes.transAxes)
    figure.suptitle("commgroups GPU check" + (" (CPU smoke: plumbing only)" if analysis.smoke
                                                else ""), fontsize=10)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out
