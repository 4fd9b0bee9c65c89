"""Teardown: repeated create/close cycles leak no process groups, threads or file descriptors."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world

CYCLES = 100


def _resources() -> tuple[int, int, int]:
    """Once this rank's liveness threads ended: ``close()`` waits for nobody, and a rank that
    closes first has its listener woken by the last member's close (its connection goes with
    it), so they end a moment later; a leak never ends."""
    deadline = time.monotonic() + 5.0
    while (any(thread.name.startswith("commgroups-") for thread in threading.enumerate())
           and time.monotonic() < deadline):
        time.sleep(0.01)
    left = [thread.name for thread in threading.enumerate() if thread.name.startswith("commgroups-")]
    if left:  # said where a thread outlived the wait: the assertion below names no thread
        print(f"threads still running after 5 s: {left}", flush=True)
    return (
        len(torch_private.live_groups()),
        threading.active_count(),
        len(os.listdir("/proc/self/fd")),
    )


def _cycles(rank: int, world_size: int) -> dict[str, Any]:
    layout = cg.Layout(dims={"dp_shard": 1, "cp": world_size})
    samples: list[tuple[int, int, int]] = []
    before = _resources()
    for cycle in range(CYCLES):
        with cg.GroupRegistry(layout) as registry:
            value = torch.ones(1)
            dist.all_reduce(value, group=registry.group("cp"))
            assert value.item() == world_size
            registry.device_mesh(["dp_shard", "cp"])  # the mesh's extra dp_shard group too
        if cycle in (9, CYCLES - 1):
            samples.append(_resources())
    return {"before": before, "after_10": samples[0], "after_all": samples[1]}


def test_hundred_create_close_cycles_leak_nothing() -> None:
    results = run_world(_cycles, 2, timeout=280)
    for result in results:
        groups_before, threads_before, _ = result["before"]
        _, threads_10, fds_10 = result["after_10"]
        groups_all, threads_all, fds_all = result["after_all"]
        assert groups_all == groups_before, "process groups leaked"
        assert threads_all <= max(threads_before, threads_10), "threads leaked"
        # fds: gloo may keep a handful of cached sockets; they must not grow with the cycle count
        assert fds_all - fds_10 <= 2, f"file descriptors grew from {fds_10} to {fds_all}"


def _use_after_close(rank: int, world_size: int) -> list[str]:
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": world_size})).create()
    registry.close()
    registry.close()
    messages = []
    for call in (lambda: registry.group("cp"), lambda: registry.ranks("cp"),
                 lambda: registry.device_mesh("cp"), registry.create):
        try:
            call()
            messages.append("no error")
        except cg.errors.RegistryClosedError as error:
            messages.append(str(error))
    return messages


def test_use_after_close_says_so() -> None:
    for messages in run_world(_use_after_close, 2):
        assert all("closed" in m for m in messages), messages
