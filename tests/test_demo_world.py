"""``commgroups demo`` end to end: the registry run is clean and exact, the DeviceMesh baseline is not.

Each run is the real command in a subprocess (it spawns its own 4 gloo processes); one more runs
under torchrun. Small step counts keep each run to seconds.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_demo.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from commgroups.cli import main
from commgroups.demo.report import JSON_KEYS

pytestmark = pytest.mark.world


ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "examples" / "layouts" / "seed_cp4.toml"
ROLES = {"fsdp", "cp", "checkpoint-metadata"}


def _audit_available() -> bool:
    try:
        import commgroups.audit  # noqa: F401
    except ImportError:
        return False
    return True


def _run(args: list[str], json_path: Path, timeout: float = 240) -> tuple[dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run(
        [*args, "--json", str(json_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(json_path.read_text()), proc.stdout


@pytest.fixture(scope="module")
def registry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """``python -m commgroups demo --steps 2 --layout seed_cp4.toml`` (spawns 4 processes)."""
    out = tmp_path_factory.mktemp("demo") / "registry.json"
    return _run([sys.executable, "-m", "commgroups", "demo", "--steps", "2", "--layout", str(SEED)],
                out)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The same on plain init_device_mesh groups."""
    out = tmp_path_factory.mktemp("demo") / "baseline.json"
    return _run([sys.executable, "-m", "commgroups", "demo", "--steps", "2",
                 "--baseline", "devicemesh"], out)


def test_registry_run_is_clean_and_exact(registry_run: tuple[dict[str, Any], str]) -> None:
    result, stdout = registry_run
    assert list(result)[:len(JSON_KEYS)] == list(JSON_KEYS)
    assert result["world_size"] == 4
    assert result["aliases_of_default_group"] == 0
    assert result["hazards"] == []
    assert result["checkpoint_roundtrip"] == "exact"
    assert len(result["losses"]) == 2 and all(isinstance(v, float) for v in result["losses"])
    assert set(result["roles"]) == ROLES
    assert not any(info["is_default_group"] for info in result["roles"].values())
    assert result["roles"]["checkpoint-metadata"]["backend"] == "gloo"
    assert result["audit"] == ("on" if _audit_available() else result["audit"])
    # progress as it goes, then the report
    assert "[demo] step 1/2" in stdout and "[demo] checkpoint" in stdout
    assert "checkpoint round trip: exact" in stdout and "roles that alias the default group: 0" in stdout


def test_baseline_shows_what_the_audit_finds(
    baseline_run: tuple[dict[str, Any], str], registry_run: tuple[dict[str, Any], str]
) -> None:
    result, stdout = baseline_run
    assert result["world_size"] == 4
    assert result["aliases_of_default_group"] == 3  # fsdp, cp and DCP all on the default group
    assert result["checkpoint_roundtrip"] == "exact"
    # the same training, just on other communicators
    assert result["losses"] == registry_run[0]["losses"]
    if _audit_available():
        kinds = {hazard["kind"] for hazard in result["hazards"]}
        assert {"aliasing", "mixed_streams"} <= kinds
        assert "hazard(s)" in stdout


@pytest.mark.slow
def test_under_torchrun(tmp_path: Path) -> None:
    result, stdout = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", "-m", "commgroups", "demo", "--steps", "1",
                           "--no-audit", "-q"], tmp_path / "torchrun.json")
    assert result["world_size"] == 4 and result["checkpoint_roundtrip"] == "exact"
    assert result["audit"] == "off" and result["aliases_of_default_group"] == 0
    assert stdout.count("commgroups demo: GroupRegistry roles") == 1  # rank 0 reports, once


def test_world_size_must_match_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="describes 4 ranks"):
        main(["demo", "--layout", str(SEED), "--world-size", "2"])


def test_unsupported_layout_fails_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layout", str(ROOT / "examples" / "layouts" / "hsdp_2x2.yaml")]) == 2
    assert "fix:" in capsys.readouterr().err


def test_kill_rank_rebuilds_in_place_and_says_what_happened() -> None:
    """``commgroups demo --kill-rank 3``: rank 3 exits mid-step, the survivors rebuild and finish."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "commgroups", "demo", "--kill-rank", "3", "--kill-step", "1",
         "--steps", "3", "--role-timeout", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "lost: rank 3" in out
    assert "rebuilt on 2 ranks (dp_replicate=1 x dp_shard=2)" in out
    for phase in ("check_in", "replan", "retire", "create", "meshes"):
        assert f"{phase} " in out
    assert "left out: rank 2 (dropped)" in out
    assert "step 2" in out and "no checkpoint read" in out


@pytest.mark.parametrize(("args", "field"), [
    (["--kill-rank", "4"], "--kill-rank"),
    (["--kill-rank", "1", "--kill-step", "5"], "--kill-step"),
    (["--kill-rank", "1", "--layout", str(SEED)], "elastic"),
])
def test_kill_rank_input_is_checked_before_spawning(
    args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--steps", "3", *args]) == 2
    err = capsys.readouterr().err
    assert field in err and "fix:" in err
