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
from types import FrameType

__all__ = ["PLUMBING_MODULES", "call_site", "is_plumbing"]

PLUMBING_MODULES: tuple[str, ...] = (
    # torch, and the decorator plumbing between it and its caller (typing_extensions.deprecated
    # wraps all_gather_into_tensor in torch 2.13)
    "torch",
    "typing_extensions",
    "contextlib",
    "functools",
    # commgroups' modules that issue or forward collectives on a caller's behalf
    "commgroups.agreement",
    "commgroups.async_wait",
    "commgroups.audit",
    "commgroups.backends",
    "commgroups.collectives",
    "commgroups.creation",
    "commgroups.integrations",
    "commgroups.meshes",
    "commgroups.registry",
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
    current: FrameType | None = sys._getframe(1) if frame is None else frame
    while current is not None:
        module = current.f_globals.get("__name__")
        if not isinstance(module, str) or not is_plumbing(module, plumbing):
            return f"{current.f_code.co_filename}:{current.f_lineno} in {current.f_code.co_name}"
        current = current.f_back
    return "<unknown>"
