"""The GPU check's plumbing on the CPU: the script, the orchestrator, every part, the outputs.

``scripts/gpu-check --cpu-smoke`` runs every part for real with gloo in one-rank worlds (no GPU
figures: no device memory, no CUDA trace), each in its own process under a timeout, then writes the
report; ``--also-out DIR`` receives copies. Without ``--cpu-smoke`` and without CUDA
the script only says so and exits 0.

Its tests that start processes are in ``tests/test_gpu_check_smoke_world.py`` (marked ``world``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.gpu_check.analysis import analyze
from tools.gpu_check.orchestrate import plan_steps
from tools.gpu_check.report import markdown
from tools.gpu_check.wheels import check_wheels

# Repository tooling (tools/gpu_check): its GPU target runs its own torch (2.11), and on a CPU leg
# every test here checks plumbing (the script, the orchestrator, budgets, wheel checks), so it runs
# once, on CI's main leg.
pytestmark = pytest.mark.version_independent


def test_plan_steps_order_and_isolation() -> None:
    steps = plan_steps("python3", smoke=False)
    labels = [s.label for s in steps]
    assert labels[:3] == ["machine", "streams", "async_wait_cost"]
    assert sum(s.part == "memory" for s in steps) == 5  # one process per trial
    local = next(s for s in steps if "local" in s.label)
    assert local.argv[-1] == "new_group local" and local.timeout_s <= 60
    assert labels[-2:] == ["pytest", "gloo_creation"]  # CPU only: never takes a GPU part's time
    (gloo,) = plan_steps("python3", smoke=False, parts=["gloo_creation"])
    assert dict(gloo.env) == {"RES_OPTIONS": "attempts:0"} and gloo.timeout_s <= 150
    backends = [s for s in steps if s.part == "nccl_backends"]  # one process per NCCL backend
    assert [s.argv[s.argv.index("--backend") + 1] for s in backends] == [
        "nccl", "nccl-legacy", "nccl2"]
    assert [s.part for s in plan_steps("python3", smoke=True, parts=["nccl_backends"])] == [
        "nccl_backends"]  # a smoke run: one, on gloo
    assert labels[-3] == "megatron"  # after every torch-only part: it adds the longest import
    assert [s.part for s in plan_steps("python3", smoke=True, parts=["memory"])] == ["memory"]
    (megatron,) = plan_steps("python3", smoke=True, parts=["megatron"])
    assert megatron.argv[-2:] == ("megatron", "--smoke") and megatron.timeout_s <= 150


def _hide_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    # None in sys.modules makes `import megatron...` raise ImportError, installed or not.
    for name in ("megatron", "megatron.core", "megatron.core.models.gpt",
                 "megatron.core.process_groups_config"):
        monkeypatch.setitem(sys.modules, name, None)


def test_megatron_part_skips_without_megatron_core(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    from tools.gpu_check import worker
    from tools.gpu_check.megatron_model import collect_megatron, megatron_unavailable
    from tools.gpu_check.skip import PartSkipped

    _hide_megatron(monkeypatch)
    reason = megatron_unavailable()
    assert reason is not None and reason.startswith("megatron-core is not importable")
    assert "cp312" in reason and "make gpu-wheels" in reason
    with pytest.raises(PartSkipped, match="megatron-core is not importable"):
        collect_megatron(smoke=True)  # before any world exists: nothing to tear down
    result = tmp_path / "megatron.json"
    assert worker.main(["megatron", "--smoke", "--result", str(result)]) == 0  # a skip is no failure
    answer = json.loads(result.read_text())
    assert answer["error"] == f"skipped: {reason}"
    assert answer["data"] == {"ran": False, "skipped": reason}


def _megatron_data(**changes: Any) -> dict[str, Any]:
    fields = [{"field": name, "role": name, "set": True, "registry_group": True,
               "default_group": False, "backend": "single", "note": None}
              for name in ("cp", "dp", "dp_cp", "pp", "tp")]
    data: dict[str, Any] = {
        "ran": True, "megatron_core": "0.19.2", "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 1},
        "default_backend": "nccl", "loss": 4.85, "all_fields_registry": True,
        "parallel_state_initialized": False, "seconds": 3.2, "fields": fields,
        "build": {"error": None, "seconds": 0.2},
        "forward_backward": {"losses": [4.85, 4.6, 4.4], "error": None, "seconds": 0.5},
        "ddp": {"losses": [4.86, 4.59, 4.38], "error": None, "seconds": 0.4},
        "module_groups": {"model": {"all_registry": True, "default_group": False}},
    }
    data.update(changes)
    return data


def _measurements(part: dict[str, Any]) -> dict[str, Any]:
    return {"smoke": False, "parts": {"megatron": part}}


def test_megatron_analysis_and_report() -> None:
    good = analyze(_measurements({"error": None, "data": _megatron_data()}))
    assert good.megatron["ran"] is True and good.headline["megatron_ran"] is True
    assert good.megatron["fields_used"] == ["cp", "dp", "dp_cp", "pp", "tp"]
    assert not [e for e in good.errors if e.startswith("megatron")]
    report = markdown(good)
    assert "ran on the GPU: yes" in report and "4.85, 4.6, 4.4" in report
    assert "never the default group: yes" in report

    rows = _megatron_data()["fields"]
    rows[4] = {**rows[4], "registry_group": False}  # tp not the registry's group
    bad = analyze(_measurements({"error": None, "data": _megatron_data(
        fields=rows, all_fields_registry=False, parallel_state_initialized=True,
        ddp={"error": "RuntimeError: boom", "seconds": 0.1})}))
    assert "megatron: a group Megatron used is not its role's registry group: tp" in bad.errors
    assert "megatron/ddp: RuntimeError: boom" in bad.errors
    assert any("parallel_state was initialised" in e for e in bad.errors)
    assert "never the default group: no" in markdown(bad)

    reason = "megatron-core is not importable (ModuleNotFoundError: No module named 'megatron')"
    skipped = analyze(_measurements({"error": f"megatron: skipped: {reason}",
                                     "data": {"ran": False, "skipped": reason}}))
    assert f"skipped: {reason}" in markdown(skipped)
    assert skipped.headline["megatron_ran"] is False
    assert "megatron" not in analyze({"smoke": False, "parts": {}}).headline  # older results


def test_gloo_creation_analysis_and_report() -> None:
    summary = {"median": 1.1, "p25": 1.0, "p75": 1.2, "n": 6}
    table = {"title": "Creation, the first in a fresh process", "columns": ["world", "ratio"],
             "rows": [[8, summary]], "notes": []}
    data = {"nproc": 16, "worlds": [4, 8], "steady_worlds": 10, "first_pairs": 6,
            "ratios": {"8": {"steady": 1.25, "steady_vs_devicemesh_own_fsdp": 1.05,
                             "first": 1.1}},
            "steady": {**table, "title": "Creation: registry vs DeviceMesh"}, "first": table}
    analysis = analyze({"smoke": False, "parts": {"gloo_creation": {"error": None,
                                                                     "data": data}}})
    assert analysis.headline["creation_ratio_vs_devicemesh_gloo8_core_each"] == 1.25
    assert analysis.headline["creation_first_ratio_vs_devicemesh_gloo8_core_each"] == 1.1
    report = markdown(analysis)
    assert "- 16 CPU cores" in report and "8 ranks: the registry 1.25x DeviceMesh" in report
    assert "| 8 | 1.1 [1-1.2] |" in report  # a summarized cell as median [p25-p75]
    assert "gloo_creation" not in str(analysis.errors)
    # Results from before the part have no line for it.
    assert "creation_ratio_vs_devicemesh_gloo8_core_each" not in analyze(
        {"smoke": False, "parts": {}}).headline


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as archive:
        meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *[f"Requires-Dist: {r}" for r in requires], "", "Requires-Dist: x"])
        archive.writestr(f"{dist}.dist-info/METADATA", meta)


def test_gpu_wheels_list_brings_megatron_core() -> None:
    root = Path(__file__).resolve().parents[1]
    pins = [line.strip() for line in (root / "scripts" / "gpu-wheels.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    # The megatron part's wheel; its needs (torch, numpy, packaging) are the machine's own.
    assert "megatron-core==0.19.2" in pins
    provided = (root / "scripts" / "gpu-wheels").read_text()
    assert all(name in provided.split("PROVIDED=")[1].split("}")[0]
               for name in ("torch", "numpy", "packaging"))


def test_wheel_check(tmp_path: Path) -> None:
    _wheel(tmp_path, "pydantic", "2.14.4", ["annotated-types>=0.6.0", "pydantic-core==2.50.5",
                                            "email-validator>=2.0.0; extra == 'email'",
                                            "tzdata; platform_system == 'Windows'"])
    _wheel(tmp_path, "annotated-types", "0.8.0", [])
    assert check_wheels(tmp_path) == [
        "pydantic-2.14.4-py3-none-any.whl needs 'pydantic-core==2.50.5': no wheel here and not "
        "provided by the GPU machine; add it to scripts/gpu-wheels.txt"]
    assert check_wheels(tmp_path, provided=["pydantic_core"]) == []
    _wheel(tmp_path, "annotated-types", "0.5.0", [])
    problems = check_wheels(tmp_path, provided=["pydantic-core"])
    assert any("annotated-types: 2 versions" in p for p in problems)
    assert any("the folder has annotated-types 0.5.0" in p for p in problems)
    assert "no wheels" in check_wheels(tmp_path / "missing")[0]
