"""The flight recorder on a real 4-rank gloo world: each kind of hang diagnosed in the error every
waiting rank raises and in the merged dumps.

One world runs the scenarios in turn, each on its own world-spanning role (a timed-out gloo group is
not used again) with a 2 s timeout; a ``hold`` role with a long timeout lines the ranks up between
scenarios. The last scenario kills a rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import commgroups as cg
from commgroups.flight_recorder.merge import merge_dir
from tests.worlds import run_world

pytestmark = pytest.mark.world

SKIPPER, SLEEPER, ODD_OP, DIES = 2, 1, 3, 3


def _caught(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except cg.errors.RoleCollectiveError as error:
        cause = error.__cause__
        return {"cls": type(error).__name__, "text": str(error), "flight": error.flight,
                "waited_s": time.monotonic() - start,
                "cause": None if cause is None else f"{type(cause).__name__}: {cause}"[:400]}
    return {"cls": None}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    roles = [cg.RoleSpec(name=name, dims=["cp"], timeout_s=2)
             for name in ("skip", "sleep", "mismatch", "dies")]
    roles.append(cg.RoleSpec(name="hold", dims=["cp"], timeout_s=60))
    out: dict[str, Any] = {}
    with cg.GroupRegistry(cg.Layout(dims={"cp": world_size}, roles=roles)) as registry:
        hold = registry.collectives("hold")
        tensor = torch.ones(4)
        for name in ("skip", "sleep", "mismatch", "dies"):
            registry.collectives(name).all_reduce(tensor)  # #1 on every rank
        hold.barrier()

        skip = registry.collectives("skip")
        if rank != SKIPPER:  # the skipper goes on to the hold barrier and waits there
            out["skip"] = _caught(lambda: skip.all_reduce(tensor))
        hold.barrier()

        sleep = registry.collectives("sleep")
        if rank == SLEEPER:
            time.sleep(5)  # stuck in Python: its publisher thread still answers
        else:
            out["sleep"] = _caught(lambda: sleep.all_reduce(tensor))
        hold.barrier()

        mismatch = registry.collectives("mismatch")
        if rank == ODD_OP:
            out["mismatch"] = _caught(lambda: mismatch.broadcast(tensor, src=ODD_OP))
        else:
            out["mismatch"] = _caught(lambda: mismatch.all_reduce(tensor))
        hold.barrier()

        # The dying rank reports nothing: every rank keeps what it saw so far in a file.
        directory = Path(os.environ["COMMGROUPS_FLIGHT_DIR"])
        (directory / f"seen-rank{rank}.json").write_text(json.dumps(out), encoding="utf-8")
        dies = registry.collectives("dies")
        if rank == DIES:
            os._exit(0)
        out["dies"] = _caught(lambda: dies.all_reduce(tensor))
        out["dump"] = registry.dump_flight_recorder()
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    directory = tmp_path_factory.mktemp("flight")
    finished = run_world(_scenarios, 4, timeout=150, expect_errors=True,
                         env={"COMMGROUPS_FLIGHT_DIR": str(directory)})
    results: list[Any] = []
    for rank, result in enumerate(finished):
        seen = json.loads((directory / f"seen-rank{rank}.json").read_text(encoding="utf-8"))
        results.append({**seen, **result} if isinstance(result, dict) else {**seen, "end": result})
    return results, directory


def _assert_timed_out(got: dict[str, Any]) -> None:
    """A diagnosed hang: RoleHangError, or, on torch 2.15's gloo, the closed connection of a peer
    whose own 2 s timeout fired first (this rank's wait ends "Connection closed by peer" just as
    its timeout would: a failure after the whole role timeout, diagnosed all the same)."""
    if got["cls"] == "RoleCollectiveError":
        assert "Connection closed by peer" in str(got.get("cause")), (got.get("cause"), got)
        assert got["waited_s"] >= 2 - 0.1, got
    else:
        assert got["cls"] == "RoleHangError", (got.get("cause"), got)


def test_a_rank_that_skipped_a_call_is_named_behind_with_where_it_waits(scenarios: Any) -> None:
    results, _ = scenarios
    for rank in (0, 1, 3):
        got = results[rank]["skip"]
        _assert_timed_out(got)
        assert got["flight"]["behind"] == [SKIPPER], got
        assert got["flight"]["ahead"] == [] and got["flight"]["silent"] == [], got
        assert f"behind: rank {SKIPPER} (last all_reduce #1" in got["text"]
        assert "now in hold barrier" in got["text"]
        assert len(got["text"]) <= 300
        assert got["waited_s"] < 2 + 4  # the role timeout plus a few seconds


def test_a_rank_stuck_in_python_is_named_behind_not_silent(scenarios: Any) -> None:
    results, _ = scenarios
    for rank in (0, 2, 3):
        got = results[rank]["sleep"]
        _assert_timed_out(got)
        assert got["flight"]["behind"] == [SLEEPER], got
        assert got["flight"]["silent"] == [], got
        state = next(s for s in got["flight"]["ranks"] if s["rank"] == SLEEPER)
        assert state["now"] is None  # in no collective: busy in Python


def test_a_different_op_at_the_same_sequence_number_is_a_mismatch_with_both_sites(
        scenarios: Any) -> None:
    results, _ = scenarios
    for rank in (0, 1, 2):
        got = results[rank]["mismatch"]
        assert got["flight"] is not None, got
        assert got["flight"]["mismatch"] == [ODD_OP]
        assert "different op at this seq: rank 3 (last broadcast #2 at test_flight_recorder_world.py:" \
            in got["text"]
        assert got["text"].startswith("role 'mismatch': all_reduce #2 at test_flight_recorder_world.py:")
    odd = results[ODD_OP]["mismatch"]
    assert odd["flight"]["mismatch"] == [0, 1, 2]


def test_a_dead_rank_is_named_silent(scenarios: Any) -> None:
    results, _ = scenarios
    assert isinstance(results[DIES]["end"], TimeoutError)  # it exited without reporting
    diagnosed = 0
    for rank in (0, 1, 2):
        got = results[rank]["dies"]
        # a timeout (RoleHangError) or a closed connection (RoleCollectiveError), each named
        # within the role timeout plus a few seconds
        assert got["cls"] in ("RoleHangError", "RoleCollectiveError"), got
        assert got["waited_s"] < 2 + 4, got
        if got["flight"] is None:  # the heartbeat reported the loss first: interrupted, no wait
            assert got["cls"] == "RoleCollectiveError", got
            continue
        diagnosed += 1
        assert DIES in got["flight"]["silent"], got  # ranks that left before: left or silent
        assert got["flight"]["behind"] == [] and got["flight"]["mismatch"] == []
        assert "silent: rank 3 (no fresh status: dead or frozen" in got["text"]
    assert diagnosed >= 1  # its direct peers see the closed connection before any heartbeat


def test_the_merged_dumps_name_each_hang(scenarios: Any) -> None:
    results, directory = scenarios
    assert {Path(results[r]["dump"]).parent for r in (0, 1, 2)} == {directory}
    report = merge_dir(directory)
    kinds = {(hazard.kind, hazard.role): hazard for hazard in report.hazards}
    assert kinds[("behind", "skip")].ranks == (SKIPPER,)
    assert kinds[("behind", "sleep")].ranks == (SLEEPER,)
    assert kinds[("behind", "dies")].ranks == (DIES,)
    mismatch = kinds[("mismatch", "mismatch")]
    assert "broadcast" in mismatch.message and "all_reduce" in mismatch.message
    assert set(report.rows) == {"skip", "sleep", "mismatch", "dies", "hold"}
    text = report.render()
    assert "role skip:" in text and "groups (c10d names" in text
    assert {info["role"] for info in report.groups.values()} >= {"skip", "dies"}
    command = subprocess.run([sys.executable, "-m", "commgroups", "flight", "merge", str(directory)],
                             capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1])
    assert command.returncode == 1, command.stderr  # hazards found
    assert "behind (skip)" in command.stdout
