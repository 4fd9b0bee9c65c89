"""Render a :class:`~commgroups.bench.runner.BenchResult`: text, markdown, JSON and PNG charts.

Charts use matplotlib's object API with the Agg canvas directly (no pyplot), so nothing global (the
backend, the current figure) changes in the caller's process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from commgroups.bench.runner import BenchResult
from commgroups.bench.stats import Summary, Table

__all__ = ["markdown", "text", "write_json", "write_plots"]


def _headline(result: BenchResult) -> list[str]:
    s = result.summary
    lines = []
    if "async_and_wait_overhead_ratio" in s:
        spread = s["async_and_wait_overhead_ratio_spread"]
        lines.append(f"async_and_wait_overhead_ratio (async-and-wait / raw, sizes >= 64 KiB): "
                     f"{s['async_and_wait_overhead_ratio']:.3f} "
                     f"[pooled p25-p75 {spread['p25']:.3f}-{spread['p75']:.3f}]")
    if "creation_ratio_vs_devicemesh" in s:
        spread = s["creation_ratio_vs_devicemesh_spread"]
        lines.append(f"creation_ratio_vs_devicemesh (registry / DeviceMesh at "
                     f"{s['creation_ratio_world']:,} simulated ranks): "
                     f"{s['creation_ratio_vs_devicemesh']:.3f} "
                     f"[p25-p75 {spread['p25']:.3f}-{spread['p75']:.3f}], "
                     f"{s['registry_calls_per_role']:g} creation call(s) per role per rank")
    gloo_worlds = sorted(int(key.rpartition("gloo")[2]) for key in s
                         if key.startswith("creation_ratio_vs_devicemesh_gloo"))
    if gloo_worlds:
        parts = []
        for world in gloo_worlds:
            part = f"{world} ranks {s[f'creation_ratio_vs_devicemesh_gloo{world}']:.2f}x"
            first = s.get(f"creation_first_ratio_vs_devicemesh_gloo{world}")
            parts.append(part if first is None else f"{part} ({first:.2f}x)")
        lines.append("creation on real gloo ranks (registry / DeviceMesh, median per pair; first "
                     "in a fresh process): " + ", ".join(parts))
        same = [f"{world} ranks {s[key]:.2f}x" for world in gloo_worlds
                if (key := f"creation_ratio_vs_devicemesh_own_fsdp_gloo{world}") in s]
        if same:
            # DeviceMesh hands fsdp the default group (the alias commgroups exists to end): with
            # a group of its own it makes the registry's communicators, one world group more.
            lines.append("the same communicators (registry / DeviceMesh with its own fsdp "
                         "group): " + ", ".join(same))
    if s.get("kill_to_rebuilt_s"):
        worlds = ", ".join(f"{seconds:.2f} s on {world} ranks (worst "
                           f"{s.get(f'kill_to_rebuilt_s_gloo{world}_max', seconds):.2f} s)"
                           for world, seconds in s["kill_to_rebuilt_s"].items())
        lines.append(f"kill_to_rebuilt_s (SIGKILL mid-step to the slowest survivor rebuilt, "
                     f"600 s role timeouts, no alive=, median): {worlds}")
    return lines


def _machine_line(result: BenchResult) -> str:
    m = result.machine
    return (f"{m['nproc']} CPUs ({m['cpu_model']}), torch {m['torch']}, Python {m['python']}, "
            f"load average at start {m['load_average_at_start'][0]}, {m['date_utc']} UTC; "
            f"{result.config.name} run in {result.duration_s:.0f} s")


def text(result: BenchResult) -> str:
    """Every table as plain text, then the headline figures."""
    parts = [table.text() for table in result.tables]
    parts.append("\n".join(["Summary", "=======", *_headline(result),
                            f"machine: {_machine_line(result)}"]))
    return "\n\n".join(parts)


def markdown(result: BenchResult) -> str:
    """Every table as markdown (the results section of benchmarks/README.md)."""
    lines = [f"Machine: {_machine_line(result)}.", ""]
    lines += [f"- {line}" for line in _headline(result)]
    for table in result.tables:
        lines += ["", table.markdown()]
    return "\n".join(lines) + "\n"


def write_json(result: BenchResult, path: str | Path) -> None:
    """Write ``result.to_dict()`` to ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result.to_dict(), indent=1) + "\n", encoding="utf-8")


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=80)
    FigureCanvasAgg(figure)
    return figure


def _median_err(cells: list[Summary]) -> tuple[list[float], list[list[float]]]:
    medians = [c.median for c in cells]
    errors = [[c.median - c.p25 for c in cells], [c.p75 - c.median for c in cells]]
    return medians, errors


def _series(table: Table, key: str, group: str, value: str,
            where: dict[str, Any] | None = None) -> dict[Any, tuple[list[Any], list[Summary]]]:
    out: dict[Any, tuple[list[Any], list[Summary]]] = {}
    for row in table.rows:
        cells = dict(zip(table.columns, row))
        if where and any(cells[k] != v for k, v in where.items()):
            continue
        xs, ys = out.setdefault(cells[group], ([], []))
        xs.append(cells[key])
        ys.append(cells[value])
    return out


def _line_plot(table: Table, path: Path, key: str, group: str, value: str, title: str,
               xlabel: str, ylabel: str, where: dict[str, Any] | None = None) -> None:
    figure = _figure()
    axes = figure.add_subplot()
    for name, (xs, ys) in _series(table, key, group, value, where).items():
        medians, errors = _median_err(ys)
        axes.errorbar(xs, medians, yerr=errors, marker="o", capsize=3, label=str(name))
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def write_plots(result: BenchResult, directory: str | Path) -> list[Path]:
    """Write one PNG per scenario into ``directory``; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    creation = result.table("creation")
    path = out / "creation.png"
    _line_plot(creation, path, "world", "variant", "time ms", "Group creation (fake backend, rank 0)",
               "simulated world size", "ms (median, p25-p75)", where={"backend": "fake"})
    written.append(path)

    path = out / "planning.png"
    _line_plot(result.table("planning"), path, "world", "variant", "time ms",
               "Planning a dp_shard x cp layout", "world size", "ms (median, p25-p75)")
    written.append(path)

    cost = result.table("async_and_wait")
    figure = _figure(6.4, 5.6)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for op, (sizes, raws) in _series(cost, "bytes", "op", "raw us").items():
        medians, errors = _median_err(raws)
        top.errorbar(sizes, medians, yerr=errors, marker="o", capsize=3, label=f"{op} raw")
        _, safes = _series(cost, "bytes", "op", "async-and-wait us")[op]
        medians, errors = _median_err(safes)
        top.errorbar(sizes, medians, yerr=errors, marker="s", capsize=3,
                     label=f"{op} async-and-wait")
        _, ratios = _series(cost, "bytes", "op", "ratio")[op]
        medians, errors = _median_err(ratios)
        bottom.errorbar(sizes, medians, yerr=errors, marker="o", capsize=3, label=op)
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("us per call")
    top.set_title("Async-and-wait overhead on gloo (4 ranks)", fontsize=10)
    top.legend(fontsize=8)
    top.grid(True, which="both", alpha=0.3)
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    bottom.axhline(1.02, color="red", linewidth=0.8, linestyle="--", label="floor 1.02")
    bottom.set_xlabel("message bytes")
    bottom.set_ylabel("async-and-wait / raw")
    bottom.legend(fontsize=8)
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    path = out / "async_and_wait.png"
    figure.savefig(path)
    written.append(path)

    exchange = result.table("checkpoint_exchange")
    figure = _figure()
    axes = figure.add_subplot()
    for world in sorted(set(exchange.column("world"))):
        for variant, (items, times) in _series(exchange, "items per plan", "variant", "time ms",
                                               {"world": world}).items():
            medians, errors = _median_err(times)
            axes.errorbar(items, medians, yerr=errors, marker="o", capsize=3,
                          label=f"{world} ranks, {variant}")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("WriteItems per SavePlan")
    axes.set_ylabel("ms per exchange")
    axes.set_title("Checkpoint metadata exchange (gather + scatter of plans)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "checkpoint.png"
    figure.savefig(path)
    written.append(path)

    memory = result.table("memory")
    figure = _figure(7.2, 4.4)
    axes = figure.add_subplot()
    labels = [f"{row[0].split(':')[0]}\n{row[1]} {row[2]}" for row in memory.rows]
    highs = [row[5] for row in memory.rows]
    lows = [row[4] for row in memory.rows]
    positions = list(range(len(labels)))
    axes.barh(positions, highs, color="#c9d7ee", label="high estimate")
    axes.barh(positions, lows, color="#4a78b5", label="low estimate")
    axes.set_yticks(positions)
    axes.set_yticklabels(labels, fontsize=6)
    axes.invert_yaxis()
    axes.set_xlabel("estimated communicator MB per rank")
    axes.set_title("Communicator memory on rank 0 (estimate)", fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / "memory.png"
    figure.savefig(path)
    written.append(path)
    return written
