"""Start the demo: in this process's world, under torchrun, or on processes it spawns itself.

Without torchrun the launcher starts ``world_size`` CPU processes on gloo (forked from a forkserver
that imported torch once), owns their TCPStore, relays rank 0's progress, and enforces a deadline: a
rank that fails or hangs ends the run with an error, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

from .config import DemoConfig
from .report import render, write_json

__all__ = ["launch", "under_torchrun"]

_PRELOAD = ["torch", "torch.distributed", "commgroups.demo.train"]
_GRACE_S = 3.0  # how long the other ranks get to report after one rank failed


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun (or another env:// launcher) started this process."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or all(
        key in env for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    )


def _print(line: str) -> None:
    print(line, flush=True)


def _finish(cfg: DemoConfig, result: dict[str, Any], out: Callable[[str], None]) -> None:
    out("")
    out(render(result))
    if cfg.json_path:
        write_json(result, cfg.json_path)
        out(f"\nwrote {cfg.json_path}")


def run_in_world(cfg: DemoConfig, out: Callable[[str], None] = _print) -> dict[str, Any]:
    """Run the demo in the already-initialized world; rank 0 prints the report and writes the JSON."""
    from .train import run_rank

    result = run_rank(cfg, say=out)
    if dist.get_rank() == 0:
        _finish(cfg, result, out)
    return result


def launch(cfg: DemoConfig) -> int:
    """Run the demo and return the exit status (0: ran and the checkpoint round trip was exact)."""
    if dist.is_available() and dist.is_initialized():
        result = run_in_world(cfg)
    elif under_torchrun():
        dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.timeout_s))
        try:
            result = run_in_world(cfg)
        finally:
            dist.destroy_process_group()
    else:
        return _spawn(cfg)
    return 0 if result["checkpoint_roundtrip"] == "exact" else 1


def _child(cfg: DemoConfig, rank: int, port: int, messages: Any) -> None:
    try:
        torch_timeout = timedelta(seconds=cfg.timeout_s)
        store = TCPStore("127.0.0.1", port, cfg.world_size, is_master=False,
                              timeout=torch_timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size,
                                timeout=torch_timeout)
        try:
            from .train import run_rank

            result = run_rank(cfg, say=lambda line: messages.put(("say", rank, line)))
        finally:
            dist.destroy_process_group()
        messages.put(("done", rank, result if rank == 0 else None))
    except BaseException:  # report everything to the parent, which decides the exit status
        messages.put(("error", rank, traceback.format_exc()))
        sys.exit(1)


def _spawn(cfg: DemoConfig) -> int:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    server = TCPStore("127.0.0.1", 0, cfg.world_size, is_master=True,
                           timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
    messages = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(cfg, rank, server.port, messages), daemon=True)
             for rank in range(cfg.world_size)]
    if not cfg.quiet:
        _print(f"[demo] starting {cfg.world_size} processes (gloo, CPU)")
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while len(done) + len(errors) < cfg.world_size:
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                kind, rank, payload = messages.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} without a report"
                continue
            if kind == "say":
                if not cfg.quiet:
                    _print(payload)
            elif kind == "done":
                done[rank] = payload
            else:
                errors[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=1.0 if errors else 10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        del server
    missing = [r for r in range(cfg.world_size) if r not in done and r not in errors]
    if errors or missing:
        for rank, text in sorted(errors.items()):
            print(f"commgroups demo: rank {rank} failed:\n{text}", file=sys.stderr)
        if missing:
            print(f"commgroups demo: ranks {missing} did not finish within {cfg.timeout_s:g}s "
                  "(stopped)", file=sys.stderr)
        return 1
    result = done[0]
    _finish(cfg, result, _print)
    return 0 if result["checkpoint_roundtrip"] == "exact" else 1
