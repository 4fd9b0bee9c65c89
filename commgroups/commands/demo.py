"""``commgroups demo``: train a small transformer through the registry's groups and audit it."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from commgroups.demo.config import BASELINES, DemoConfig
from commgroups.errors import ArgumentError, LayoutError
from commgroups.layout.limits import check_timeout

__all__ = ["register", "run"]

MAX_LOCAL_WORLD = 64
"""The most ranks the demo starts on this machine (one process each) outside torchrun."""

MAX_STEPS = 100_000
"""The most training steps a demo run takes."""


def register(subparsers: Any) -> None:
    """Add the ``demo`` sub-command."""
    parser = subparsers.add_parser(
        "demo",
        help="the main job: FSDP2 + cp (spmd_types) + DCP on the registry's groups, audited",
        description=(
            "Train a small transformer for a few steps on CPU/gloo: FSDP2 on the fsdp role, the "
            "sequence sharded over cp with K/V gathered through spmd_types on the registry's cp group, "
            "the audit on; then a DCP save through the checkpoint-metadata group, a load into a fresh "
            "model and an exact comparison. Spawns its own processes unless run under torchrun "
            "(torchrun --nproc-per-node N -m commgroups demo)."
        ),
    )
    parser.add_argument("-n", "--world-size", type=int, default=None,
                        help="processes to start (default: the layout's world size, else 4; "
                             "under torchrun: torchrun's)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--layout", default=None,
                        help="layout file (default: the seed's, dp_shard=1 and cp=world size)")
    parser.add_argument("--baseline", choices=BASELINES, default=None,
                        help="run on plain init_device_mesh groups instead, to see what the audit "
                             "finds there")
    parser.add_argument("--json", dest="json_path", metavar="FILE", default=None,
                        help="write the result as JSON to FILE")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where DCP writes (default: a temporary directory, removed after)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a stuck run is stopped (default 300)")
    parser.add_argument("--no-audit", action="store_true", help="do not record collectives")
    parser.add_argument("--kill-rank", type=int, default=None, metavar="R",
                        help="rank loss instead: HSDP (dp_replicate x dp_shard, FSDP2) where rank R "
                             "exits mid-step; the survivors rebuild every role in place "
                             "(registry.rebuild()) and carry on from memory. Prints what was lost, "
                             "rebuilt and each phase's time. The layout (--layout) needs an "
                             "[elastic] section; default: dp_shard=2, replicas may shrink to 1")
    parser.add_argument("--kill-step", type=int, default=1, metavar="S",
                        help="with --kill-rank: the step during which rank R exits (default 1)")
    parser.add_argument("--role-timeout", type=float, default=3.0, metavar="SECONDS",
                        help="with --kill-rank and the default layout: every role's collective "
                             "timeout, i.e. how long a survivor waits for the lost rank (default 3)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the report")
    parser.set_defaults(run=run)


def _world_size(args: argparse.Namespace) -> int:
    import os

    from commgroups.demo.launch import under_torchrun
    from commgroups.layout.layout_io import load_layout
    from commgroups.layout.specs import Layout

    loaded = load_layout(args.layout) if args.layout else None
    # An auto layout (restart mode) fits any world its fixed dims divide: demo_layout resolves it.
    layout_world = loaded.world_size if isinstance(loaded, Layout) else None
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world):
            raise SystemExit(f"commgroups demo: --world-size {args.world_size} but torchrun started "
                             f"{world} processes; fix: drop --world-size under torchrun")
    else:
        # "is not None": --world-size 0 is an error, not the default
        world = args.world_size if args.world_size is not None else (layout_world or 4)
    if layout_world is not None and layout_world != world:
        raise SystemExit(f"commgroups demo: the layout {args.layout} describes {layout_world} ranks "
                         f"but the run has {world}; fix: make them agree")
    if world < 1 or (world > MAX_LOCAL_WORLD and not under_torchrun()):
        raise ArgumentError(
            f"--world-size: {world} is outside 1..{MAX_LOCAL_WORLD} (one process per rank on this "
            "machine); fix: use a smaller world, or launch with torchrun across machines",
            field="--world-size",
        )
    return world


def _run_rank_loss(args: argparse.Namespace, timeout_s: float) -> int:
    """``--kill-rank``: the in-place rebuild demo (commgroups.demo.elastic)."""
    from commgroups.demo.elastic import elastic_layout, run_elastic_demo
    from commgroups.demo.launch import under_torchrun
    from commgroups.layout.layout_io import load_layout

    if under_torchrun() or args.baseline:
        raise SystemExit("commgroups demo: --kill-rank spawns its own processes (the launcher hosts "
                         "the store, so any rank may die) and runs on the registry only; fix: run "
                         "it without torchrun and without --baseline")
    world = _world_size(args)
    role_timeout = check_timeout(args.role_timeout, "--role-timeout")
    layout = (load_layout(args.layout, world_size=world) if args.layout
              else elastic_layout(world, role_timeout))
    if layout.elastic is None:
        raise LayoutError(f"--layout: {args.layout} has no [elastic] section, so no dim may shrink "
                          "after a rank loss; fix: add one (see examples/layouts/hsdp_elastic.toml)",
                          field="elastic")
    if not 0 <= args.kill_rank < world:
        raise ArgumentError(f"--kill-rank: {args.kill_rank} is outside 0..{world - 1}; fix: name a "
                          "rank of the world", field="--kill-rank")
    if not 0 <= args.kill_step < args.steps:
        raise ArgumentError(f"--kill-step: {args.kill_step} is outside 0..{args.steps - 1} (the "
                          "run's steps); fix: lose the rank during a step that runs",
                          field="--kill-step")
    return run_elastic_demo(layout, args.steps, args.kill_rank, args.kill_step, timeout_s,
                            quiet=args.quiet)


def run(args: argparse.Namespace) -> int:
    """Run the demo as the parsed ``args`` ask."""
    from commgroups.demo.groups import demo_layout
    from commgroups.demo.launch import launch

    if not 1 <= args.steps <= MAX_STEPS:
        raise ArgumentError(f"--steps: {args.steps} is outside 1..{MAX_STEPS}; fix: a demo run needs "
                          "a few steps (default 5)", field="--steps")
    timeout_s = check_timeout(args.timeout, "--timeout")
    if args.kill_rank is not None:
        return _run_rank_loss(args, timeout_s)
    # The demo gathers K/V over cp with spmd_types (an extra): say so once, before any rank starts.
    if importlib.util.find_spec("spmd_types") is None:
        raise SystemExit("commgroups demo: needs spmd_types (its cp collectives are what the demo "
                         "shows); fix: pip install 'commgroups[spmd]'")
    cfg = DemoConfig(
        world_size=_world_size(args),
        steps=args.steps,
        layout_path=args.layout,
        baseline=args.baseline,
        json_path=args.json_path,
        checkpoint_dir=args.checkpoint_dir,
        timeout_s=timeout_s,
        audit=not args.no_audit,
        quiet=args.quiet,
    )
    # Refuse a layout the demo cannot run before any process starts: one clear error, not one per rank.
    demo_layout(cfg)
    return launch(cfg)
