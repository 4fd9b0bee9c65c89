"""The pure planner: partitions, canonical order, one-rank planning at scale, the fingerprint.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_plan.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.world


def test_plan_imports_nothing_from_torch_distributed() -> None:
    # commgroups/__init__ imports the registry (and torch); import the pure modules in isolation
    code = ("import importlib.util, sys, types;"
            "pkg = types.ModuleType('commgroups'); pkg.__path__ = ['commgroups']; "
            "sys.modules['commgroups'] = pkg;"
            "import commgroups.planning.plan, commgroups.layout.layout_io;"
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('torch')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
