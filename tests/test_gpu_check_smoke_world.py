"""The GPU check's plumbing on the CPU: the script, the orchestrator, every part, the outputs.

``scripts/gpu-check --cpu-smoke`` runs every part for real with gloo in one-rank worlds (no GPU
figures: no device memory, no CUDA trace), each in its own process under a timeout, then writes the
report; ``--also-out DIR`` receives copies. Without ``--cpu-smoke`` and without CUDA
the script only says so and exits 0.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_gpu_check_smoke.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commgroups.torch_internals.version import torch_version
from tools.gpu_check.orchestrate import _run, run_check

pytestmark = [pytest.mark.world, pytest.mark.version_independent]


TORCH = torch_version()
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, **extra)
    return env


def test_without_cuda_it_says_so_and_exits_0() -> None:
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device here" in out.stdout and "nothing measured" in out.stdout


@pytest.mark.slow
def test_cpu_smoke_runs_every_part(tmp_path: Path) -> None:
    results, device_out = tmp_path / "results", tmp_path / "handed-back"
    out = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", "--out", str(results),
                          "--also-out", str(device_out)], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=480)  # a hang bound: ~90 s quiet
    assert out.returncode == 0, out.stdout + out.stderr
    names = {"measurements.json", "traces.json", "analysis.json", "report.md", "report.png",
             "log.txt"}
    assert names <= {p.name for p in results.iterdir()}
    copied = {p.name for p in device_out.iterdir()}
    assert names <= copied and len(copied) <= 8  # a handful of flat files to carry back
    assert "memory.json" not in copied  # a smoke run measures no device memory
    measurements = json.loads((results / "measurements.json").read_text())
    parts = measurements["parts"]
    assert set(parts) == {"machine", "streams", "async_wait_cost", "memory", "creation",
                          "nccl_backends", "megatron", "pytest", "gloo_creation"}
    (backend,) = parts["nccl_backends"]["data"]["backends"]  # the smoke run's one, on gloo
    assert backend["ran_on"] == "gloo" and backend["ok"], backend
    assert {s["step"] for s in backend["steps"]} >= {"all_reduce", "set_timeout",
                                                      "abort (_abort_process_group)"}
    assert measurements["smoke"] is True and parts["machine"]["data"]["torch"]
    variants = {v["variant"]: v for v in parts["streams"]["data"]["variants"]}
    assert len(variants) == 11 and all(v["error"] is None for v in variants.values()), variants
    assert variants["role_collectives"]["trace"] == "role_collectives"
    assert "role_collectives" in json.loads((results / "traces.json").read_text())
    cases = parts["async_wait_cost"]["data"]["cases"]
    assert {c["op"] for c in cases} == {"all_reduce", "all_gather_into_tensor"}
    assert all(len(c["reps"]) == 3 and c["error"] is None for c in cases)
    methods = {m["method"]: m for m in parts["creation"]["data"]["methods"]}
    # split_group needs a device-bound default group: its failure is recorded, the rest still ran
    split_error = methods["split_group"]["error"]
    # torch <= 2.14 refuses split_group there ("No device associated"); 2.15 splits gloo on CPU.
    assert split_error is None if TORCH >= (2, 15, 0) else "No device associated" in split_error
    assert len(methods["new_group all_ranks"]["create_s"]) == 2
    assert methods["registry auto"]["paths"] and methods["new_group local"]["error"] is None
    trial = parts["memory"]["data"]["trials"][0]
    assert trial["error"] is None and [p["groups"] for p in trial["points"]][-4:] == [1, 2, 4, 8]
    assert "skipped" in parts["pytest"]["data"]["summary"]
    megatron = parts["megatron"]
    if HAS_MEGATRON:  # a CPU smoke run builds the model on registry groups, trains nothing
        assert megatron["error"] is None and megatron["data"]["build"]["error"] is None
    else:
        assert megatron["error"].startswith("megatron: skipped: megatron-core is not importable")
    gloo = parts["gloo_creation"]  # the bench's creation scenarios, one 4-rank world each here
    assert gloo["error"] is None and gloo["data"]["worlds"] == [4], gloo
    assert set(gloo["data"]["ratios"]["4"]) == {"steady", "steady_vs_devicemesh_own_fsdp", "first"}
    assert all(ratio > 0 for ratio in gloo["data"]["ratios"]["4"].values())
    report = (results / "report.md").read_text()
    assert "## Megatron-Core through the registry's collection" in report
    assert "## Creation on gloo ranks with a CPU core each" in report
    assert "CPU smoke run" in report and (TORCH >= (2, 15, 0) or "No device associated" in report)


def test_a_hanging_part_is_killed_at_its_timeout(tmp_path: Path) -> None:
    rc, output, seconds = _run([sys.executable, "-c", "import time; print('up', flush=True); "
                                "time.sleep(60)"], 2.0, tmp_path)
    assert rc is None and "up" in output and seconds < 30


def test_out_of_budget_parts_are_recorded_not_run(tmp_path: Path) -> None:
    measurements = run_check(tmp_path, smoke=True, budget_s=1.0, say=lambda line: None)
    assert all("out of time budget" in str(part["error"]) or part["data"]
               for part in measurements["parts"].values())
    assert "skipped: out of time budget" in (tmp_path / "report.md").read_text()


def test_megatron_part_without_megatron_core_says_skipped(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A `megatron` package that refuses import, first on the path: the part's process sees no
    # megatron-core whether or not this Python has it.
    hidden = tmp_path / "hide" / "megatron"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hidden.parent), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    measurements = run_check(tmp_path / "out", smoke=True, parts=["megatron"],
                             say=lambda line: None)
    assert list(measurements["parts"]) == ["megatron"]  # listed, and it says why it did not run
    part = measurements["parts"]["megatron"]
    assert part["error"].startswith("megatron: skipped: megatron-core is not importable")
    assert "hidden by the test" in part["error"]
    assert part["data"]["ran"] is False
    report = (tmp_path / "out" / "report.md").read_text()
    assert "skipped: megatron-core is not importable (ImportError: hidden by the test)" in report


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed (Python 3.12 only)")
def test_megatron_part_builds_the_model_on_registry_groups(tmp_path: Path) -> None:
    measurements = run_check(tmp_path, smoke=True, parts=["megatron"], say=lambda line: None)
    part = measurements["parts"]["megatron"]
    assert part["error"] is None, part
    data = part["data"]
    assert data["ran"] is False  # no CUDA: built, not trained
    assert data["build"]["error"] is None and data["build"]["params"] > 0
    assert data["forward_backward"]["error"].startswith("skipped: a CPU smoke run")
    used = {row["field"] for row in data["fields"]}
    assert {"tp", "pp", "cp"} <= used  # what GPTModel reads from the collection
    assert data["all_fields_registry"] is True
    assert all(row["registry_group"] and not row["default_group"] for row in data["fields"])
    held = data["module_groups"]["model"]
    assert held["count"] > 0 and held["all_registry"] and not held["default_group"]
    assert data["parallel_state_initialized"] is False
