"""`commgroups plan` and `python -m commgroups plan` from the repository root.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_cli_plan.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.world


def test_python_dash_m_from_root() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "commgroups", "plan", "examples/layouts/hsdp_2x2.yaml"],
        capture_output=True, text=True, check=True,
    )
    assert "dp_replicate" in out.stdout and "fingerprint" in out.stdout
