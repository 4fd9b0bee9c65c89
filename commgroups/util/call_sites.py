"""Which frame issued a collective: the first one outside the plumbing.

A collective reaches the recorder through layers that only carry it: torch itself, the decorators
torch wraps its API in, and commgroups' own wrappers and integrations. The call site a user wants to
read is the first frame of a module outside those layers: their training script, spmd_types, a demo
or benchmark built on commgroups. The rule reads each frame's module name (``__name__`` of its
globals), so it holds wherever the packages are installed and whatever the file system's links are.
No torch import: the rule is plain Python.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType

__all__ = ["PLUMBING_MODULES", "call_site", "inside", "is_plumbing"]

PLUMBING_MODULES: tuple[str, ...] = (
    # torch, and the decorator plumbing between it and its caller (typing_extensions.deprecated
    # wraps all_gather_into_tensor in torch 2.13)
    "torch",
    "typing_extensions",
    "contextlib",
    "functools",
    # commgroups' modules that issue or forward collectives on a caller's behalf
    "commgroups.creation.agreement",
    "commgroups.collectives.async_wait",
    "commgroups.audit",
    "commgroups.backends",
    "commgroups.collectives.role_collectives",
    "commgroups.creation.role_groups",
    "commgroups.flight_recorder",
    "commgroups.integrations",
    "commgroups.creation.meshes",
    "commgroups.registry",
    "commgroups.recovery",
    "commgroups.util.serialized",
)
"""Module prefixes whose frames are never a call site (a prefix covers its submodules)."""


def is_plumbing(module: str, plumbing: tuple[str, ...] = PLUMBING_MODULES) -> bool:
    """Whether frames of ``module`` are plumbing rather than a call site.

    Args:
        module: a module name, e.g. ``"torch.distributed.distributed_c10d"``.
        plumbing: the module prefixes that count as plumbing.

    Returns:
        True when ``module`` is one of ``plumbing`` or inside one of them.

    Example::

        >>> is_plumbing("torch.distributed.fsdp._fully_shard")
        True
        >>> is_plumbing("commgroups.demo.train"), is_plumbing("torchtitan.train")
        (False, False)
    """
    return any(module == prefix or module.startswith(prefix + ".") for prefix in plumbing)


def call_site(frame: FrameType | None = None, plumbing: tuple[str, ...] = PLUMBING_MODULES) -> str:
    """Where a call came from: the first frame, walking outwards, outside ``plumbing``.

    Args:
        frame: the innermost frame to look at; None: the caller of this function.
        plumbing: the module prefixes to walk past (default :data:`PLUMBING_MODULES`).

    Returns:
        ``"path:line in function"`` of that frame, or ``"<unknown>"`` when every frame is plumbing.

    Example::

        # in train.py, line 12, inside step(): dist.all_reduce(t) -> ... -> the recorder
        call_site()   # "train.py:12 in step"
    """
    for module, current in _frames(sys._getframe(1) if frame is None else frame):
        if module is None or not is_plumbing(module, plumbing):
            return f"{current.f_code.co_filename}:{current.f_lineno} in {current.f_code.co_name}"
    return "<unknown>"


def inside(modules: tuple[str, ...], frame: FrameType | None = None) -> bool:
    """Whether any frame from ``frame`` outwards belongs to one of ``modules`` (or a submodule).

    Args:
        modules: module prefixes, e.g. ``("torch.distributed.checkpoint",)``.
        frame: the innermost frame to look at; None: the caller of this function.

    Returns:
        True when such a frame is on the stack: the call happens inside that code.

    Example::

        # a collective DCP's save_state_dict issues, observed by the audit
        inside(("torch.distributed.checkpoint",))   # True
    """
    return any(module is not None and is_plumbing(module, modules)
               for module, _ in _frames(sys._getframe(1) if frame is None else frame))


def _frames(frame: FrameType | None) -> Iterator[tuple[str | None, FrameType]]:
    """Each frame from ``frame`` outwards, with its module name (None where it has none)."""
    while frame is not None:
        module = frame.f_globals.get("__name__")
        yield (module if isinstance(module, str) else None), frame
        frame = frame.f_back
