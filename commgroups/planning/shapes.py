"""Row-major (size, stride) arithmetic of a factorization of the world: the one helper for it.

Pure (no torch, no pydantic): specs validate views with it, the plan computes every group from it and
``torch_internals`` hands DeviceMesh's layout code the same strides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["dim_shapes", "row_major_strides"]


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Strides of ``sizes`` read row-major (last dim fastest): ``(2, 3, 4)`` -> ``(12, 4, 1)``."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    return tuple(strides)


def dim_shapes(dims: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(size, stride) of each named dim, outermost first: ``{"dp": 2, "cp": 4}`` ->
    ``{"dp": (2, 4), "cp": (4, 1)}``."""
    return dict(zip(dims, zip(dims.values(), row_major_strides(list(dims.values())))))
