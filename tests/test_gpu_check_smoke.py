"""The GPU check's plumbing on the CPU: the script, the orchestrator, every part, the outputs.

``scripts/gpu-check --cpu-smoke`` runs every part for real with gloo in one-rank worlds (no GPU
figures: no device memory, no CUDA trace), each in its own process under a timeout, then writes the
report; ``--also-out DIR`` receives copies. Without ``--cpu-smoke`` and without CUDA
the script only says so and exits 0.

Its tests that start processes are in ``tests/test_gpu_check_smoke_world.py`` (marked ``world``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.gpu_check.orchestrate import plan_steps
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
    assert labels[-1] == "pytest"
    backends = [s for s in steps if s.part == "nccl_backends"]  # one process per NCCL backend
    assert [s.argv[s.argv.index("--backend") + 1] for s in backends] == [
        "nccl", "nccl-legacy", "nccl2"]
    assert [s.part for s in plan_steps("python3", smoke=True, parts=["nccl_backends"])] == [
        "nccl_backends"]  # a smoke run: one, on gloo
    assert [s.part for s in plan_steps("python3", smoke=True, parts=["memory"])] == ["memory"]


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as archive:
        meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *[f"Requires-Dist: {r}" for r in requires], "", "Requires-Dist: x"])
        archive.writestr(f"{dist}.dist-info/METADATA", meta)


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
