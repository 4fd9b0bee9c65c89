"""A rank that dies of an unhandled exception, as a training script's step raises, in a world of
plain processes (tests/test_crash_report_world.py starts them; the test hosts the store).

Every rank: the default group (gloo) over the test's store, a registry (heartbeat on: its host's
relay), every listener on the relay, a store barrier; then the crashing rank raises at the top
level (Python prints it and exits through its hooks) while the others stay idle and write, as
JSON in ``OUT``/rank-<r>.json, whether and how soon after the raise they heard the loss.

Not a test module (no ``test_`` prefix); it is a script run by the test.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported

import commgroups as cg
from tests.worlds import relay_rank

HEARD_WITHIN_S = 8.0  # the beat's backstop would report after 10 s at the earliest


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), world, False,
                     timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    registry = cg.GroupRegistry(cg.Layout(dims={"dp_shard": world}), create_timeout_s=60).create()
    live = registry._recovery.liveness
    assert live is not None
    relay = relay_rank(registry, rank, world)  # every listener on the relay, then a barrier
    crashing = relay if os.environ["CRASH"] == "relay" else max(set(range(world)) - {relay})
    if rank == crashing:
        store.set("crash/at", repr(time.time()))
        raise RuntimeError(f"rank {rank}: a step failed")  # Python's top level prints it
    deadline = time.monotonic() + HEARD_WITHIN_S
    while not live.heard(0) and time.monotonic() < deadline:
        time.sleep(0.005)
    heard_at = time.time()
    crashed_at = float(store.get("crash/at"))
    Path(os.environ["OUT"], f"rank-{rank}.json").write_text(json.dumps({
        "heard": live.heard(0), "after_s": heard_at - crashed_at, "crashing": crashing,
        "relay": relay}))
    registry.close()


if __name__ == "__main__":
    main()
