"""The wheel installs backends/ as commgroups.backends and never as a bare top-level package.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_packaging.py``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.world, pytest.mark.version_independent]


@pytest.mark.slow
def test_wheel_layout(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("commgroups-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "commgroups/backends/__init__.py" in names
    assert "commgroups/backends/nccl.py" in names
    assert "commgroups/py.typed" in names
    assert not any(n.startswith("backends/") for n in names), "bare top-level backends package"
    assert not any(n.startswith(("tests/", "benchmarks/", "tools/", "scripts/")) for n in names)
    assert not any(n.startswith("commgroups/bench/gpu") for n in names)
    # the installed wheel imports commgroups.backends away from the source tree
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-c", "import commgroups.backends as b; print(b.__file__)"],
        cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip().startswith(str(target / "commgroups" / "backends"))
