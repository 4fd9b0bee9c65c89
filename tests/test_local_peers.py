"""commgroups.rank_loss.local_peers: a process's death read from /proc by a peer on its host, on real
child processes (alive, stopped, a zombie, reaped); never a live process taken for dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commgroups.rank_loss.local_peers import ProcessId, gone, host_key, parse_peers, this_process

pytestmark = [pytest.mark.world,  # starts processes
              pytest.mark.skipif(this_process() is None, reason="no /proc: not Linux")]


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _id(pid: int) -> ProcessId:
    me = this_process()
    assert me is not None
    text = Path(f"/proc/{pid}/stat").read_text()
    return ProcessId(host=me.host, pid=pid, start=int(text.rpartition(")")[2].split()[19]))


def test_a_live_or_stopped_process_is_never_gone() -> None:
    me = this_process()
    assert me is not None and me.pid == os.getpid()
    assert not gone(me.pid, me.start)
    child = _child()
    try:
        known = _id(child.pid)
        assert not gone(known.pid, known.start)
        child.send_signal(signal.SIGSTOP)  # frozen: alive, judged by dead_after_s, never here
        time.sleep(0.1)
        assert not gone(known.pid, known.start)
        child.send_signal(signal.SIGCONT)
    finally:
        child.kill()
        child.wait()


def test_a_killed_process_is_gone_as_a_zombie_and_once_reaped() -> None:
    child = _child()
    known = _id(child.pid)
    child.kill()
    deadline = time.monotonic() + 10
    while not gone(known.pid, known.start):  # a zombie until waited for: its launcher's job
        assert time.monotonic() < deadline, "a SIGKILLed child never read as gone"
        time.sleep(0.01)
    child.wait()
    assert gone(known.pid, known.start)


def test_a_pid_now_another_process_is_gone() -> None:
    me = this_process()
    assert me is not None
    assert gone(me.pid, me.start + 1)  # same pid, another start time: the pid was reused


def test_entries_round_trip_and_hosts_key_by_kernel_not_name() -> None:
    a = ProcessId(host="boot-a/pid:[1]", pid=10, start=5)
    b = ProcessId(host="boot-a/pid:[1]", pid=11, start=6)
    assert parse_peers(a.entry(3) + b.entry(4) + "garbage;") == {3: (10, 5), 4: (11, 6)}
    assert parse_peers(a.entry(3) + b.entry(3)) == {3: (11, 6)}  # the last entry of a rank wins
    assert host_key(a.host) == host_key(b.host)
    assert host_key("boot-a/pid:[1]") != host_key("boot-b/pid:[1]")  # same name, other machine
    assert host_key("boot-a/pid:[1]") != host_key("boot-a/pid:[2]")  # another container's pids


def test_proc_that_cannot_be_read_now_says_nothing_is_gone() -> None:
    """Out of descriptors (EMFILE) or without permission, /proc says nothing: a live process must
    not read as ended (a confirmed death cuts the rank from the check-in at once)."""
    import resource

    me = this_process()
    assert me is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        while True:  # every free descriptor taken: the next open fails with EMFILE
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        assert not gone(me.pid, me.start)
    finally:
        for descriptor in held:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert gone(me.pid, me.start + 1)  # and a sure answer is still given once it can read
