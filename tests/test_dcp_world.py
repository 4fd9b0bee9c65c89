"""DCP save/load/async_save through the registry: every plan and metadata exchange on the checkpoint group.

Observed at the c10d op level: :class:`C10dRecorder` (a TorchDispatchMode) sees every
``torch.ops.c10d.*`` and ``torch.ops._c10d_functional.*`` op the calling thread dispatches, with the
ProcessGroup it runs on and its ``async_op`` (verified on torch 2.13: ``dist.gather_object`` and
friends reach ``c10d.gather_``/``scatter_``/``broadcast_``/``allgather_`` with a ScriptObject that
``ProcessGroup.unbox`` turns back into the group). async_save runs its exchange on a worker thread that
a dispatch mode cannot see, so it is observed through the groups' c10d sequence numbers instead.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_dcp.py``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups import CHECKPOINT_ROLE, GroupRegistry
from commgroups.demo.config import seed_layout
from commgroups.integrations import dcp as cg_dcp
from tests import torch_private
from tests.worlds import run_world

pytestmark = pytest.mark.world


WORLD = 4


_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


@dataclass(frozen=True)
class C10dOp:
    """One recorded c10d op: its name, the group's name and whether it was issued async."""

    name: str
    group_name: str | None
    async_op: bool | None


def _group_name(value: Any) -> str | None:
    if isinstance(value, dist.ProcessGroup):
        return value.group_name
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value).group_name
    return None


class C10dRecorder(torch_private.TorchDispatchMode):
    """Records the c10d ops dispatched on this thread while active (and runs them unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[C10dOp] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # wait_tensor and _wrap_tensor_autograd follow a functional collective already recorded and
        # move no data
        if (func.namespace in ("c10d", "_c10d_functional")
                and torch_private.op_name(func) not in _NOT_COLLECTIVES):
            names = [a.name for a in torch_private.op_schema(func).arguments]
            bound = dict(zip(names, args)) | kwargs
            group = None
            for value in bound.values():
                group = group or _group_name(value)
            if group is None and isinstance(bound.get("group_name"), str):
                group = bound["group_name"]  # functional collectives name their group
            if func.namespace == "_c10d_functional":
                is_async: bool | None = True  # always the async path (facts.md; torch >= 2.8)
            elif "async_op" in names:
                default = torch_private.op_schema(func).arguments[names.index("async_op")].default_value
                is_async = bool(bound.get("async_op", default))
            else:
                is_async = None  # send/recv: no async_op argument
            self.ops.append(C10dOp(str(func.overloadpacket.__name__), group, is_async))
        return func(*args, **kwargs)


def _seq(group: dist.ProcessGroup) -> int:
    return torch_private.sequence_number(group)


def _state(rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    # DCP treats a plain tensor under one key on every rank as replicated (rank 0 writes it), so each
    # rank's own values live under its own keys; "shared" is the replicated kind.
    return {
        f"w{rank}": torch.arange(6.0).reshape(2, 3) + rank + seed,
        f"b{rank}": torch.full((5,), (rank + seed) / 3),
        "shared": torch.linspace(0, 1, 7) + seed,
    }


def _dcp_world(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    default = torch_private.default_group()
    with GroupRegistry(seed_layout(world)) as registry:
        ckpt = registry.group(CHECKPOINT_ROLE)
        out["ckpt_group"], out["default_group"] = ckpt.group_name, default.group_name

        # save + load: record every c10d op
        saved = _state(rank)
        rec = C10dRecorder()
        with rec:
            cg_dcp.save(saved, checkpoint_id=os.path.join(root, "sync"), registry=registry)
        out["save_ops"] = rec.ops
        fresh = {k: torch.zeros_like(v) for k, v in saved.items()}
        rec = C10dRecorder()
        with rec:
            cg_dcp.load(fresh, checkpoint_id=os.path.join(root, "sync"), registry=registry)
        out["load_ops"] = rec.ops
        out["exact"] = all(torch.equal(saved[k], fresh[k]) for k in saved)

        # async_save: the exchange runs on DCP's thread; count ops per group instead
        before = (_seq(default), _seq(ckpt))
        future = cg_dcp.async_save(_state(rank, seed=10), checkpoint_id=os.path.join(root, "async"),
                                   registry=registry)
        if hasattr(future, "result"):
            future.result(timeout=60)
        else:  # AsyncSaveResponse on newer torch
            future.upload_completion.result(timeout=60)
        out["async_seq_delta"] = (_seq(default) - before[0], _seq(ckpt) - before[1])
        back = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
        cg_dcp.load(back, checkpoint_id=os.path.join(root, "async"), registry=registry)
        out["async_exact"] = all(torch.equal(back[k], v) for k, v in _state(rank, seed=10).items())

        # the staged roll-out switch, set here in the worker only
        os.environ[cg_dcp.DEFAULT_GROUP_ENV] = "1"
        try:
            rec = C10dRecorder()
            with rec:
                cg_dcp.save(_state(rank), checkpoint_id=os.path.join(root, "fallback"),
                            registry=registry)
            out["fallback_ops"] = rec.ops
            os.environ[cg_dcp.DEFAULT_GROUP_ENV] = "maybe"
            try:
                cg_dcp.save(_state(rank), checkpoint_id=os.path.join(root, "x"), registry=registry)
                out["bad_switch"] = None
            except ValueError as error:
                out["bad_switch"] = str(error)
        finally:
            del os.environ[cg_dcp.DEFAULT_GROUP_ENV]

        try:
            cg_dcp.save(_state(rank), checkpoint_id=os.path.join(root, "y"), registry=registry,
                        process_group=ckpt)
            out["both"] = None
        except ValueError as error:
            out["both"] = str(error)
    return out


@pytest.fixture(scope="module")
def dcp_results() -> list[dict[str, Any]]:
    """One 4-rank gloo world runs every DCP check; the tests below read its results."""
    with tempfile.TemporaryDirectory() as root:
        return run_world(_dcp_world, WORLD, root, timeout=180)


def test_save_and_load_run_every_op_on_the_checkpoint_group(dcp_results: list[dict[str, Any]]) -> None:
    for out in dcp_results:
        assert out["ckpt_group"] != out["default_group"]
        for key in ("save_ops", "load_ops"):
            ops = out[key]
            assert ops, f"{key}: no c10d op recorded; the recorder is blind"
            assert {op.group_name for op in ops} == {out["ckpt_group"]}, ops
        # the object collectives DCP's plan exchange is made of
        assert {"gather_", "scatter_", "broadcast_"} <= {op.name for op in out["save_ops"]}


def test_state_round_trips_exactly(dcp_results: list[dict[str, Any]]) -> None:
    assert all(out["exact"] for out in dcp_results)


def test_async_save_uses_the_checkpoint_group_and_round_trips(
    dcp_results: list[dict[str, Any]],
) -> None:
    for out in dcp_results:
        default_delta, ckpt_delta = out["async_seq_delta"]
        assert default_delta == 0 and ckpt_delta > 0, out["async_seq_delta"]
        assert out["async_exact"]


def test_fallback_switch_uses_the_default_group(dcp_results: list[dict[str, Any]]) -> None:
    for out in dcp_results:
        ops = out["fallback_ops"]
        assert ops and {op.group_name for op in ops} == {out["default_group"]}
        assert out["bad_switch"] is not None and cg_dcp.DEFAULT_GROUP_ENV in out["bad_switch"]


def test_registry_and_process_group_together_is_an_error(dcp_results: list[dict[str, Any]]) -> None:
    for out in dcp_results:
        assert out["both"] is not None and "only registry=" in out["both"]
