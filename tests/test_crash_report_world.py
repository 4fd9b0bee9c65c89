"""A rank whose script dies of an unhandled exception (the commonest crash: a training step
raised) is reported lost by its host's relay at once, while every other rank is idle: its exit
hook says it is dying instead of goodbye (``Liveness._settle``), and the relay reports without
waiting for its process to leave ``/proc``. Plain processes (``tests/crash_job.py``), as a
launcher such as torchrun starts them: Python's own top level prints the exception and runs the
exit hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported

from commgroups.rank_loss.local_peers import this_process

pytestmark = [pytest.mark.world,
              pytest.mark.skipif(this_process() is None, reason="no /proc: not Linux")]

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
BACKSTOP_S = 10.0  # the beat's first report of a silent rank: ten dead_after_s (1 s) at least


@pytest.mark.parametrize("crash", ["relay", "fed"])
def test_a_rank_dying_of_an_exception_is_reported_at_once(tmp_path: Path, crash: str) -> None:
    store = TCPStore("127.0.0.1", 0, WORLD + 1, True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))  # here: it outlives every rank
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(WORLD),
           "STORE_PORT": str(store.port), "CRASH": crash, "OUT": str(tmp_path)}
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "crash_job.py")],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for rank in range(WORLD)]
    outputs = []
    for process in ranks:
        try:
            out, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
        outputs.append((process.returncode, out.decode(errors="replace")))
    results = {int(path.stem.split("-")[1]): json.loads(path.read_text())
               for path in tmp_path.glob("rank-*.json")}
    assert len(results) == WORLD - 1, outputs
    crashing = next(iter(results.values()))["crashing"]
    assert outputs[crashing][0] != 0 and "a step failed" in outputs[crashing][1], outputs
    for rank, result in results.items():
        assert result["crashing"] == crashing and rank != crashing, results
        assert (crashing == result["relay"]) == (crash == "relay"), results
        # Heard well before the backstop could speak (0.02-0.17 s measured under torchrun).
        assert result["heard"] and result["after_s"] < BACKSTOP_S / 2, results
