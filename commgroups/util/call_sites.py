"""Which frame issued a collective: the first one outside the plumbing.

A collective reaches the recorder through layers that only carry it: torch itself, the decorators
torch wraps its API in, and commgroups' own wrappers and integrations. The call site a user wants to
read is the first frame of a module outside those layers: their training script, spmd_types, a demo
or benchmark built on commgroups. The rule reads each frame's module name (``__name__`` of its
globals), so it holds wherever the packages are installed and whatever the file system's links are.
No torch import: the rule is plain Python.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["PLUMBING_MODULES", "FileModules", "call_site", "call_site_of", "inside", "is_plumbing",
           "module_of"]

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
    "commgroups.rank_loss.recovery",
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


def module_of(filename: str, roots: Sequence[str] | None = None) -> str | None:
    """The module a source file is importable as, from the import roots that hold it.

    Args:
        filename: a frame's file name as torch's flight recorder stores it (an absolute path).
        roots: the import roots to try (default ``sys.path``); the longest that holds it wins.

    Returns:
        The dotted module name (``__init__`` dropped), or None when no root holds the file.

    Example::

        >>> module_of("/venv/site-packages/torch/distributed/c10d_logger.py", ["/venv/site-packages"])
        'torch.distributed.c10d_logger'
    """
    path = os.path.abspath(filename)
    best: str | None = None
    for root in sys.path if roots is None else roots:
        base = os.path.abspath(root or os.curdir).rstrip(os.sep) + os.sep
        if path.startswith(base) and (best is None or len(base) > len(best)):
            best = base
    if best is None or not path.endswith(".py"):
        return None
    parts = path[len(best):-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or None


class FileModules:
    """Which module each source file is, resolved once per file (a dump reads thousands of frames
    naming a few dozen files).

    :func:`module_of` first; where no import root holds the file (an editable install imports
    through a finder), the modules this process loaded are asked, their file map built once.
    """

    def __init__(self) -> None:
        self._known: dict[str, str | None] = {}
        self._loaded: dict[str, str] | None = None

    def module(self, filename: str) -> str | None:
        """The dotted module ``filename`` is, or None when neither way knows it."""
        if filename not in self._known:
            module = module_of(filename)
            if module is None:
                if self._loaded is None:
                    self._loaded = {os.path.abspath(getattr(m, "__file__", None) or ""): name
                                    for name, m in list(sys.modules.items())}
                module = self._loaded.get(os.path.abspath(filename))
            self._known[filename] = module
        return self._known[filename]


def call_site_of(frames: Sequence[dict[str, Any]],
                 plumbing: tuple[str, ...] = PLUMBING_MODULES,
                 modules: FileModules | None = None) -> str:
    """:func:`call_site` for frames recorded as data (torch's flight recorder: innermost first,
    each ``{"name", "filename", "line"}``).

    Args:
        frames: the recorded frames, innermost first.
        plumbing: the module prefixes to walk past.
        modules: a resolver to share across many calls (one per dump); a new one otherwise.

    Returns:
        ``"path:line in function"`` of the first frame outside ``plumbing``, or ``"<unknown>"``.

    Example::

        >>> call_site_of([{"name": "all_reduce", "line": 3245, "filename": "/x/torch/c10d.py"},
        ...               {"name": "step", "line": 12, "filename": "/job/train.py"}])
        '/job/train.py:12 in step'
    """
    modules = modules or FileModules()
    for frame in frames:
        filename = str(frame.get("filename", ""))
        module = modules.module(filename)
        if module is None and os.sep + "torch" + os.sep in filename:
            continue  # a torch file outside every import root (a build tree): still plumbing
        if module is None or not is_plumbing(module, plumbing):
            return f"{filename}:{frame.get('line')} in {frame.get('name')}"
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
