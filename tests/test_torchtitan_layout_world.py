"""The layout commgroups derives for torchtitan, and a given layout checked against the degrees.

Pure planning: needs neither torchtitan nor torch.distributed.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_torchtitan_layout.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.world


def test_importing_commgroups_never_imports_torchtitan() -> None:
    import subprocess
    import sys

    code = ("import sys, commgroups, commgroups.integrations.torchtitan as t; "
            "t.titan_layout(t.TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchtitan', 'tyro')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
