"""`commgroups plan` and `python -m commgroups plan` from the repository root.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_cli_plan.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

pytestmark = pytest.mark.world


def test_python_dash_m_from_root() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "commgroups", "plan", str(LAYOUTS / "hsdp_2x2.yaml")],
        cwd=LAYOUTS.parent.parent, capture_output=True, text=True, check=True,
    )
    assert "dp_replicate" in out.stdout and "fingerprint" in out.stdout
