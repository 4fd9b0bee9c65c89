"""torchtitan through ``with_registry`` as a torchrun restart-mode job (tests/test_restart.py).

Each worker: init the default group (gloo), apply the CPU patches (tests/titan/cpu.py), parse the
torchtitan command line after ``--`` as ``python -m torchtitan.train`` does, build the trainer (its
registry is derived from torchtitan's degrees, so ``--parallelism.data_parallel_shard_degree -1``
follows the world), and train. torchtitan's checkpoint manager (commgroups' RegistryCheckpointManager)
loads the newest checkpoint under the dump folder through the registry's checkpoint-metadata group at
start, resharded by DCP. Events go to ``--out``/titan-<restart>-<rank>-<pid>.jsonl: start (world),
loss (step, global average loss), saved (step), done.

Not a test module; a script for torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.restart_job import run_worker


def train(out: Path, titan_args: list[str]) -> None:
    """One worker's torchtitan run; see the module docs."""
    import torch.distributed as dist

    from tests.titan.cpu import apply_cpu_patches, force_sum_reduction

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    path = out / f"titan-{restart}-{rank}-{os.getpid()}.jsonl"

    def emit(**event: Any) -> None:
        event.update(rank=rank, restart=restart, pid=os.getpid(), world=world, t=time.time())
        with path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    emit(event="start")
    apply_cpu_patches()
    from torchtitan.config import ConfigManager

    trainer = ConfigManager().parse_args(titan_args).build()
    force_sum_reduction(trainer.model_parts)
    emit(event="registry", dims=dict(trainer.registry.layout.dims))
    log = trainer.metrics_processor.log

    def logged(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        emit(event="loss", step=step, loss=float(global_avg_loss))
        log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = logged
    save = trainer.checkpointer.dcp_save

    def saved(*args: Any, **kwargs: Any) -> Any:
        result = save(*args, **kwargs)
        emit(event="saved", step=trainer.step)
        return result

    trainer.checkpointer.dcp_save = saved
    trainer.train()
    emit(event="done")
    trainer.close()


def main() -> None:
    """``titan_restart_job.py --out DIR -- <torchtitan arguments>``; failures exit 1 at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("titan_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    titan_args = args.titan_args[1:] if args.titan_args[:1] == ["--"] else args.titan_args
    run_worker(lambda: train(Path(args.out), titan_args))


if __name__ == "__main__":
    main()
