"""Start the demo: in this process's world, under torchrun, or on processes it spawns itself.

Without torchrun the launcher starts ``world_size`` CPU processes on gloo through
:func:`commgroups.util.local_world.run_local_world` (forkserver ranks, parent-owned TCPStore, a deadline),
printing the lines rank 0 says: a rank that fails or hangs ends the run with an error, never a hang.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commgroups.util.local_world import Post, run_local_world

from .config import DemoConfig
from .report import render, write_json

__all__ = ["launch", "under_torchrun"]

_PRELOAD = ("torch", "torch.distributed", "commgroups.demo.train")
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


def _demo_rank(rank: int, world_size: int, post: Post, cfg: DemoConfig) -> dict[str, Any] | None:
    from .train import run_rank

    result = run_rank(cfg, say=post)
    return result if rank == 0 else None


def _spawn(cfg: DemoConfig) -> int:
    if not cfg.quiet:
        _print(f"[demo] starting {cfg.world_size} processes (gloo, CPU)")
    reports = run_local_world(
        _demo_rank, cfg.world_size, cfg, timeout_s=cfg.timeout_s, init_timeout_s=cfg.timeout_s,
        preload=_PRELOAD, on_message=None if cfg.quiet else _print, grace_s=_GRACE_S,
    )
    errors = {rank: report.traceback for rank, report in reports.items() if not report.ok}
    missing = [r for r in range(cfg.world_size) if r not in reports]
    if errors or missing:
        for rank, text in sorted(errors.items()):
            print(f"commgroups demo: rank {rank} failed:\n{text}", file=sys.stderr)
        if missing:
            print(f"commgroups demo: ranks {missing} did not finish within {cfg.timeout_s:g}s "
                  "(crashed, or stopped after another rank failed)", file=sys.stderr)
        return 1
    result = reports[0].value
    _finish(cfg, result, _print)
    return 0 if result["checkpoint_roundtrip"] == "exact" else 1
