"""Run the GPU check: every part in its own process under a timeout, then the analysis.

Order: machine, streams, async_wait_cost, memory (one process per trial), creation, member-only creation
(alone: it may hang on a device-bound NCCL group), nccl_backends (commgroups' NCCL paths on each of
torch's NCCL implementations, one process each), megatron (a Megatron-Core model's forward and
backward on registry groups; skipped without megatron-core), ``pytest`` of the GPU-only tests, then
gloo_creation (the bench's creation on 4 and 8 gloo ranks, a CPU core each: last, so it never
takes budget from a GPU figure). A part that
fails, crashes or hangs leaves its error in ``measurements.json`` and the next part runs; the whole
check stays inside ``budget_s`` (each part's timeout is cut to what is left, less a reserve for the
analysis). Output goes to ``out_dir`` and, when ``also_out`` is given (e.g. a folder the GPU node
hands back), is copied there too: at most 8 flat files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tools.gpu_check.outputs import MEASUREMENTS, TRACES, write_derived

__all__ = ["LOG", "PYTEST_FILES", "Step", "plan_steps", "run_check"]

LOG = "log.txt"
PYTEST_FILES = ("tests/test_gpu_streams.py", "tests/test_gpu_isolation.py",
                "tests/test_gpu_rebuild.py")
"""The GPU-only tests: where collectives run (streams), role isolation on CUDA tensors, and
rebuild() on a one-rank NCCL world (real aborts, bound: every role split from the spine or
the refusal, the machine's shrink answer)."""
SCHEMA = "commgroups.gpu-check/1"
REPORT_RESERVE_S = 20.0
MIN_STEP_S = 10.0
TAIL_CHARS = 4000
SMOKE_MEMORY_TRIALS = ("new_group",)


@dataclass(frozen=True)
class Step:
    """One process the check runs."""

    part: str
    """Where its answer goes in measurements.json (memory trials and both creation runs merge)."""
    label: str
    argv: tuple[str, ...]
    timeout_s: float
    env: tuple[tuple[str, str], ...] = ()
    """Variables set for its process, on top of this one's."""


def plan_steps(python: str, smoke: bool, parts: Sequence[str] | None = None) -> list[Step]:
    """The processes to run, in order (``parts`` limits them to those part names)."""
    from tools.gpu_check.memory_probe import TRIALS
    from tools.gpu_check.nccl_backends import NCCL_BACKENDS

    worker = (python, "-m", "tools.gpu_check.worker")
    flag = ("--smoke",) if smoke else ()
    steps = [
        Step("machine", "machine", (*worker, "machine", *flag), 60),
        Step("streams", "streams", (*worker, "streams", *flag), 120),
        Step("async_wait_cost", "async_wait_cost", (*worker, "async_wait_cost", *flag), 120),
    ]
    trials = [t.name for t in TRIALS if not smoke or t.name in SMOKE_MEMORY_TRIALS]
    steps += [Step("memory", f"memory: {name}", (*worker, "memory", "--trial", name, *flag), 60)
              for name in trials]
    safe = "new_group all_ranks,split_group,registry all_ranks,registry split,registry auto"
    steps += [
        Step("creation", "creation", (*worker, "creation", "--methods", safe, *flag), 120),
        Step("creation", "creation: new_group local (may hang)",
             (*worker, "creation", "--methods", "new_group local", *flag), 45),
    ]
    # Both NCCL implementations (torch 2.15: nccl = ProcessGroupNCCL2, nccl-legacy), one process
    # each; a smoke run has one, on gloo.
    steps += [Step("nccl_backends", f"nccl_backends: {name}",
                   (*worker, "nccl_backends", "--backend", name, *flag), 60)
              for name in (NCCL_BACKENDS[:1] if smoke else NCCL_BACKENDS)]
    steps += [
        Step("megatron", "megatron", (*worker, "megatron", *flag), 150),
        Step("pytest", "pytest", (python, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                  *PYTEST_FILES), 180),
        # A store's reverse lookup of each new client stalls 5 s now and then on a machine
        # without a reachable DNS server; glibc then gives up at once (as `make bench` sets it).
        Step("gloo_creation", "gloo_creation", (*worker, "gloo_creation", *flag), 150,
             env=(("RES_OPTIONS", "attempts:0"),)),
    ]
    return [s for s in steps if parts is None or s.part in parts]


def _run(argv: Sequence[str], timeout_s: float, cwd: Path,
         extra_env: Sequence[tuple[str, str]] = ()) -> tuple[int | None, str, float]:
    """Run ``argv`` in its own session; on timeout kill the whole session. (rc or None, output, s)"""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(extra_env))
    process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output or "", time.perf_counter() - start
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the worker and anything it started
        output, _ = process.communicate()
        return None, output or "", time.perf_counter() - start


def _merge(parts: dict[str, Any], step: Step, answer: dict[str, Any]) -> None:
    part = parts.setdefault(step.part, {"error": None, "seconds": 0.0, "data": None})
    part["seconds"] = round(part["seconds"] + answer.get("seconds", 0.0), 2)
    error, data = answer.get("error"), answer.get("data")
    if step.part == "creation" and not data and error:
        # A creation step that died, hung or was skipped: the method rows below carry the error.
        error = None
    if error:
        part["error"] = f"{part['error']}; {step.label}: {error}" if part["error"] else \
            f"{step.label}: {error}"
    if step.part == "memory":
        part["data"] = part["data"] or {"trials": []}
        if data:
            part["data"]["trials"].append(data)
    elif step.part == "nccl_backends":
        part["data"] = part["data"] or {"backends": []}
        name = step.argv[step.argv.index("--backend") + 1]
        part["data"]["backends"].append(data or {"backend": name, "error": answer.get("error")})
    elif step.part == "creation":
        part["data"] = part["data"] or {"methods": []}
        if data:
            part["data"]["methods"] += data.get("methods", [])
        elif answer.get("error"):
            methods = step.argv[step.argv.index("--methods") + 1].split(",")
            part["data"]["methods"] += [{"method": m, "error": answer["error"]} for m in methods]
    else:
        part["data"] = data


def _pytest_answer(rc: int | None, output: str, seconds: float) -> dict[str, Any]:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines)
                    if any(w in line for w in ("passed", "failed", "skipped", "error"))),
                   lines[-1] if lines else "")
    data = {"returncode": rc, "summary": summary, "tail": output[-TAIL_CHARS:]}
    error = None if rc in (0, 5) else ("timed out" if rc is None else f"exit code {rc}")
    return {"data": data, "error": error, "seconds": round(seconds, 2)}


def run_check(out_dir: str | Path, *, smoke: bool, budget_s: float = 480.0,
              python: str | None = None, also_out: str | Path | None = None,
              parts: Sequence[str] | None = None,
              say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the check and write every file; returns the measurements dict.

    Args:
        out_dir: where the files go (created).
        smoke: gloo on the CPU: every part runs its plumbing, nothing is a GPU figure.
        budget_s: wall-clock limit for the whole check, analysis included.
        python: the interpreter for the parts (default: this one).
        also_out: a second folder that receives copies of the files.
        parts: only these parts (machine, streams, async_wait_cost, memory, creation,
            nccl_backends, megatron, pytest, gloo_creation).
        say: progress lines (default: print); every line also lands in ``log.txt``.
    """
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[2]  # tools/gpu_check/orchestrate.py -> the repository root
    log_lines: list[str] = []

    def note(line: str) -> None:
        log_lines.append(line)
        (say or print)(line)

    measurements: dict[str, Any] = {
        "schema": SCHEMA, "smoke": smoke, "budget_s": budget_s,
        "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), "parts": {},
    }
    traces: dict[str, Any] = {}
    steps = plan_steps(python or sys.executable, smoke, parts)
    with tempfile.TemporaryDirectory(prefix="cg-gpu-check-") as tmp:
        for index, step in enumerate(steps):
            left = budget_s - (time.perf_counter() - started) - REPORT_RESERVE_S
            if left < MIN_STEP_S:
                note(f"[skip] {step.label}: {left:.0f} s of budget left")
                _merge(measurements["parts"], step, {"error": "skipped: out of time budget"})
                continue
            timeout = min(step.timeout_s, left)
            argv = list(step.argv)
            result = Path(tmp) / f"{index}.json"
            if step.part != "pytest":
                argv += ["--result", str(result)]
            elif not all((repo / name).exists() for name in PYTEST_FILES):
                note(f"[skip] pytest: {', '.join(PYTEST_FILES)} not all found under {repo}")
                continue
            note(f"[run ] {step.label} (timeout {timeout:.0f} s)")
            rc, output, seconds = _run(argv, timeout, repo, step.env)
            log_lines.append(f"----- {step.label}: exit {rc}, {seconds:.1f} s -----")
            log_lines.append(output[-TAIL_CHARS:] if step.part != "pytest" else output)
            if step.part == "pytest":
                answer = _pytest_answer(rc, output, seconds)
            elif result.exists():
                answer = json.loads(result.read_text())
            else:
                reason = (f"timed out after {timeout:.0f} s (killed; a hang?)" if rc is None
                          else f"crashed with exit code {rc}")
                answer = {"error": f"{reason}; output tail: {output[-300:].strip()}",
                          "seconds": round(seconds, 2)}
            if step.part == "streams" and isinstance(answer.get("data"), dict):
                traces.update(answer["data"].pop("traces", {}) or {})
            _merge(measurements["parts"], step, answer)
            error = str(answer.get("error") or "")
            status = ("ok" if not error else error[:200] if error.startswith("skipped: ")
                      else f"ERROR {error[:200]}")
            note(f"[done] {step.label}: {seconds:.1f} s, {status}")
    machine = (measurements["parts"].get("machine") or {}).get("data") or {}
    measurements["machine"] = machine
    measurements["duration_s"] = round(time.perf_counter() - started, 1)
    (out / MEASUREMENTS).write_text(json.dumps(measurements, indent=1, default=str) + "\n")
    (out / TRACES).write_text(json.dumps(traces) + "\n")
    written = [out / MEASUREMENTS, out / TRACES]
    try:
        written += write_derived(out, measurements, traces)
    except Exception as error:  # the measured files are already safe on disk
        note(f"[fail] analysis: {type(error).__name__}: {error}")
    note(f"[end ] {measurements['duration_s']:.0f} s; files in {out}")
    (out / LOG).write_text("\n".join(log_lines) + "\n")
    written.append(out / LOG)
    if also_out is not None:
        target = Path(also_out)
        target.mkdir(parents=True, exist_ok=True)
        for path in written:
            if path.exists() and path.parent.resolve() != target.resolve():
                shutil.copy2(path, target / path.name)
        (say or print)(f"[copy] {len(written)} files to {target}")
    return measurements
