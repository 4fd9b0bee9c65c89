"""The flight recorder on a real 4-rank gloo world: each kind of hang diagnosed in the error every
waiting rank raises and in the merged dumps.

One world runs the scenarios in turn, each on its own world-spanning role (a timed-out gloo group is
not used again) with a 2 s timeout; a ``hold`` role with a long timeout lines the ranks up between
scenarios. The last scenario kills a rank.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import commgroups as cg
from commgroups.flight_recorder import session
from commgroups.flight_recorder.merge import merge_dir
from tests.worlds import connected_barrier, run_world

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


def _log_diagnoses(rank: int) -> None:
    """Every record of the flight recorder's session, debug included, into a file per rank (a
    dying rank's too: the handler writes each record at once)."""
    directory = Path(os.environ["COMMGROUPS_FLIGHT_DIR"])
    handler = logging.FileHandler(directory / f"log-rank{rank}.txt", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(session.__name__)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


def _diagnoses(directory: Path, ranks: range) -> dict[str, dict[str, list[int]]]:
    """role -> level -> the ranks that logged its diagnosis at that level."""
    found: dict[str, dict[str, list[int]]] = {}
    for rank in ranks:
        path = directory / f"log-rank{rank}.txt"
        for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
            level, _, text = line.partition(" ")
            if text.startswith("flight recorder, role "):
                role = text.removeprefix("flight recorder, role ").split(":")[0]
                found.setdefault(role, {}).setdefault(level, []).append(rank)
    return found


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    _log_diagnoses(rank)
    roles = [cg.RoleSpec(name=name, dims=["cp"], timeout_s=2)
             for name in ("skip", "sleep", "mismatch", "refused", "dies")]
    roles.append(cg.RoleSpec(name="hold", dims=["cp"], timeout_s=60))
    out: dict[str, Any] = {}
    with cg.GroupRegistry(cg.Layout(dims={"cp": world_size}, roles=roles)) as registry:
        hold = registry.collectives("hold")
        tensor = torch.ones(4)
        for name in ("skip", "sleep", "mismatch", "refused", "dies"):
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

        refused = registry.collectives("refused")  # gloo refuses the output's size on every rank
        out["refused"] = _caught(lambda: refused.all_gather_into_tensor(torch.empty(3), tensor))
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
        # Under load a peer may answer after the asker stopped waiting (the 2.15 leg: rank 1,
        # for a failure that was not a timeout). The text lists silent ranks before mismatched
        # ones, and its 300 characters then cut this one; the details above still name it.
        if not got["flight"]["silent"]:
            assert "different op at this seq: rank 3 (last broadcast #2 at " \
                "test_flight_recorder_world.py:" in got["text"]
        assert got["text"].startswith("role 'mismatch': all_reduce #2 at test_flight_recorder_world.py:")
    odd = results[ODD_OP]["mismatch"]
    if odd["cls"] == "RoleHangError":  # its own timeout: the whole wait, every peer answered
        assert odd["flight"]["mismatch"] == [0, 1, 2], odd["flight"]
    else:
        # torch 2.15's gloo: a peer's timeout closed the connection first, and a failure that
        # is not a timeout waits only until the answers stop (a loss is the likely cause). Under
        # load a peer still blocked in its all_reduce may answer after that; it is then read
        # from its last published status, which may predate the call (behind). Seen on the 2.15
        # leg (mismatch [2]). Never reached or ahead: nobody else called broadcast #2.
        flight = odd["flight"]
        assert flight["mismatch"] and set(flight["mismatch"]) <= {0, 1, 2}, flight
        assert set(flight["mismatch"]) | set(flight["behind"]) | set(flight["silent"]) \
            == {0, 1, 2}, flight
        assert not flight["reached"] and not flight["ahead"], flight


def test_a_call_the_backend_refuses_keeps_its_words_and_asks_no_peer(scenarios: Any) -> None:
    # The group never counted the call: comparing the peers' statuses would set this rank's
    # previous call against theirs (it read "different op at this seq" on torch 2.10's CI leg).
    results, _ = scenarios
    for rank in range(4):
        got = results[rank]["refused"]
        assert got["cls"] == "RoleCollectiveError", got
        # gloo's words differ by torch ("invalid tensor size", "expected length 4, got 3")
        assert "ProcessGroupGloo::" in got["text"] and "got (3)" in got["text"].replace(
            "got 3", "got (3)"), got
        assert got["text"].startswith("role 'refused': all_gather"), got
        assert got["flight"] is None, got


def test_a_dead_rank_is_named_silent_or_reported_lost(scenarios: Any) -> None:
    results, _ = scenarios
    assert isinstance(results[DIES]["end"], TimeoutError)  # it exited without reporting
    for rank in (0, 1, 2):
        got = results[rank]["dies"]
        # a timeout (RoleHangError) or a closed connection (RoleCollectiveError), each named
        # within the role timeout plus a few seconds
        assert got["cls"] in ("RoleHangError", "RoleCollectiveError"), got
        assert got["waited_s"] < 2 + 4, got
        if " was interrupted: " in got["text"]:
            # Its host's relay reported the loss (within milliseconds of the exit, often before
            # the peers' diagnosis ended): the report names the dead rank, and the fix.
            assert got["cls"] == "RoleCollectiveError", got
            assert (f"was interrupted: rank {DIES} was reported lost in generation 0; fix: call "
                    "registry.rebuild() on every survivor") in got["text"], got
            continue
        # The peers saw the closed connection first: their diagnosis names it silent.
        assert got["flight"] is not None, got
        assert DIES in got["flight"]["silent"], got  # ranks that left before: left or silent
        assert got["flight"]["behind"] == [] and got["flight"]["mismatch"] == []
        if list(got["flight"]["silent"]) == [DIES]:
            assert "silent: rank 3 (no fresh status: dead or frozen" in got["text"]
        else:  # a live peer slow to answer on loaded cores reads silent too (answer_waits'
            # trade after a closed connection; seen once on the 2.15 leg: rank 1): the text
            # names the lowest silent rank first
            assert "silent: rank " in got["text"], got
        if " failed: " in got["text"]:  # gloo's own words, where the ranks apart left room
            assert got["text"].split("; ")[0].split(" failed: ", 1)[1].strip(), got


def test_each_hang_is_printed_by_one_rank_and_logged_at_debug_by_the_others(
        scenarios: Any) -> None:
    results, directory = scenarios
    found = _diagnoses(directory, range(4))
    for role in ("skip", "sleep", "mismatch"):
        waiting = sorted(rank for rank in range(4) if results[rank].get(role, {}).get("flight"))
        # One rank prints it, every other one keeps it at debug. Usually the lowest that
        # diagnosed, but not always: a lower rank that says it diagnoses only after a higher
        # one claimed the call stays at debug (seen on CI's 2.15 leg: rank 1 printed the
        # mismatch, rank 0 logged it at debug). What must hold is once, by one who diagnosed.
        speakers = found[role].get("WARNING", [])
        assert len(speakers) == 1, (role, found)
        assert sorted(speakers + found[role].get("DEBUG", [])) == waiting, (role, found)
    diagnosed = sorted(rank for rank in range(3) if results[rank]["dies"]["flight"])
    if diagnosed:  # a survivor the heartbeat's report interrupted first does not diagnose
        assert len(found["dies"].get("WARNING", [])) == 1, found
        assert sorted(found["dies"]["WARNING"] + found["dies"].get("DEBUG", [])) == diagnosed


def _lowest_dies(rank: int, world_size: int) -> dict[str, Any]:
    _log_diagnoses(rank)
    roles = [cg.RoleSpec(name="dies", dims=["cp"], timeout_s=2),
             cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")]
    # No heartbeat: no loss report interrupts a survivor before its diagnosis.
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": world_size}, roles=roles), heartbeat_s=None)
    with registry:
        dies = registry.collectives("dies")
        dies.all_reduce(torch.ones(4))
        connected_barrier(registry, rank, world_size)
        if rank == 0:
            os._exit(0)
        got = _caught(lambda: dies.all_reduce(torch.ones(4)))
    return got


def test_the_lowest_rank_dead_a_survivor_prints_it_once(tmp_path: Path) -> None:
    finished = run_world(_lowest_dies, 3, timeout=90, expect_errors=True,
                         env={"COMMGROUPS_FLIGHT_DIR": str(tmp_path)})
    assert all(finished[rank]["flight"] for rank in (1, 2)), finished
    found = _diagnoses(tmp_path, range(3))
    # One survivor prints it, the other keeps it at debug. Not always rank 1: a survivor whose
    # peer is the dead rank fails at once, the other may fail only when that one closes, after
    # its diagnosis was printed (the later rank then finds the call claimed).
    assert sorted(found["dies"]) == ["DEBUG", "WARNING"], found
    assert sorted(found["dies"]["WARNING"] + found["dies"]["DEBUG"]) == [1, 2], found


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
    assert set(report.rows) == {"skip", "sleep", "mismatch", "refused", "dies", "hold"}
    # every rank's refused call failed alike at the same count: nobody behind or apart there
    text = report.render()
    assert not [kind for kind, role in kinds if role == "refused" and kind != "failed"], text
    assert "role skip:" in text and "groups (c10d names" in text
    assert {info["role"] for info in report.groups.values()} >= {"skip", "dies"}
    command = subprocess.run([sys.executable, "-m", "commgroups", "flight", "merge", str(directory)],
                             capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1])
    assert command.returncode == 1, command.stderr  # hazards found
    assert "behind (skip)" in command.stdout
