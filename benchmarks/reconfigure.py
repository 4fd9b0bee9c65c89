"""torch 2.15's reconfigure against commgroups' rebuild: ``python benchmarks/reconfigure.py [--json FILE]``.

Needs torch >= 2.15 (``torch.distributed._reconfigure``); on an older torch it says so and exits 0.
Real gloo processes on this machine, every collective with a 600 s timeout, the last rank killed
(SIGKILL) while the others enter an all_reduce. Per repetition, three fresh worlds side by side:

- ``reconfigure``: ``init_process_group(enable_reconfigure=True)``; the survivor whose all_reduce
  fails first posts the loss to the store; a thread on every survivor (blocked in a store ``wait``)
  exchanges reconfigure handles with the other survivors and calls ``_reconfigure`` on the default
  group; the main thread's all_reduce is freed by that, then the reconfigured group carries one.
- ``sever+new_group``: commgroups' primitives on one group: the same notice, the thread severs the
  group's gloo sockets (``commgroups.creation.sockets``), the main thread makes a member-only
  ``new_group`` of the survivors and carries one all_reduce on it.
- ``rebuild(alive=)``: the whole project path, what ``benchmarks/rank_loss.py`` measures: an HSDP
  registry (every role 600 s, ``dp_replicate`` elastic), ``registry.rebuild(alive=survivors)``: every
  role and mesh made again, the old generation released.

A sample is kill -> the slowest survivor's first collective on the new group returned (correct sum).
Then one world answers the semantic questions: does ``_reconfigure`` work on a ``new_group`` and on a
group made without ``enable_reconfigure``, and what do torch's rank tables say after it, with a middle
rank lost. These machines are noisy: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVE_TIMEOUT = timedelta(seconds=600)
STORE_TIMEOUT = timedelta(seconds=60)
WORLD_DEADLINE_S = 180.0
"""A world still running after this has a collective that nothing freed (600 s would be the timeout)."""
MODES = ("reconfigure", "sever+new_group")
VARIANTS = (*MODES, "rebuild(alive=)")
_KILLED_AT = "bench-reconfigure/killed_at"
_LOST = "bench-reconfigure/lost"


def _client(port: int, world_size: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

    return TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=STORE_TIMEOUT)


def _exchange(store: Any, key: str, rank: int, value: str, ranks: list[int]) -> list[str]:
    store.set(f"{key}/{rank}", value)
    store.wait([f"{key}/{r}" for r in ranks], STORE_TIMEOUT)
    return [bytes(store.get(f"{key}/{r}")).decode() for r in ranks]


def kill_world(rank: int, world_size: int, _post: Any, port: int, mode: str) -> dict[str, Any]:
    """One rank of a ``reconfigure`` or ``sever+new_group`` world; the last rank dies."""
    import torch
    import torch.distributed as dist

    from commgroups import torch_internals
    from commgroups.creation import sockets as sever

    store = _client(port, world_size)
    everyone = list(range(world_size))
    victim = world_size - 1
    survivors = everyone[:-1]
    regime = mode == "reconfigure"
    before = sever.open_sockets()
    start = time.perf_counter()
    init = getattr(dist, "init_process_group")  # noqa: B009  (enable_reconfigure: 2.15's stubs)
    init("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
         **({"enable_reconfigure": True} if regime else {}))
    if regime:  # the communicator is built by the first reconfigure
        handles = _exchange(store, "h0", rank, torch_internals.reconfigure_handle(), everyone)
        torch_internals.reconfigure_group(None, uuid=1, handles=handles)
    sockets = sever.new_sockets(before, sever.open_sockets())  # the group's sockets, to sever
    setup_s = time.perf_counter() - start
    warm = torch.ones(1)
    dist.all_reduce(warm)
    result: dict[str, Any] = {"rank": rank, "setup_s": setup_s, "warm_sum": float(warm.item()),
                              "supports": torch_internals.supports_reconfigure()}
    _exchange(store, "ready", rank, "1", everyone)
    if rank == victim:
        store.set(_KILLED_AT, repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    ready = threading.Event()
    timings: dict[str, float] = {}

    def on_loss() -> None:  # the survivor's listener: woken by the store, wherever main is
        listener = _client(port, world_size)
        listener.wait([_LOST], COLLECTIVE_TIMEOUT)
        timings["noticed_at"] = time.time()
        if regime:
            handles = _exchange(listener, "h1", rank, torch_internals.reconfigure_handle(),
                                survivors)
            called = time.perf_counter()
            torch_internals.reconfigure_group(None, uuid=2, handles=handles,
                                              timeout=STORE_TIMEOUT)
            timings["op_s"] = time.perf_counter() - called
        else:
            timings["severed"] = float(sever.sever(sockets))
        timings["op_done_at"] = time.time()
        ready.set()

    thread = threading.Thread(target=on_loss, name="bench-listener", daemon=True)
    thread.start()
    blocked = torch.ones(1)
    try:
        dist.all_reduce(blocked)
        result["error"] = None  # would mean the dead rank took part: never expected
    except RuntimeError as error:
        result["error"] = str(error).split("\n")[0][:120]
    result["failed_at"] = time.time()
    store.set(_LOST, str(rank))
    if not ready.wait(STORE_TIMEOUT.total_seconds()):
        raise RuntimeError(f"rank {rank}: the loss was never handled")
    group = None
    if not regime:
        created = time.perf_counter()
        group = dist.new_group(survivors, timeout=COLLECTIVE_TIMEOUT,
                               use_local_synchronization=True)
        timings["op_s"] = time.perf_counter() - created
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    result["rebuilt_at"] = time.time()
    result["sum"] = float(total.item())
    result.update(timings)
    _exchange(store, "done", rank, "1", survivors)  # nobody tears down while a peer still reduces
    return result


def semantics_world(rank: int, world_size: int, _post: Any, port: int) -> dict[str, Any]:
    """(c): rank 1 dies; the survivors reconfigure a new_group made without the regime."""
    import torch
    import torch.distributed as dist

    from commgroups import torch_internals

    store = _client(port, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=STORE_TIMEOUT)  # no enable_reconfigure
    group = dist.new_group(list(range(world_size)), timeout=STORE_TIMEOUT)
    result: dict[str, Any] = {
        "rank": rank, "supports_default": torch_internals.supports_reconfigure(),
        "supports_new_group": torch_internals.supports_reconfigure(group)}
    _exchange(store, "ready", rank, "1", list(range(world_size)))
    lost = 1
    if rank == lost:
        os._exit(0)
    survivors = [r for r in range(world_size) if r != lost]
    handles = _exchange(store, "sub", rank, torch_internals.reconfigure_handle(group), survivors)
    try:
        torch_internals.reconfigure_group(group, uuid=11, handles=handles, timeout=STORE_TIMEOUT)
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        result.update(reconfigured=True, sum=float(value.item()), expected=float(sum(survivors)))
    except RuntimeError as error:
        result.update(reconfigured=False, error=str(error)[:200])
        return result
    result.update(group_rank=group.rank(), group_size=group.size(),
                  dist_get_rank=dist.get_rank(group),
                  group_ranks=list(dist.get_process_group_ranks(group)))
    root = survivors[-1]  # a survivor whose global rank is past the new size
    value = torch.tensor([float(rank)])
    try:
        dist.broadcast(value, src=root, group=group)
        result["broadcast_from_global"] = f"ok: {value.item():g}"
    except (RuntimeError, ValueError) as error:
        result["broadcast_from_global"] = f"{type(error).__name__}: {str(error)[:80]}"
    _exchange(store, "done", rank, "1", survivors)
    return result


def _serve(world_size: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                    timeout=STORE_TIMEOUT)


def _run_mode(mode: str, world_size: int) -> dict[str, Any]:
    from commgroups.util.local_world import run_local_world

    server = _serve(world_size)
    victim = world_size - 1
    started = time.monotonic()
    reports = run_local_world(kill_world, world_size, server.port, mode, backend=None,
                              timeout_s=WORLD_DEADLINE_S, grace_s=None)
    failed = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    missing = [r for r in range(victim) if r not in reports]
    if failed or missing:
        return {"variant": mode, "ok": False, "failed": failed, "missing": missing,
                "seconds": time.monotonic() - started}
    killed_at = float(bytes(server.get(_KILLED_AT)).decode())
    seen = [reports[r].value for r in range(victim)]
    bad = [s["rank"] for s in seen if s["sum"] != float(victim) or s["error"] is None]
    slowest = max(seen, key=lambda s: s["rebuilt_at"])
    return {
        "variant": mode, "ok": not bad, "wrong": bad,
        "kill_to_rebuilt": slowest["rebuilt_at"] - killed_at,
        "first_detection": min(s["failed_at"] for s in seen) - killed_at,
        "last_freed": max(s["failed_at"] for s in seen) - killed_at,
        # A collective blocked on live peers is freed by the group operation: how long after it.
        "freed_after_op": max(s["failed_at"] - s["op_done_at"] for s in seen),
        "op": max(s["op_s"] for s in seen),
        "setup": max(s["setup_s"] for s in seen),
        "supports": all(s["supports"] for s in seen),
        "errors": sorted({s["error"].split("]")[-1].strip()[:60] for s in seen}),
    }


def rebuild_world(rank: int, world_size: int, progress: Any, quiet: bool) -> dict[str, Any]:
    """One rank of ``benchmarks/rank_loss.py``'s kill world, ``rebuild(alive=)``."""
    from commgroups.bench import rank_loss

    if quiet:  # the survivors' flight-recorder diagnoses of the dead rank
        logging.getLogger("commgroups").setLevel(logging.ERROR)
    return rank_loss.measure_kill(rank, world_size, progress, "rebuild(alive=)")


def _run_rebuild(world_size: int, quiet: bool) -> dict[str, Any]:
    from commgroups.bench.world import WorldFailed, run_world

    try:
        values = run_world(rebuild_world, world_size, quiet,
                           timeout_s=WORLD_DEADLINE_S, lost=(world_size - 1,))
    except WorldFailed as error:
        return {"variant": "rebuild(alive=)", "ok": False, "failed": str(error)[-2000:]}
    sample = values[0]
    return {"variant": "rebuild(alive=)", "ok": True, "kill_to_rebuilt": sample["kill_to_rebuilt"],
            "first_detection": sample["first_detection"], "detection": sample["detection"],
            "op": sample["rebuild_phases"]["create"], "phases": sample["rebuild_phases"]}


def _semantics(world_size: int) -> dict[str, Any]:
    from commgroups.util.local_world import run_local_world

    server = _serve(world_size)
    reports = run_local_world(semantics_world, world_size, server.port, backend=None,
                              timeout_s=WORLD_DEADLINE_S, grace_s=None)
    return {str(r): (rep.value if rep.ok else {"traceback": rep.traceback})
            for r, rep in sorted(reports.items())}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _table(samples: list[dict[str, Any]], repetitions: int) -> tuple[str, dict[str, Any]]:
    rows = [("kill -> rebuilt (s)", "kill_to_rebuilt"), ("group op (s)", "op"),
            ("kill -> last collective freed (s)", "last_freed")]
    heads = ["variant", "figure", *[f"rep {i + 1}" for i in range(repetitions)], "median",
             "x reconfigure"]
    lines = [heads]
    summary: dict[str, Any] = {}
    base = _median([s["kill_to_rebuilt"] for s in samples
                    if s["variant"] == "reconfigure" and s["ok"]])
    base_op = _median([s["op"] for s in samples if s["variant"] == "reconfigure" and s["ok"]])
    for variant in VARIANTS:
        mine = [s for s in samples if s["variant"] == variant]
        for label, key in rows:
            values = [s.get(key) if s["ok"] else None for s in mine]
            good = [v for v in values if isinstance(v, float)]
            if not good:
                continue
            median = _median(good)
            against = base if key == "kill_to_rebuilt" else base_op if key == "op" else None
            ratio = f"{median / against:.1f}" if against and key != "last_freed" else ""
            lines.append([variant, label, *[f"{v:.3f}" if isinstance(v, float) else "failed"
                                            for v in values], f"{median:.3f}", ratio])
            summary[f"{variant}:{key}_median_s"] = median
    widths = [max(len(line[i]) for line in lines) for i in range(len(heads))]
    text = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     for line in lines)
    return text, summary


def main(argv: list[str]) -> int:
    """Measure, print the table and the answers; ``--json`` also writes every sample."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3, metavar="N")
    parser.add_argument("--world-size", type=int, default=4, metavar="N",
                        help="even, at least 4 (the rebuild variant's HSDP layout)")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--verbose", action="store_true", help="torch's and commgroups' logs")
    args = parser.parse_args(argv)
    if args.world_size < 4 or args.world_size % 2:
        parser.error("--world-size must be even and at least 4")
    sys.path.insert(0, str(ROOT))  # the source tree's commgroups when it is not installed
    if not args.verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads, ranks inherit
        logging.basicConfig(level=logging.ERROR)
    import torch

    from commgroups import torch_internals

    if not torch_internals.has_reconfigure():
        message = (f"torch {torch.__version__} has no torch.distributed._reconfigure (torch 2.15's "
                   "private fault-tolerance API): nothing to measure; run this with torch >= 2.15")
        print(message, file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": message}) + "\n", encoding="utf-8")
        return 0

    samples: list[dict[str, Any]] = []
    for repetition in range(args.repetitions):
        for variant in VARIANTS:
            sample = (_run_rebuild(args.world_size, not args.verbose) if variant == "rebuild(alive=)"
                      else _run_mode(variant, args.world_size))
            sample["repetition"] = repetition + 1
            samples.append(sample)
            if not sample["ok"]:
                print(f"repetition {repetition + 1}, {variant}: FAILED\n{sample}", file=sys.stderr)
    semantics = _semantics(args.world_size)
    text, summary = _table(samples, args.repetitions)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo x{args.world_size}, last rank "
          f"SIGKILLed, every collective at {COLLECTIVE_TIMEOUT.total_seconds():g} s, "
          f"{args.repetitions} fresh worlds per variant\n")
    print(text)
    freed = [s for s in samples if s["variant"] == "reconfigure" and s["ok"]]
    print("\n(a) _reconfigure frees a collective blocked on the dead peer: "
          + ("yes" if freed and all(s["last_freed"] < 60 for s in freed) else "NO")
          + (f"; the slowest survivor's raised {max(s['freed_after_op'] for s in freed) * 1e3:.0f}"
             " ms after its reconfigure finished" if freed else ""))
    print("(c) a new_group made without enable_reconfigure, rank 1 of "
          f"{args.world_size} lost, reconfigured onto the survivors:")
    for rank, seen in semantics.items():
        print(f"  rank {rank}: {json.dumps(seen)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"torch": torch.__version__, "cpus": os.cpu_count(), "world_size": args.world_size,
             "repetitions": args.repetitions, "summary": summary, "samples": samples,
             "semantics": semantics}, indent=1) + "\n", encoding="utf-8")
    ok = all(s["ok"] for s in samples)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
