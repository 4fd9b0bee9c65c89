"""Command line of the GPU check: ``run``, ``analyze`` and ``check-wheels``.

::

    python -m tools.gpu_check run                  # on a CUDA machine; results to
                                                   # benchmarks/results/gpu/ (--also-out DIR: a copy)
    python -m tools.gpu_check run --cpu-smoke --out out/gpu-smoke   # plumbing, gloo on CPU
    python -m tools.gpu_check analyze benchmarks/results/gpu        # re-derive the report
    python -m tools.gpu_check check-wheels .gpu-wheels              # what the wheels need
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["DEFAULT_OUT", "SMOKE_OUT", "main"]

DEFAULT_OUT = "benchmarks/results/gpu"
SMOKE_OUT = "out/gpu-smoke"


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _run(args: argparse.Namespace) -> int:
    from tools.gpu_check.orchestrate import run_check

    if not args.cpu_smoke and not _cuda_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing "
              "measured. Run it on a GPU machine, or use --cpu-smoke to test the plumbing.")
        return 0
    out = args.out or (SMOKE_OUT if args.cpu_smoke else DEFAULT_OUT)
    also = args.also_out or None
    parts = [p.strip() for p in args.parts.split(",")] if args.parts else None
    run_check(out, smoke=args.cpu_smoke, budget_s=args.budget_s, also_out=also, parts=parts)
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from tools.gpu_check.outputs import load_and_write

    for path in load_and_write(args.directory):
        print(path)
    return 0


def _check_wheels(args: argparse.Namespace) -> int:
    from tools.gpu_check.wheels import check_wheels

    problems = check_wheels(args.directory, provided=args.provided.split(","))
    for line in problems:
        print(f"gpu-wheels: {line}")
    if not problems:
        print(f"gpu-wheels: {args.directory}: every requirement is met, one version of each")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check",
                                     description="commgroups GPU check")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure (needs CUDA unless --cpu-smoke)")
    run.add_argument("--out", help=f"output folder (default {DEFAULT_OUT}; smoke: {SMOKE_OUT})")
    run.add_argument("--also-out", help="copy the (flat) result files into this folder too")
    run.add_argument("--cpu-smoke", action="store_true",
                     help="run every part's plumbing with gloo on the CPU (no GPU figures)")
    run.add_argument("--budget-s", type=float, default=480.0,
                     help="wall-clock budget for the whole check (default 480)")
    run.add_argument("--parts", help="only these parts, separated by commas (machine, streams, "
                     "async_wait_cost, memory, creation, megatron, pytest)")
    run.set_defaults(func=_run)
    analyze = sub.add_parser("analyze", help="re-derive report/analysis/memory.json from a folder")
    analyze.add_argument("directory")
    analyze.set_defaults(func=_analyze)
    wheels = sub.add_parser("check-wheels", help="check a wheel folder's Requires-Dist")
    wheels.add_argument("directory")
    wheels.add_argument("--provided", default="",
                        help="distributions the target machine already has, separated by commas")
    wheels.set_defaults(func=_check_wheels)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
