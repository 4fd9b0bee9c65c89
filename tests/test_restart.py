"""Restart mode under real torchrun elastic: a node is lost, the job restarts smaller and resumes.

Two torchrun agents on this machine play two nodes (c10d rendezvous on localhost, ``--nnodes 1:2``,
``--nproc-per-node 2``, ``--max-restarts 3``) and run tests/restart_job.py: FSDP2 on the registry's
roles of an auto layout, AdamW, a DCP checkpoint every two steps through the checkpoint-metadata
group. Once the 4-rank world has saved a checkpoint, the second agent and its workers are killed
(SIGKILL: a lost node). The first agent's workers fail on their dead peers, torchrun restarts them on
a 2-rank world, the registry sizes the "auto" dim by it, and the job reloads its newest complete
checkpoint resharded to 2 ranks. A separate single-agent torchrun starts fresh from that same
checkpoint at that size: its losses must equal the resumed job's, bitwise. The reference starts as
soon as no process of the 4-rank world is left (its checkpoints are final), while the surviving agent
waits in its rendezvous for the lost node's keep-alive to expire and for its last call (about 18 s
idle), and the test checks that the restarted job loaded the very checkpoint the reference got.

The first agent hosts the rendezvous store (``is_host=1``): the store dies with the agent that hosts
it, so the lost node must not be the host (an external store would lift this).

The same scenario runs torchtitan's trainer through ``with_registry`` (tests/titan_restart_job.py;
``titan_matrix``: about two minutes of torchtitan on 2 cores, so CI runs it in ``make test-titan``,
not in every torch leg's ``make test``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.restart_job import _die_with_parent

pytestmark = pytest.mark.world

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "restart_job.py"
TITAN_JOB = ROOT / "tests" / "titan_restart_job.py"
STEPS = 10
# Survivors that are direct peers of a lost rank fail at once ("Connection closed by peer"); the
# others after this. It also bounds the first step, which is slow on a loaded 2-core machine.
ROLE_TIMEOUT_S = 20
# How long the two-agent run, then the reference run, may take before the test fails (and kills
# what it started); the test's pytest timeout is above both. Measured on a 2-core machine shared
# with other jobs: 130-140 s in all at load average 10-12, 240 s at 21-29; most of it is importing
# torch in 10 processes.
DEADLINE_S = 300
REFERENCE_DEADLINE_S = 420

LAYOUTS = {
    # dp_shard follows the world: 4 ranks shard 4 ways, after the loss 2 ranks shard 2 ways, so
    # the checkpoint (parameters and AdamW state) is really resharded.
    "dp_shard-auto": f"""
[dims]
dp_shard = "auto"

[[roles]]
name = "fsdp"
dims = ["dp_shard"]
timeout_s = {ROLE_TIMEOUT_S}

[[roles]]
name = "checkpoint-metadata"
dims = "world"
backend = "gloo"
timeout_s = {ROLE_TIMEOUT_S}

[elastic]
dims = {{ dp_shard = 1 }}
""",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; torchrun starts workers in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing paren.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo.extend(_children(current))
    return pids


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _torchrun(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun's agent otherwise hands the workers of every
    # restart the same store (its own, while it stays node rank 0), where the keys of the previous
    # attempt's init_process_group are still set: the new workers read stale addresses and fail
    # to connect (pytorch#135712, seen on torch 2.13 gloo). With it, worker rank 0 hosts a fresh
    # store per restart.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           # torchtitan's job: offline data set and tokenizer made by the test
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        # An agent dies with this process (its workers die with it: restart_job.py), so nothing
        # outlives a test killed by its timeout or an interrupt.
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)


def _events(out: Path, pattern: str = "events-*.jsonl") -> list[dict[str, Any]]:
    events = []
    for path in sorted(out.glob(pattern)):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def _tail(*logs: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())


def _job_args(layout: Path, ckpt: Path, out: Path, *extra: str) -> list[str]:
    return [str(JOB), "--layout", str(layout), "--ckpt", str(ckpt), "--out", str(out),
            "--steps", str(STEPS), "--save-every", "2", "--timeout-s", str(ROLE_TIMEOUT_S), *extra]


def _wait(procs: list[subprocess.Popen[bytes]], until: float) -> None:
    for proc in procs:
        proc.wait(timeout=max(until - time.monotonic(), 1))


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _lose_a_node(job: list[str], logs: Path, ready: Callable[[], bool], until: float,
                 after_loss: Callable[[], None]) -> tuple[float, float]:
    """Run ``job`` under two torchrun agents (two "nodes" of 2 workers, c10d rendezvous on
    localhost); once ``ready()`` (the 4-rank world saved a checkpoint), SIGKILL the second agent and
    its workers; once the first agent's workers of that world have exited too (no process is left
    to write a checkpoint), call ``after_loss()`` (the first agent is then in its restart's
    rendezvous); wait until the first agent's restarted workers finish. Every agent started here
    is killed on the way out, whatever happens. Returns (killed at, finished at), monotonic."""
    port = _free_port()
    rdzv = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
            "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"restart-{port}"]
    # join_timeout bounds every rendezvous; last_call_timeout is how long a round waits for more
    # nodes once the minimum is there (the 4-rank start wants both agents: they start together,
    # and one later than that joins through a membership restart); a dead node's keep-alive
    # expires after interval x attempts, and the restart's round waits for that.
    # The expiry must outlast a starved agent: at load 14 on 2 cores a 1 s x 2 expiry dropped a live
    # agent, and the other formed a world of its own.
    conf = "join_timeout=90,last_call_timeout=10,close_timeout=5,keep_alive_interval=1," \
           "keep_alive_max_attempt=8"
    host_log, lost_log = logs / "host.log", logs / "lost.log"
    host = _torchrun([*rdzv, "--rdzv-conf", f"{conf},is_host=1", *job], host_log)
    lost = _torchrun([*rdzv, "--rdzv-conf", f"{conf},is_host=0", *job], lost_log)
    agents = [host, lost]
    try:
        while not ready():
            assert time.monotonic() < until, "no 4-rank checkpoint in time\n" + _tail(
                host_log, lost_log)
            assert host.poll() is None and lost.poll() is None, "an agent exited early\n" + _tail(
                host_log, lost_log)
            time.sleep(0.2)
        survivors = _children(host.pid)  # the first agent's workers of the 4-rank world
        _kill(_tree(lost.pid))  # the agent and its workers (torchrun gives them own sessions)
        killed_at = time.monotonic()
        lost.wait(timeout=10)
        # They fail on their dead peers (at once, or after their timeout) and the agent reaps them.
        while any(_alive(pid) for pid in survivors):
            assert time.monotonic() < until, "the 4-rank world's survivors did not exit\n" + _tail(
                host_log)
            time.sleep(0.2)
        after_loss()
        host.wait(timeout=max(until - time.monotonic(), 1))
        assert host.returncode == 0, _tail(host_log)
        return killed_at, time.monotonic()
    finally:
        for agent in agents:
            _kill(_tree(agent.pid))
        for agent in agents:
            if agent.poll() is None:
                agent.wait(timeout=10)


class _Reference:
    """The fresh single-agent run from the checkpoint the restarted job loads, started by
    :func:`_lose_a_node`'s ``after_loss`` while the surviving agent waits in its rendezvous (the
    two then share the machine for a while); killed on the way out, whatever happens."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.checkpoint: Path | None = None
        self.after_kill_s = 0.0

    def start(self, checkpoint: Path | None, job: Callable[[Path], list[str]],
              killed_at: Callable[[], float]) -> None:
        assert checkpoint is not None, "no complete checkpoint after the loss"
        self.checkpoint = checkpoint
        self.after_kill_s = time.monotonic() - killed_at()
        self.proc = _torchrun(["--standalone", "--nproc-per-node", "2", *job(checkpoint)],
                              self.log)

    def wait(self, until: float) -> None:
        assert self.proc is not None, "the reference never started"
        _wait([self.proc], until)
        assert self.proc.returncode == 0, _tail(self.log)

    def __enter__(self) -> _Reference:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _kill(_tree(self.proc.pid))
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)


@pytest.mark.world
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lost_node_restarts_smaller_and_resumes_from_the_checkpoint(
    name: str, tmp_path: Path
) -> None:
    from tests.restart_job import CKPT_PREFIX, latest_checkpoint

    started = time.monotonic()
    until = started + DEADLINE_S
    layout = tmp_path / "layout.toml"
    layout.write_text(LAYOUTS[name])
    ckpt, out, logs = tmp_path / "ckpt", tmp_path / "out", tmp_path
    ref_out, ref_ckpt = tmp_path / "ref_out", tmp_path / "ref_ckpt"
    for folder in (ckpt, out, ref_out, ref_ckpt):
        folder.mkdir()
    marks: dict[str, float] = {}

    def ready() -> bool:
        if any(e["event"] == "saved" and e["world"] == 4 for e in _events(out)):
            marks["kill"] = time.monotonic()
            return True
        return False

    with _Reference(logs / "ref.log") as reference:
        # The reference: a fresh 2-rank job from the checkpoint the restart will load.
        killed_at, finished_at = _lose_a_node(
            _job_args(layout, ckpt, out, "--step-sleep", "0.5"), logs, ready, until,
            lambda: reference.start(
                latest_checkpoint(ckpt),
                lambda source: _job_args(layout, ref_ckpt, ref_out, "--load", str(source)),
                lambda: marks["kill"]))

        events = _events(out)
        assert any(e["event"] == "loss" and e["world"] == 4 for e in events), \
            "never trained on 4 ranks"
        # The workers that finished: the last attempt, after the loss.
        final = {e["pid"] for e in events if e["event"] == "done"}
        mine = [e for e in events if e["pid"] in final]
        assert sorted(e["rank"] for e in mine if e["event"] == "done") == [0, 1]
        assert all(e["world"] == 2 and e["restart"] >= 1 for e in mine if e["event"] == "start")
        loaded = {e["rank"]: e["step"] for e in mine if e["event"] == "loaded"}
        assert set(loaded) == {0, 1} and loaded[0] == loaded[1] >= 1, loaded
        step = loaded[0]
        assert reference.checkpoint == ckpt / f"{CKPT_PREFIX}{step:04d}", (
            reference.checkpoint, step)
        dims = [e["dims"] for e in mine if e["event"] == "registry"]
        assert dims == [{"dp_shard": 2}] * 2, dims  # the "auto" dim sized by the 2-rank world
        after = {(e["rank"], e["step"]): e["loss"] for e in mine if e["event"] == "loss"}
        assert sorted({s for _, s in after}) == list(range(step + 1, STEPS))

        reference.wait(started + REFERENCE_DEADLINE_S)
    expected = {(e["rank"], e["step"]): e["loss"] for e in _events(ref_out) if e["event"] == "loss"}
    assert after == expected
    print(f"[restart] {name}: resumed from step {step} on 2 ranks; kill -> done "
          f"{finished_at - killed_at:.1f}s; reference started {reference.after_kill_s:.1f}s after "
          f"the kill; whole test {time.monotonic() - started:.1f}s")


@pytest.mark.world
@pytest.mark.titan_matrix  # torchtitan on 2 cores: `make test-titan`, not `make test`
@pytest.mark.titan_ci  # CI's one torchtitan restart
@pytest.mark.timeout(1200)
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')")
def test_torchtitan_with_registry_restarts_smaller_and_resumes(tmp_path: Path) -> None:
    """The same with torchtitan's trainer through ``with_registry``: its dp_shard degree is -1
    (torchtitan sizes it by the world; the registry's layout is derived from the resolved degrees),
    its checkpoint manager reloads the newest step through the checkpoint-metadata group.

    A checkpoint every step and 3 steps, as the matrix's scenarios (tests/titan/matrix.py): the
    4-rank world is killed once it saved step 1, the restarted one trains steps 2 and 3 (the second
    after an update made with the reloaded optimizer state), and so does the reference."""
    from tests.titan.assets import make_assets
    from tests.titan.run import TitanRun

    started = time.monotonic()
    make_assets(tmp_path / "assets")
    steps = 3

    def job(dump: Path, out: Path) -> list[str]:
        # The dataloader's state is per data-parallel rank and torchtitan refuses to reshard it
        # ("dataloader resharding is not supported yet"): it starts afresh after a restart.
        # float32 parameters: FSDP's default bfloat16 compute runs the matmuls in bfloat16, which a
        # CPU without AVX512-BF16 does several times slower (2.5x the step time on CI's 2 cores);
        # the dtype is no part of what this test checks.
        run = TitanRun(dump_folder=str(dump), assets=str(tmp_path / "assets"), registry=True,
                       dp_shard=-1, spmd_backend="partial_dtensor", steps=steps,
                       checkpoint_interval=1, seq_len=128,
                       extra=("--checkpoint.exclude_from_loading", "dataloader",
                              "--comm.train_timeout_seconds", "30",
                              "--training.mixed_precision_param", "float32"))
        return [str(TITAN_JOB), "--out", str(out), "--", *run.args()]

    dump, out = tmp_path / "dump", tmp_path / "out"
    ref_dump, ref_out = tmp_path / "ref_dump", tmp_path / "ref_out"
    out.mkdir()
    ref_out.mkdir()
    marks: dict[str, float] = {}

    def ready() -> bool:
        if any(e["event"] == "saved" and e["world"] == 4 for e in _events(out, "titan-*.jsonl")):
            marks["kill"] = time.monotonic()
            return True
        return False

    def newest_checkpoint() -> Path | None:
        # torchtitan's rule (_find_load_step): the highest step-N holding DCP's .metadata.
        done = [p for p in (dump / "checkpoint").glob("step-*") if (p / ".metadata").is_file()]
        return max(done, key=lambda p: int(p.name.removeprefix("step-")), default=None)

    def reference_job(source: Path) -> list[str]:
        # A fresh 2-rank torchtitan job whose dump folder holds a copy of that checkpoint only.
        shutil.copytree(source, ref_dump / "checkpoint" / source.name)
        return job(ref_dump, ref_out)

    with _Reference(tmp_path / "ref.log") as reference:
        killed_at, finished_at = _lose_a_node(
            job(dump, out), tmp_path, ready, started + 900,
            lambda: reference.start(newest_checkpoint(), reference_job, lambda: marks["kill"]))
        events = _events(out, "titan-*.jsonl")
        final = {e["pid"] for e in events if e["event"] == "done"}
        mine = [e for e in events if e["pid"] in final]
        assert sorted(e["rank"] for e in mine if e["event"] == "done") == [0, 1]
        assert all(e["world"] == 2 and e["restart"] >= 1 for e in mine if e["event"] == "start")
        dims = [e["dims"] for e in mine if e["event"] == "registry"]
        assert [d["dp_shard"] for d in dims] == [2, 2], dims
        after = {(e["rank"], e["step"]): e["loss"] for e in mine if e["event"] == "loss"}
        resumed = min(s for _, s in after) - 1  # torchtitan loaded step-<resumed>
        saved4 = {e["step"] for e in events if e["event"] == "saved" and e["world"] == 4}
        assert resumed in saved4, (resumed, saved4)
        assert reference.checkpoint == dump / "checkpoint" / f"step-{resumed}", (
            reference.checkpoint, resumed)
        assert sorted({s for _, s in after}) == list(range(resumed + 1, steps + 1))
        assert len(after) == 2 * (steps - resumed) >= 4, after  # two steps at least, both ranks

        reference.wait(started + 1150)
    expected = {(e["rank"], e["step"]): e["loss"] for e in _events(ref_out, "titan-*.jsonl")
                if e["event"] == "loss"}
    assert after == expected
    print(f"[restart] torchtitan: resumed from step {resumed} on 2 ranks; kill -> done "
          f"{finished_at - killed_at:.1f}s; reference started {reference.after_kill_s:.1f}s after "
          f"the kill; whole test {time.monotonic() - started:.1f}s")
