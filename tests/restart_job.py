"""A training job for restart mode, run by torchrun (tests/test_restart.py starts it).

Each worker: init the default group (gloo), build a GroupRegistry from an auto layout (its "auto" dim
sized by this world), FSDP2 on the registry's roles, AdamW; resume from the newest complete DCP
checkpoint under ``--ckpt`` (or from ``--load``), loaded through the checkpoint-metadata group and
resharded to this world; train to ``--steps``, saving every ``--save-every`` steps through the same
group. Every event is one JSON line in ``--out``/events-<restart>-<rank>-<pid>.jsonl (loss per step,
checkpoints saved, what was loaded, the resolved dims), so the test reads what happened without
parsing logs.

Not a test module (no ``test_`` prefix); it is a script: ``python tests/restart_job.py --help``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

CKPT_PREFIX = "step-"


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a worker with its torchrun agent: a lost
    node takes its workers; an agent with the test that started it)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_worker(work: Callable[[], None]) -> NoReturn:
    """Run ``work`` as a torchrun worker: die with the agent, and on any failure report and leave at
    once (a peer died; gloo's threads must not hold the exit up; the agent restarts the workers)."""
    _die_with_parent()
    try:
        work()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (DCP writes ``.metadata`` last)."""
    from commgroups.integrations.dcp import checkpoint_complete

    done = [p for p in root.glob(f"{CKPT_PREFIX}*") if checkpoint_complete(p)]
    return max(done, key=lambda p: int(p.name[len(CKPT_PREFIX):]), default=None)


def _events(args: argparse.Namespace, rank: int, restart: int) -> Any:
    path = Path(args.out) / f"events-{restart}-{rank}-{os.getpid()}.jsonl"

    def emit(**event: Any) -> None:
        event.update(rank=rank, restart=restart, pid=os.getpid(), t=time.time())
        with path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    return emit


def train(args: argparse.Namespace) -> None:
    """One worker's run; see the module docs."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import commgroups as cg
    from commgroups.demo.model import ModelConfig, TinyTransformer
    from commgroups.demo.train import batch_tokens
    from commgroups.integrations import dcp
    from commgroups.integrations.fsdp import fully_shard_on_role

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    emit = _events(args, rank, restart)
    emit(event="start", world=world, group_rank=os.environ.get("GROUP_RANK"))

    layout = cg.load_layout(args.layout)  # an AutoLayout: the registry sizes it by this world
    registry = cg.GroupRegistry(layout, create_timeout_s=args.timeout_s).create()
    emit(event="registry", dims=dict(registry.layout.dims), roles=list(registry.layout.role_names))

    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig(max_seq=args.seq))
    replicate = "dp_replicate" if "dp_replicate" in registry.layout.role_names else None
    for block in model.blocks:
        fully_shard_on_role(block, registry, replicate=replicate)
    fully_shard_on_role(model, registry, replicate=replicate)
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)

    start = 0
    source = Path(args.load) if args.load else latest_checkpoint(Path(args.ckpt))
    if source is not None:
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        began = time.monotonic()
        dcp.load(state, checkpoint_id=source, registry=registry)  # resharded to this world
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(source.name[len(CKPT_PREFIX):]) + 1
        emit(event="loaded", path=str(source), step=start - 1,
             seconds=time.monotonic() - began)

    # The data-parallel position: which slice of the batch this rank reads.
    for step in range(start, args.steps):
        tokens = batch_tokens(step, rank, args.batch, args.seq, 64)
        logits = model(tokens[:, :args.seq])
        loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()
        emit(event="loss", step=step, loss=float(loss.detach()), world=world)
        if (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            model_state, optim_state = get_state_dict(model, optim)
            path = Path(args.ckpt) / f"{CKPT_PREFIX}{step:04d}"
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path,
                     registry=registry)
            emit(event="saved", step=step, path=str(path), world=world)
        if restart == 0:  # slow the first attempt down so that a node can be lost mid-training
            time.sleep(args.step_sleep)
    emit(event="done", world=world)
    registry.close()
    dist.destroy_process_group()


def main() -> None:
    """Parse the arguments and train; any failure exits at once with status 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", required=True)
    parser.add_argument("--ckpt", required=True, help="checkpoint root (step-NNNN directories)")
    parser.add_argument("--out", required=True, help="directory for the JSON-lines events")
    parser.add_argument("--load", help="start from this checkpoint instead of the newest one")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep after each step of the first attempt")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    run_worker(lambda: train(args))


if __name__ == "__main__":
    main()
