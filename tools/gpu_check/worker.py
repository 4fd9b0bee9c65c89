"""One part of the GPU check in its own process: ``python -m tools.gpu_check.worker PART``.

The orchestrator runs every part this way so that a hang (an NCCL call that never returns) or a
crash costs that part alone: it is killed at its timeout and the others still report. The part's
answer goes to ``--result`` as ``{"part", "data", "error", "seconds"}``; the exit code is 0 when the
part ran (its data may still hold per-case errors) or was skipped (:class:`PartSkipped`: its error
reads ``skipped: <reason>``) and 1 when it raised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.gpu_check.skip import PartSkipped

__all__ = ["PARTS", "PartSkipped", "main", "run_part"]

PARTS: tuple[str, ...] = ("machine", "streams", "async_wait_cost", "memory", "creation",
                          "nccl_backends", "megatron", "gloo_creation")


def run_part(part: str, *, smoke: bool, trial: str | None = None,
             methods: Sequence[str] | None = None, backend: str | None = None) -> dict[str, Any]:
    """Collect one part in this process and return its data (raises on failure)."""
    if part == "machine":
        from tools.gpu_check.machine import machine_info

        return machine_info()
    if part == "streams":
        from tools.gpu_check.streams import collect_streams

        return collect_streams(smoke)
    if part == "async_wait_cost":
        from tools.gpu_check.async_wait_cost import collect_async_wait_cost

        return collect_async_wait_cost(smoke)
    if part == "memory":
        from tools.gpu_check.memory_probe import collect_memory_trial

        if trial is None:
            raise ValueError("the memory part needs --trial NAME")
        return collect_memory_trial(trial, smoke)
    if part == "creation":
        from tools.gpu_check.creation_time import METHODS, collect_creation

        return collect_creation(smoke, tuple(methods) if methods else METHODS)
    if part == "nccl_backends":
        from tools.gpu_check.nccl_backends import collect_nccl_backend

        if backend is None:
            raise ValueError("the nccl_backends part needs --backend NAME")
        return collect_nccl_backend(backend, smoke)
    if part == "megatron":
        from tools.gpu_check.megatron_model import collect_megatron

        return collect_megatron(smoke)
    if part == "gloo_creation":
        from tools.gpu_check.gloo_creation import collect_gloo_creation

        return collect_gloo_creation(smoke)
    raise ValueError(f"unknown part {part!r}; one of {', '.join(PARTS)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one part and write its result file."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check.worker")
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--result", required=True, help="where to write the part's JSON")
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU, no GPU figures")
    parser.add_argument("--trial", help="memory trial name")
    parser.add_argument("--methods", help="creation methods, separated by commas")
    parser.add_argument("--backend", help="nccl_backends: the torch backend name (nccl, ...)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result: dict[str, Any] = {"part": args.part, "data": None, "error": None}
    try:
        methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
        result["data"] = run_part(args.part, smoke=args.smoke, trial=args.trial, methods=methods,
                                  backend=args.backend)
    except PartSkipped as skip:
        result["data"] = {"ran": False, "skipped": str(skip)}
        result["error"] = f"skipped: {skip}"
    except Exception as error:  # the answer says what failed; the orchestrator carries on
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
    result["seconds"] = round(time.perf_counter() - start, 2)
    Path(args.result).write_text(json.dumps(result, default=str))
    skipped = str(result["error"]).startswith("skipped: ")
    return 0 if result["error"] is None or skipped else 1


if __name__ == "__main__":
    sys.exit(main())
