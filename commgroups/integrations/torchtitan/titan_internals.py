"""commgroups' one seam with torchtitan: every torchtitan import, private and copied signature.

The rest of :mod:`commgroups.integrations.torchtitan` reaches torchtitan only through this module
(``tests/test_titan_internals.py`` scans the package for any other torchtitan import or private
torchtitan attribute). Everything here was checked on each of :data:`CHECKED_VERSIONS`:

- ``0.3.0``: the PyPI release (the only one the ``torchtitan`` extra accepts, ``>=0.3,<0.4``),
  installed in CI's main and newest legs and run there (tests/test_torchtitan_*.py);
- ``main@b5bcd76``: pytorch/torchtitan's main branch at commit b5bcd76c (2026-08-21), read from a
  source checkout: the names, module locations and signatures below exist there with the same
  meaning. main removed the shim ``torchtitan.components.checkpoint`` (#4141), the ``full_dtensor``
  backend (#4217) and ``ParallelDims._spmd_meshes``; only canonical locations are imported here.

A change in any of these fails loudly (:class:`TitanSeamError`, on import or on first use), never
silently: a signature commgroups copies or replaces is compared with torchtitan's own.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torchtitan.distributed.utils as _dist_utils
import tyro
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.logging import logger as titan_logger
from torchtitan.tools.utils import GarbageCollection
from torchtitan.trainer import Trainer

from commgroups.errors import TitanSeamError  # defined there; importable from here as before

__all__ = [
    "CHECKED_VERSIONS",
    "CLI_HIDDEN",
    "DCP_LOAD_PARAMETERS",
    "DCP_SAVE_PARAMETERS",
    "FULL_DTENSOR",
    "FULL_DTENSOR_MODULE",
    "MODEL",
    "SET_PG_TIMEOUTS_PARAMETERS",
    "SPMD_BACKENDS",
    "AsyncMode",
    "CheckpointManager",
    "GarbageCollection",
    "ParallelDims",
    "TitanSeamError",
    "Trainer",
    "fill_meshes",
    "has_full_dtensor",
    "log_mesh_building",
    "log_meshes_built",
    "replaced_set_pg_timeouts",
    "require_parameters",
    "set_spmd_meshes",
    "shipped_train_source",
    "single_axis_meshes",
    "spmd_backends",
    "titan_logger",
    "validate_meshes",
]

CHECKED_VERSIONS = ("0.3.0", "main@b5bcd76")
"""torchtitan versions every name here was checked on (see the module docs)."""

CLI_HIDDEN: Any = tyro.conf.Suppress
"""tyro's marker for a config field torchtitan's command line does not offer (0.3.0, main@b5bcd76:
torchtitan parses configs with tyro)."""

SPMD_BACKENDS = ("partial_dtensor", "spmd_types")
"""The ``parallelism.spmd_backend`` values every checked torchtitan has (0.3.0 and main@b5bcd76);
:func:`spmd_backends` adds ``full_dtensor`` where the installed torchtitan has it."""

FULL_DTENSOR = "full_dtensor"
"""0.3.0's third ``parallelism.spmd_backend`` (every parameter, buffer and input a DTensor on the
dense mesh); main removed it (#4217)."""

FULL_DTENSOR_MODULE = "torchtitan.distributed.full_dtensor"
"""The module that implements :data:`FULL_DTENSOR` (``resolve_fsdp_mesh``, ``parallelize_inputs``):
in 0.3.0, gone on main@b5bcd76 together with the option."""


def has_full_dtensor() -> bool:
    """Whether the installed torchtitan has the ``full_dtensor`` backend: its module
    (:data:`FULL_DTENSOR_MODULE`) imports. True on 0.3.0, False on main@b5bcd76 (#4217 removed the
    module and the option together, so the module stands for both)."""
    try:
        importlib.import_module(FULL_DTENSOR_MODULE)
    except ImportError:
        return False
    return True


def spmd_backends() -> tuple[str, ...]:
    """The ``parallelism.spmd_backend`` values commgroups builds meshes for with the installed
    torchtitan: :data:`SPMD_BACKENDS`, plus :data:`FULL_DTENSOR` where :func:`has_full_dtensor`
    (0.3.0: all three; main@b5bcd76: two)."""
    return (*SPMD_BACKENDS, FULL_DTENSOR) if has_full_dtensor() else SPMD_BACKENDS


DCP_SAVE_PARAMETERS = ("self", "state_dict", "checkpoint_id", "async_mode",
                       "enable_garbage_collection", "to_hf")
"""``CheckpointManager.dcp_save``'s parameters, copied by RegistryCheckpointManager (0.3.0 and
main@b5bcd76)."""

DCP_LOAD_PARAMETERS = ("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized")
"""``CheckpointManager.dcp_load``'s parameters, copied by RegistryCheckpointManager (0.3.0 and
main@b5bcd76)."""

SET_PG_TIMEOUTS_PARAMETERS = ("timeout", "parallel_dims")
"""``torchtitan.distributed.utils.set_pg_timeouts``'s parameters, which RegistryTrainer's
replacement takes (0.3.0 and main@b5bcd76)."""


def require_parameters(function: Callable[..., Any], expected: Sequence[str], what: str) -> None:
    """Raise :class:`TitanSeamError` unless ``function`` takes exactly ``expected`` parameters.

    Checked on 0.3.0 and main@b5bcd76 for the three signatures commgroups copies
    (:data:`DCP_SAVE_PARAMETERS`, :data:`DCP_LOAD_PARAMETERS`, :data:`SET_PG_TIMEOUTS_PARAMETERS`).

    Args:
        function: torchtitan's function or method.
        expected: its parameter names, in order, as commgroups copies them.
        what: the name to show, e.g. ``"torchtitan.distributed.utils.set_pg_timeouts"``.

    Example::

        require_parameters(CheckpointManager.dcp_load, DCP_LOAD_PARAMETERS,
                           "CheckpointManager.dcp_load")
    """
    found = tuple(inspect.signature(function).parameters)
    if found != tuple(expected):
        raise TitanSeamError(
            f"{what} takes {found} in this torchtitan, but commgroups copies {tuple(expected)} "
            f"(checked on torchtitan {', '.join(CHECKED_VERSIONS)}); fix: update "
            "commgroups/integrations/torchtitan/titan_internals.py and the code using it"
        )


def shipped_train_source() -> str | None:
    """``Trainer.train``'s source as torchtitan ships it, read from the file of the module that
    defines ``Trainer`` (``torchtitan.trainer`` on 0.3.0 and main@b5bcd76).

    Not ``inspect.getsource(Trainer.train)``: a job may have replaced ``Trainer.train`` with its own
    wrapper (a profiler, a counter, without ``functools.wraps``), and the seam checks torchtitan's
    code, not the job's. "" where that module defines no ``Trainer.train`` (a seam change); None
    where no source is shipped (then the signature check is all there is).
    """
    module = sys.modules.get(Trainer.__module__)
    try:
        source = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        source = None
    if source is None:
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == Trainer.__name__:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "train":
                    return ast.get_source_segment(source, item) or ""
    return ""


@contextlib.contextmanager
def replaced_set_pg_timeouts(replacement: Callable[..., None]) -> Iterator[None]:
    """Stand ``replacement`` in for torchtitan's ``set_pg_timeouts`` while the block runs.

    torchtitan's ``Trainer.train`` calls ``dist_utils.set_pg_timeouts(timeout=..., parallel_dims=...)``
    after the first step (0.3.0 and main@b5bcd76), looking the module attribute up at call time, and
    offers no hook; its body barriers on the default group. The replacement takes the same
    parameters. Refused with :class:`TitanSeamError` when torchtitan's signature changed or its
    ``Trainer.train`` as shipped (:func:`shipped_train_source`; a job's wrapper around it does not
    count) no longer calls it through the module (the replacement would silently not run).
    """
    original = _dist_utils.set_pg_timeouts
    require_parameters(original, SET_PG_TIMEOUTS_PARAMETERS,
                       "torchtitan.distributed.utils.set_pg_timeouts")
    source = shipped_train_source()
    if source is not None and "dist_utils.set_pg_timeouts(" not in source:
        raise TitanSeamError(
            "torchtitan's Trainer.train no longer calls dist_utils.set_pg_timeouts (checked on "
            f"torchtitan {', '.join(CHECKED_VERSIONS)}), so commgroups cannot replace its "
            "default-group barrier; fix: update commgroups/integrations/torchtitan/titan_internals.py"
        )
    _dist_utils.set_pg_timeouts = replacement
    try:
        yield
    finally:
        _dist_utils.set_pg_timeouts = original


def fill_meshes(parallel_dims: ParallelDims, *, world: DeviceMesh,
                global_meshes: Mapping[str, DeviceMesh],
                single_axis: Mapping[str, DeviceMesh]) -> None:
    """Set what stock ``ParallelDims.build_mesh()`` sets, from meshes commgroups built, before it
    looks any mesh up.

    ``_world_mesh``, ``_global_meshes`` and ``_single_axis_meshes`` (0.3.0 and main@b5bcd76: every
    lookup reads them); the ``_multi_axis_meshes`` lookup cache (0.3.0 and main) is emptied (it
    caches slices of the meshes above). :func:`set_spmd_meshes` sets the rest.
    """
    parallel_dims._world_mesh = world
    parallel_dims._global_meshes = dict(global_meshes)
    parallel_dims._single_axis_meshes = dict(single_axis)
    if "_multi_axis_meshes" in {f.name for f in fields(ParallelDims)}:
        parallel_dims._multi_axis_meshes = {}


def set_spmd_meshes(parallel_dims: ParallelDims, spmd_meshes: Sequence[DeviceMesh]) -> None:
    """``_spmd_meshes``, where ParallelDims declares it (0.3.0; main@b5bcd76 removed it): the activated
    dense and sparse meshes, set last, as stock does.

    The lookup cache stays: the meshes are the objects ``get_activated_mesh`` cached, so
    ``resolve_mesh``'s ``mesh in spmd_meshes()`` (full_dtensor) finds them by identity, as stock's.
    """
    if "_spmd_meshes" in {f.name for f in fields(ParallelDims)}:
        parallel_dims._spmd_meshes = list(spmd_meshes)


def validate_meshes(parallel_dims: ParallelDims) -> None:
    """torchtitan's own size check of the meshes (``ParallelDims._validate_meshes``; 0.3.0 and
    main@b5bcd76)."""
    parallel_dims._validate_meshes()


def single_axis_meshes(parallel_dims: ParallelDims) -> dict[str, DeviceMesh]:
    """Every 1-D mesh torchtitan holds, by name, size-1 ones included (``_single_axis_meshes``;
    0.3.0 and main@b5bcd76)."""
    return dict(parallel_dims._single_axis_meshes)


def log_mesh_building(parallel_dims: ParallelDims) -> None:
    """torchtitan's log line at the start of ``build_mesh`` (same text on 0.3.0 and main@b5bcd76)."""
    pd = parallel_dims
    titan_logger.info(
        f"Building device mesh with parallelism: pp={pd.pp}, dp_replicate={pd.dp_replicate}, "
        f"dp_shard={pd.dp_shard}, cp={pd.cp}, tp={pd.tp}, ep={pd.ep}"
    )


def log_meshes_built(parallel_dims: ParallelDims) -> None:
    """torchtitan's log line at the end of ``build_mesh`` (same text on 0.3.0 and main@b5bcd76)."""
    titan_logger.info(
        "Successfully created meshes with active dimensions: "
        f"{list(parallel_dims.get_all_one_dimensional_meshes().keys())}"
    )
