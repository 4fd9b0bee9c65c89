"""NCCL's c10d classes: every attribute of them commgroups reads, and where.

torch 2.15 makes ``ProcessGroupNCCL2`` the default for ``backend="nccl"`` (``nccl-legacy``, or
``TORCH_DIST_USE_NCCL2=0`` set before torch.distributed is imported, selects ``ProcessGroupNCCL``);
2.14 added it as ``nccl2``. It is another class, not a subclass: it lacks ``comm_split_count``,
``_set_default_timeout``, ``_is_initialized``, ``NCCLConfig`` and more. Both take the same
``ProcessGroupNCCL.Options`` (torch's ``_nccl2_options`` asserts it, 2.14.1 and 2.15.0). torch's own
creator of ProcessGroupNCCL2 sets the group's ``bound_device_id`` when ``device_id=`` was not given
(``_nccl2_device``, 2.15.0 source), so commgroups sees every 2.15 NCCL world as device-bound, as
torch's own split decision does.

:data:`NCCL_ATTRIBUTES` lists each attribute commgroups reads on an NCCL backend, its Options or
its config, with the function here that reads it (the only place that does) and what commgroups
does on a class without it. :data:`NOT_USED` names what ``ProcessGroupNCCL2`` lacks that commgroups
never reads, and why it need not. ``tests/data/nccl_class_attrs.json`` holds ``dir()`` of the real
classes of each checked CUDA build (``tools/capture_nccl_attrs.py`` rewrites it from the running
torch); ``tests/test_nccl_classes.py`` fails when a recorded class lacks a listed attribute that
has no fallback, and compares the file with the live classes on every CI leg that has them.

Checked versions: dir() read in the 2.10.0, 2.14.1 and 2.15.0 CUDA wheels (PyPI builds, imported on
a CPU machine; 2.13.0 CPU has no NCCL class); nothing here was run on a GPU.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "NCCL_ATTRIBUTES",
    "NCCL_BACKEND_CLASSES",
    "NOT_USED",
    "RECORDED_CLASSES",
    "NcclAttribute",
    "backend_options_copy",
    "backend_supports_shrinking",
    "group_backend",
    "nccl_backend_class",
    "nccl_class_attributes",
    "nccl_comm_split_count",
    "nccl_options",
    "set_options_timeout",
]

logger = logging.getLogger(__name__)

NCCL_BACKEND_CLASSES: tuple[str, ...] = ("ProcessGroupNCCL", "ProcessGroupNCCL2",
                                         "ProcessGroupNCCLLazy")
"""The NCCL backend classes of ``torch._C._distributed_c10d`` (``ProcessGroupNCCL2`` and
``ProcessGroupNCCLLazy`` from 2.14 on, ``nccl2`` / ``nccl-lazy``)."""

RECORDED_CLASSES: tuple[str, ...] = (
    "ProcessGroup", "Backend", *NCCL_BACKEND_CLASSES,
    "ProcessGroupNCCL.Options", "ProcessGroupNCCL2.Options", "ProcessGroupNCCLLazy.Options",
    "ProcessGroupNCCL.NCCLConfig",
)
"""What :func:`nccl_class_attributes` reads, as dotted paths under ``torch._C._distributed_c10d``
(``ProcessGroupNCCL.NCCLConfig`` is the type of ``Options().config``)."""


@dataclass(frozen=True)
class NcclAttribute:
    """One attribute commgroups reads on an NCCL class (private or not)."""

    owner: str
    """``backend`` (a group's NCCL backend: every class of :data:`NCCL_BACKEND_CLASSES`),
    ``group`` (``ProcessGroup``), ``options`` (``ProcessGroupNCCL.Options``, which every NCCL
    backend takes) or ``config`` (its ``config``: ``ProcessGroupNCCL.NCCLConfig``)."""
    name: str
    read_by: str
    """The function of :mod:`commgroups.torch_internals` that reads it (the only reader)."""
    callers: str
    """Where commgroups reaches that function."""
    if_missing: str
    """What commgroups does on a class without it (a fallback or a refusal naming it)."""


_CONFIG_MISSING = ("refused: nccl_options raises BackendUnavailableError naming the field and the "
                   "torch version (the role's options.nccl asks for it)")

NCCL_ATTRIBUTES: tuple[NcclAttribute, ...] = (
    NcclAttribute("group", "_get_backend", "group_backend",
                  "backend_supports_shrinking, backend_options_copy, nccl_comm_split_count",
                  "fallback: the group counts as having no backend for the device (None)"),
    NcclAttribute("backend", "supports_shrinking", "backend_supports_shrinking",
                  "backends/nccl.py shrink_blocker (rebuild's shrink path)",
                  "fallback: unknown (None); shrink_blocker refuses to shrink, saying torch "
                  "cannot tell"),
    NcclAttribute("backend", "options", "backend_options_copy",
                  "commgroups/creation/shrink.py (options of the shrunk spine)",
                  "fallback: None (shrink_group gets no pg_options: torch copies them itself)"),
    NcclAttribute("backend", "comm_split_count", "nccl_comm_split_count",
                  "tools/gpu_check/memory_probe.py (evidence of ncclCommSplit)",
                  "fallback: None, logged naming the class and torch version: ProcessGroupNCCL2 "
                  "and ProcessGroupNCCLLazy (torch 2.14.1, 2.15.0) have no comm_split_count"),
    NcclAttribute("options", "is_high_priority_stream", "nccl_options",
                  "backends/nccl.py make_options; tools/gpu_check", _CONFIG_MISSING),
    NcclAttribute("options", "config", "nccl_options",
                  "backends/nccl.py make_options; tools/gpu_check", _CONFIG_MISSING),
    NcclAttribute("options", "_timeout", "set_options_timeout",
                  "backends/nccl.py make_options, backends/hccl.py",
                  "none needed: every recorded Options has it (c10d overwrites it from new_group's "
                  "timeout= anyway)"),
    *(NcclAttribute("config", field, "nccl_options", "backends/nccl.py make_options (options.nccl."
                    f"{field}); tools/gpu_check (split_share)", _CONFIG_MISSING)
      for field in ("cga_cluster_size", "min_ctas", "max_ctas", "net_name", "split_share",
                    "blocking")),
)
"""Every NCCL-class attribute commgroups reads. Not listed, because torch reads them itself inside
public calls commgroups makes (``split_group``, ``shrink_group``, ``set_timeout``,
``_abort_process_group``) and dispatches per class there (read in the 2.15.0 source):
``perform_nocolor_split``, ``split``, ``supports_splitting``, ``set_timeout``, ``abort``."""

NOT_USED: Mapping[str, str] = {
    "_set_default_timeout": "commgroups sets timeouts with torch.distributed.set_timeout (2.14+), "
                            "which calls the C++ setTimeout that ProcessGroupNCCL2 overrides (a "
                            "symbol of libtorch_cuda 2.14.1 and 2.15.0); 2.10 and 2.13 have no "
                            "ProcessGroupNCCL2",
    "_is_initialized": "never read: commgroups brings a group up with a collective or torch's "
                       "eager init (device_id), never asks the communicator",
    "NCCLConfig": "never read as a class: commgroups reaches the config through "
                  "Options().config, and ProcessGroupNCCL2 takes the same Options class",
    "NCCL_CTA_POLICY_DEFAULT": "commgroups has no cta_policy option",
    "NCCL_CTA_POLICY_EFFICIENCY": "commgroups has no cta_policy option",
    "NCCL_CTA_POLICY_ZERO": "commgroups has no cta_policy option",
    "_group_start": "commgroups groups no NCCL calls by hand (coalescing is torch's own)",
    "_group_end": "commgroups groups no NCCL calls by hand (coalescing is torch's own)",
    "_set_enable_nan_check": "commgroups never toggles NaN checks (TORCH_NCCL_NAN_CHECK is the "
                             "user's)",
    "get_build_nccl_version": "commgroups reads torch.cuda.nccl.version() (backends/nccl.py, "
                              "tools/gpu_check), not the class",
    "get_runtime_nccl_version": "commgroups reads torch.cuda.nccl.version(), not the class",
    "uid": "never read (torch's own _get_process_group_uid checks the class first)",
    "_start_time_estimate": "never read (torch's estimate API)",
    "_end_time_estimate": "never read (torch's estimate API)",
    "_comm_ptr": "never read",
    "register_mem_pool": "never read (symmetric memory is torch's)",
    "deregister_mem_pool": "never read (symmetric memory is torch's)",
}
"""Attributes ``ProcessGroupNCCL`` has on some checked torch and ProcessGroupNCCL2 or
ProcessGroupNCCLLazy of the same torch lacks, none of which commgroups reads, each with why it need
not (``comm_split_count``, which it reads, has its fallback in :data:`NCCL_ATTRIBUTES` instead)."""


# ------------------------------------------------------------------------------ the classes
def _c10d_module() -> Any:
    c10d_c: Any = torch._C._distributed_c10d  # its stubs lag the bindings across versions
    return c10d_c


def nccl_class_attributes() -> dict[str, list[str] | None]:
    """``dir()`` of each class of :data:`RECORDED_CLASSES` on the running torch, dunders left out.

    None for a class this torch lacks (every NCCL class on a CPU build; ``ProcessGroupNCCL2`` before
    2.14). Read from ``torch._C._distributed_c10d`` (private; present on 2.10, 2.13, 2.14.1, 2.15.0).
    """
    module = _c10d_module()
    found: dict[str, list[str] | None] = {}
    for path in RECORDED_CLASSES:
        value: Any = module
        for part in path.split("."):
            value = getattr(value, part, None)
        found[path] = (None if not isinstance(value, type) else
                       sorted(n for n in dir(value) if not (n.startswith("__") and n.endswith("__"))))
    return found


def nccl_options_classes_alike() -> dict[str, bool | None]:
    """For each NCCL backend class: whether its ``Options`` is ``ProcessGroupNCCL.Options``.

    True for ``ProcessGroupNCCL2`` on 2.14.1 and 2.15.0 (what commgroups' options rely on); None
    where the class is missing. Read as :func:`nccl_class_attributes` reads.
    """
    module = _c10d_module()
    legacy = getattr(getattr(module, "ProcessGroupNCCL", None), "Options", None)
    alike: dict[str, bool | None] = {}
    for name in NCCL_BACKEND_CLASSES:
        cls = getattr(module, name, None)
        alike[name] = None if cls is None or legacy is None else getattr(cls, "Options", None) is legacy
    return alike


def group_backend(group: dist.ProcessGroup, device: torch.device) -> Any:
    """``group``'s backend object for ``device`` (ProcessGroupNCCL, ProcessGroupNCCL2, gloo, ...).

    ``ProcessGroup._get_backend(device)``: private, on 2.10, 2.13, 2.14.1, 2.15.0 (what torch's own
    split_group and shrink_group read). Raises RuntimeError where the group has no backend for it.
    """
    getter: Any = group._get_backend
    return getter(device)


def nccl_backend_class(group: dist.ProcessGroup, device: torch.device | None = None) -> str | None:
    """The class name of ``group``'s backend on ``device`` (default cuda), e.g. ``ProcessGroupNCCL2``.

    Through :func:`group_backend` (2.10, 2.13, 2.14.1, 2.15.0); None where there is none.
    For messages and the GPU check's report: which NCCL a job really got.
    """
    try:
        backend = group_backend(group, device or torch.device("cuda"))
    except Exception:  # no backend for the device: nothing to name
        return None
    return type(backend).__name__


def backend_supports_shrinking(group: dist.ProcessGroup, device: torch.device) -> bool | None:
    """Whether ``group``'s backend for ``device`` can shrink to its survivors (``shrink_group``).

    Reads it where torch's own ``shrink_group`` does: :func:`group_backend` and the c10d
    ``Backend.supports_shrinking`` property (ProcessGroupNCCL: NCCL >= 2.27; inherited by
    ProcessGroupNCCL2 and ProcessGroupNCCLLazy), present on 2.10, 2.13, 2.14.1, 2.15.0 (gloo answers
    False there); the NCCL answer needs CUDA (the GPU check prints it). None where the group has no
    backend for ``device`` or the property is missing or fails: unknown, so callers must not shrink.
    """
    try:
        return bool(group_backend(group, device).supports_shrinking)
    except Exception:  # no backend for the device, or a torch without the property: unknown
        return None


def backend_options_copy(group: dist.ProcessGroup, device: torch.device) -> Any | None:
    """A deep copy of the options of ``group``'s backend for ``device`` (ProcessGroupNCCL.Options).

    What torch's own ``split_group`` gives a child when no ``pg_options`` are passed:
    ``copy.deepcopy(parent_pg._get_backend(device).options)``; the ``options`` property is bound on
    ProcessGroupNCCL (2.10) and on c10d's Backend (2.14.1, 2.15.0: so ProcessGroupNCCL2 has it), read
    in the 2.10, 2.13 and 2.15.0 sources and in dir() of 2.10.0, 2.14.1 and 2.15.0; NOT CHECKED on
    an NCCL group (it needs a GPU). None where the group has no backend for ``device`` or it exposes
    no options.
    """
    try:
        return copy.deepcopy(group_backend(group, device).options)
    except Exception:  # no backend for the device, no options property: the caller passes None
        return None


def nccl_comm_split_count(group: dist.ProcessGroup) -> int | None:
    """How many communicators ``group``'s NCCL backend made by ncclCommSplit; None if unknown.

    ``ProcessGroupNCCL.comm_split_count()`` (2.10.0, 2.14.1, 2.15.0 in dir(); its value NOT CHECKED
    here: it needs a CUDA device). ``ProcessGroupNCCL2`` and ``ProcessGroupNCCLLazy`` (2.14.1, 2.15.0)
    have no such method: None, logged once per call at debug level with the class and torch version.
    Evidence only: None on any failure.
    """
    try:
        backend = group_backend(group, torch.device("cuda"))
    except Exception:  # no CUDA backend: not known
        return None
    count = getattr(backend, "comm_split_count", None)
    if count is None:
        logger.debug("%s (torch %s) has no comm_split_count: the split count is not known",
                     type(backend).__name__, torch.__version__)
        return None
    try:
        return int(count())
    except Exception:  # any failure just means "not known"
        return None


# ---------------------------------------------------------------------------------- options
def nccl_options(high_priority_stream: bool = False,
                 config: Mapping[str, int | str] | None = None) -> Any:
    """A fresh ``ProcessGroupNCCL.Options`` with ``config`` set on its ``config`` (ncclConfig_t).

    The one Options class every NCCL backend takes (ProcessGroupNCCL2's ``Options`` is the same class
    on 2.14.1 and 2.15.0); ``is_high_priority_stream``, ``config`` and the fields commgroups sets
    (cga_cluster_size, min_ctas, max_ctas, net_name, split_share, blocking) are in dir() of 2.10.0,
    2.14.1 and 2.15.0. Whether ProcessGroupNCCL2 honours each config field is NOT CHECKED (C++, needs
    a GPU). new_group mutates the object: never share one.

    Raises:
        BackendUnavailableError: this torch has no NCCL, or its config lacks a field asked for.
    """
    from commgroups.errors import BackendUnavailableError

    owner = getattr(dist, "ProcessGroupNCCL", None)
    options_cls = getattr(owner, "Options", None)
    if options_cls is None:
        raise BackendUnavailableError(
            f"torch {torch.__version__} has no ProcessGroupNCCL.Options (no NCCL in this build); "
            "fix: install a CUDA build of torch, or drop the role's options.nccl")
    options = options_cls(is_high_priority_stream=high_priority_stream)
    for field, value in (config or {}).items():
        if not hasattr(options.config, field):
            raise BackendUnavailableError(
                f"options.nccl.{field}: torch {torch.__version__}'s NCCL config has no {field!r}; "
                "fix: drop the field, or use a torch whose ProcessGroupNCCL.NCCLConfig has it")
        setattr(options.config, field, value)
    return options


def set_options_timeout(options: Any, timeout: timedelta) -> None:
    """Store ``timeout`` on a backend ``Options`` object (ProcessGroupNCCL or ProcessGroupHCCL).

    ``Options._timeout``: the only attribute torch exposes for it (2.10, 2.13, 2.14.1, 2.15.0; c10d
    overwrites it with new_group's ``timeout=`` anyway, which commgroups always passes). No fallback.
    """
    options._timeout = timeout
