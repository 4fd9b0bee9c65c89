"""The GPU check's analysis on a recorded sample (tests/data/gpu): no GPU, no torch needed.

The sample is hand-made in Kineto's Chrome-trace shape (kernels and copies with ``args.stream`` and
``correlation``, CUDA runtime/driver launches, ``cuda_sync`` Stream Wait Events, the ``cg:*``
record_function ranges) with NCCL work on two streams, plus a measurement file of every part.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_gpu_analysis.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_gpu_analysis import DATA

pytestmark = [pytest.mark.world, pytest.mark.version_independent]

ROOT = Path(__file__).resolve().parents[1]


def test_analysis_imports_no_torch(tmp_path: Path) -> None:
    """Re-analysing committed results needs no torch: run it with torch made unimportable.

    commgroups/__init__ imports torch (the registry), so the packages are stood in for by bare
    namespace modules: what is checked is every module the analysis itself pulls in.
    """
    for name in ("measurements.json", "traces.json"):
        (tmp_path / name).write_text((DATA / name).read_text())
    code = textwrap.dedent("""
        import sys, types
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        for name in ("commgroups", "commgroups.bench", "tools.gpu_check"):
            module = types.ModuleType(name)
            module.__path__ = [name.replace(".", "/")]
            sys.modules[name] = module
        from tools.gpu_check.outputs import load_and_write
        print(sorted(p.name for p in load_and_write(sys.argv[1])))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "report.md" in out.stdout and "memory.json" in out.stdout
