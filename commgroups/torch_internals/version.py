"""The running torch's version, the supported range, and the error for features that need a newer one.

commgroups supports torch 2.10 to the newest release (CI legs: 2.10.0, 2.13.0, 2.15.0; 2.14.1 checked
too). Some features need more than the floor; they call :func:`require_torch` first, so the user reads
which version and why instead of an ImportError from deep inside a dependency.
"""

from __future__ import annotations

import torch

from commgroups.errors import TorchVersionError

__all__ = ["SUPPORTED_FROM", "parse_version", "require_torch", "torch_version"]

SUPPORTED_FROM: tuple[int, int, int] = (2, 10, 0)
"""The oldest torch commgroups supports (pyproject's ``torch>=2.10``)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """Major, minor, patch of a version string (``2.15.0+cu132`` -> ``(2, 15, 0)``).

    Example::

        >>> parse_version("2.10.0a0+git1234")
        (2, 10, 0)
    """
    parts: list[int] = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def torch_version() -> tuple[int, int, int]:
    """The running torch's major, minor, patch."""
    return parse_version(torch.__version__)


def require_torch(minimum: tuple[int, int], feature: str, why: str) -> None:
    """Raise :class:`~commgroups.errors.TorchVersionError` unless torch >= ``minimum``.

    Args:
        minimum: (major, minor) the feature needs.
        feature: what the user asked for, e.g. ``"commgroups.integrations.spmd"``.
        why: what in that torch the feature relies on.

    Example::

        require_torch((2, 14), "the torchtitan spmd_types backend",
                      "torchtitan's spmd_types backend needs torch 2.14's DTensor APIs")
    """
    if torch_version()[:2] >= minimum:
        return
    wanted = ".".join(map(str, minimum))
    raise TorchVersionError(
        f"{feature} needs torch >= {wanted} ({why}); this is torch {torch.__version__}; fix: "
        f"pip install 'torch>={wanted}'"
    )
