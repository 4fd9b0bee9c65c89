"""The audit's analysis half imports no torch and forms no import cycle; it (and the CLI) runs with
torch blocked.

No process group and no torch.distributed: the inputs are plain data.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_audit_imports.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_audit_imports import REPO
from tests.test_hazards import _rank_data, _rec
from tests.test_merge import _write_run

pytestmark = pytest.mark.world


_BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys, types

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"blocked: the audit's analysis imported {name}")
            return None

    sys.meta_path.insert(0, BlockTorch())
    # commgroups/__init__ imports the registry (and torch): load the package's modules without it,
    # as the planner's torch-free test does
    package = types.ModuleType("commgroups")
    package.__path__ = [sys.argv[1]]
    sys.modules["commgroups"] = package
""")


def _run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code),
                           str(REPO / "commgroups"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_analysis_and_cli_run_with_torch_blocked(tmp_path: Path) -> None:
    _write_run(tmp_path, [_rank_data(rank, [_rec("c10d.allreduce_", True, group="0")])
                          for rank in range(2)])
    library = _run_without_torch("""
        import json
        import commgroups.audit as audit
        report = audit.merge_dir(sys.argv[2])
        hazards = audit.find_hazards(audit.load_dir(sys.argv[2]))
        try:
            audit.record
            recorder = "imported"
        except ImportError as error:  # the torch half, asked for by name, needs torch
            recorder = str(error)
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps({"kinds": [h.kind for h in report.hazards], "local": len(hazards),
                          "text": report.render(), "recorder": recorder, "torch": torch}))
    """, str(tmp_path))
    assert library.returncode == 0, library.stderr
    out = json.loads(library.stdout)
    assert out["kinds"] == ["aliasing"] and out["local"] == 1 and out["torch"] == []
    assert "aliasing on group 0 (ranks 0,1)" in out["text"]
    assert out["recorder"].startswith("blocked: the audit's analysis imported torch")
    cli = _run_without_torch("""
        from commgroups.cli import main
        sys.exit(main(["audit", sys.argv[2], "--json"]))
    """, str(tmp_path))
    assert cli.returncode == 1, cli.stderr  # 1: hazards found
    assert json.loads(cli.stdout)["hazards"][0]["kind"] == "aliasing"
