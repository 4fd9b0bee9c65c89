"""The tests' one place for private torch: every private attribute a test reads, calls or patches.

commgroups reaches private torch through :mod:`commgroups.torch_internals` only; the tests do the same
through this module (``tests/test_torch_internals.py`` scans ``tests/`` too, string forms included,
and fails on any other use). Where ``torch_internals`` already has the function it is reused, so a
test checks the code path commgroups runs. The rest serves tests alone: c10d's group tables, the
fake backend, flattening, private op and patch targets.

Checked versions: run on 2.13.0 (CPU) here; each function is called by tests that every CI leg runs
(2.10.0, 2.13.0, 2.15.0) unless its docstring names fewer. Targets for ``monkeypatch.setattr`` are
``(owner, name)`` pairs, so no test spells a private torch name.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from commgroups.torch_internals import (
    TorchDispatchMode,
    default_group,
    default_store,
    flatten_mesh,
    group_sequence_number,
    import_fake_backend,
    op_schema,
)

__all__ = [
    "TorchDispatchMode",
    "abort_target",
    "available_device_type_target",
    "coalescing_manager",
    "cp_custom_ops",
    "default_group",
    "default_store",
    "fake_store",
    "fake_world_options",
    "flatten",
    "flatten_mapping",
    "flex_validate_device_target",
    "flight_recorder_dump",
    "functional_collectives",
    "future_class",
    "group_names",
    "group_sequence_number",
    "live_groups",
    "merges_reductions_by_layout",
    "op_name",
    "op_schema",
    "options_timeout",
    "premul_sum",
    "replaced",
    "sequence_number",
    "set_pg_timeout",
]

Target = tuple[Any, str]
"""An ``(owner, attribute name)`` pair: ``monkeypatch.setattr(*target, value)``."""


# ------------------------------------------------------------------------- c10d's group tables
def flight_recorder_dump() -> bytes | None:
    """torch's generic flight recorder as the pickle NCCL's watchdog writes per rank on a timeout
    (``_dump_fr_trace``, from 2.8; None where this torch lacks it; gloo records into it from
    2.13). Run on 2.13.0."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    try:
        return None if dump is None else bytes(dump(includeStackTraces=False))
    except (RuntimeError, TypeError, ValueError):  # a recorder that is off or fails to dump
        return None


def live_groups() -> tuple[dist.ProcessGroup, ...]:
    """Every group c10d holds on this rank, default group included (``_world.pg_map``'s keys)."""
    return tuple(c10d._world.pg_map)


def group_names() -> dict[dist.ProcessGroup, str]:
    """A copy of c10d's group -> name table on this rank (``_world.pg_names``)."""
    return dict(c10d._world.pg_names)


def sequence_number(group: dist.ProcessGroup) -> int:
    """How many collectives ``group`` ran on this rank (gloo counts them all); raises if unknown.

    :func:`commgroups.torch_internals.group_sequence_number`, which answers None where the backend
    keeps no count (fake, Python groups): a test that asks must get a number.
    """
    number = group_sequence_number(group)
    if number is None:
        raise RuntimeError(f"{group} keeps no sequence number; fix: ask a gloo or NCCL group")
    return number


def options_timeout(group: dist.ProcessGroup, device: str = "cpu") -> timedelta:
    """The timeout held by ``group``'s backend for ``device`` (``_get_backend(device).options._timeout``)."""
    backend: Any = group._get_backend(torch.device(device))
    timeout: timedelta = backend.options._timeout
    return timeout


def set_pg_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """``distributed_c10d._set_pg_timeout``: the only setter on torch 2.10 and 2.13.

    Called directly (not through :func:`commgroups.torch_internals.set_group_timeout`): a test
    shim installed as ``dist.set_timeout`` calls this, and the internals would call the shim back.
    """
    c10d._set_pg_timeout(timeout, group)


def abort_target() -> Target:
    """Where ``commgroups.torch_internals.abort_group`` finds c10d's ``_abort_process_group``
    (it looks it up at call time, so a patch there is seen)."""
    return c10d, "_abort_process_group"


# --------------------------------------------------------------------------------- fake worlds
def fake_store() -> type[Any]:
    """Register torch's "fake" backend and return its FakeStore
    (:func:`commgroups.torch_internals.import_fake_backend`)."""
    return import_fake_backend()


def fake_world_options(*, error_on_collective: bool = False) -> Any:
    """``FakeProcessGroup.Options()`` for ``init_process_group("fake", pg_options=...)``.

    ``error_on_collective=True``: any collective on the group raises (an aliasing detector).
    """
    import_fake_backend()
    c10d_c: Any = torch._C._distributed_c10d  # its stubs lag the bindings
    options = c10d_c.FakeProcessGroup.Options()
    options.error_on_collective = error_on_collective
    return options


# ---------------------------------------------------------------------------------- DeviceMesh
def flatten(mesh: Any, name: str | None = None) -> Any:
    """``mesh._flatten(name)``; without ``name``, torch's default (the dims' names joined by ``_``)."""
    return mesh._flatten() if name is None else flatten_mesh(mesh, name)


def flatten_mapping(mesh: Any) -> dict[str, Any]:
    """The root mesh's registered flattenings, name -> 1-D mesh (``_flatten_mapping``: what
    DTensor's layout lookup reads)."""
    mapping: dict[str, Any] = mesh._flatten_mapping
    return mapping


def merges_reductions_by_layout() -> bool:
    """Whether DTensor merges reductions over several dims onto a flattening it finds by layout:
    ``_redistribute._get_flattened_mesh_by_layout`` exists (2.13, 2.15; absent on 2.10)."""
    module = importlib.import_module("torch.distributed.tensor._redistribute")
    return hasattr(module, "_get_flattened_mesh_by_layout")


# -------------------------------------------------------------------------- collectives and ops
def functional_collectives() -> ModuleType:
    """``torch.distributed._functional_collectives`` (the Python wrappers DTensor calls)."""
    return importlib.import_module("torch.distributed._functional_collectives")


def cp_custom_ops() -> ModuleType:
    """Import context parallel's custom ops module (registers the ``cplib`` ops) and return it.

    ``torch.distributed.tensor.experimental._context_parallel._cp_custom_ops``: 2.13 and 2.15.
    """
    return importlib.import_module(
        "torch.distributed.tensor.experimental._context_parallel._cp_custom_ops")


def coalescing_manager(**kwargs: Any) -> contextlib.AbstractContextManager[Any]:
    """``dist._coalescing_manager(group=..., device=..., async_ops=...)``."""
    manager: contextlib.AbstractContextManager[Any] = dist._coalescing_manager(**kwargs)
    return manager


def premul_sum(factor: float) -> Any:
    """``dist._make_nccl_premul_sum(factor)``: the ReduceOp that multiplies by ``factor`` first."""
    return dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]


def future_class() -> type[Any]:
    """``torch._C.Future``: what coalesced collectives return instead of a Work."""
    future: type[Any] = torch._C.Future
    return future


def op_name(func: Any) -> str:
    """An ``OpOverload``'s op name without namespace or overload (``OpOverload._opname``)."""
    return str(func._opname)


# ------------------------------------------------------------------------- patch targets (CPU)
def flex_validate_device_target() -> Target:
    """FlexAttention's device check, which refuses the (differentiable) eager backward on CPU
    (``torch.nn.attention.flex_attention._validate_device``)."""
    import torch.nn.attention.flex_attention as flex

    return flex, "_validate_device"


def available_device_type_target() -> Target:
    """``torch._utils._get_available_device_type``: what torchtitan binds its device type from."""
    import torch._utils as torch_utils

    return torch_utils, "_get_available_device_type"


@contextlib.contextmanager
def replaced(target: Target, value: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Stand ``value`` in for ``target`` while the block runs; yields the original."""
    owner, name = target
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)
