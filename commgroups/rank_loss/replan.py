"""Replanning after a rank loss: the layout the survivors can form, derived by the same layout rules.

Pure (no torch.distributed): every survivor computes the same answer from the same inputs. A lost rank
takes its whole slice along one elastic dim with it (its replica, for ``dp_replicate``); every other
dim keeps its size, so every role is re-derived from the same rules on the smaller world. Survivors
keep their order: new rank ``i`` is the ``i``-th smallest surviving global rank of the kept slices,
which is exactly the row-major numbering of the smaller grid.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from commgroups.errors import RebuildError, ReplanError
from commgroups.layout import limits
from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan
from commgroups.planning.shapes import dim_shapes
from commgroups.util.text_table import format_ranks

__all__ = ["Replan", "ReplanArrays", "alive_ranks", "as_rank_array", "replan", "replan_arrays"]


@dataclass(frozen=True)
class Replan:
    """What :func:`replan` decided.

    Attributes:
        layout: the layout on the survivors (elastic dims shrunk, views with them; roles, options,
            timeouts and the elastic section kept).
        ranks: ``ranks[new_rank]`` is the surviving global rank that takes ``new_rank``.
        lost: the global ranks not in ``alive``.
        spares: survivors outside the new layout, kept as spares (``elastic.spares``).
        dropped: survivors outside the new layout that should exit (not ``elastic.spares``).
        removed: elastic dim -> the coordinates removed along it (old numbering).
    """

    layout: Layout
    ranks: tuple[int, ...]
    lost: tuple[int, ...]
    spares: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    removed: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def new_rank(self, global_rank: int) -> int | None:
        """The new rank of surviving ``global_rank``, or None when it has no place (spare/dropped)."""
        index = int(np.searchsorted(self.ranks, global_rank))
        return index if index < len(self.ranks) and self.ranks[index] == global_rank else None



@dataclass(frozen=True)
class ReplanArrays:
    """:func:`replan_arrays`' decision as int64 arrays (ascending), for callers at scale.

    The same fields as :class:`Replan`: at 65,536 ranks turning ``ranks`` into a tuple and back
    costs milliseconds each way, so the registry's rebuild keeps them as arrays.
    """

    layout: Layout
    ranks: np.ndarray
    lost: np.ndarray
    spares: np.ndarray
    dropped: np.ndarray
    removed: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def as_tuples(self) -> Replan:
        """The same decision with tuples of ints (:class:`Replan`)."""
        return Replan(self.layout, tuple(self.ranks.tolist()), tuple(self.lost.tolist()),
                      tuple(self.spares.tolist()), tuple(self.dropped.tolist()), self.removed)

def _shrunk(layout: Layout, sizes: dict[str, int]) -> Layout:
    """``layout`` with elastic dims at ``sizes``, in ``dims`` and in every view that has them."""
    data = layout.model_dump()
    data["dims"] = {name: sizes.get(name, size) for name, size in layout.dims.items()}
    data["views"] = {view: {name: sizes.get(name, size) for name, size in dims.items()}
                     for view, dims in layout.views.items()}
    return Layout.model_validate(data)


def _blocking_group(layout: Layout, rank: int) -> tuple[str, list[int]] | None:
    """The innermost non-elastic dim of size > 1 through ``rank``, with its rank group."""
    elastic = layout.elastic.dims if layout.elastic is not None else {}
    shapes = dim_shapes(layout.dims)
    for name in reversed(list(layout.dims)):
        size, stride = shapes[name]
        if name in elastic or size == 1:
            continue
        first = rank - ((rank // stride) % size) * stride
        return name, [first + i * stride for i in range(size)]
    return None


def as_rank_array(ranks: Iterable[int]) -> np.ndarray:
    """``ranks`` as a 1-d int64 array, without a Python step per rank for lists and arrays.

    Raises TypeError for anything that is not integers (``operator.index`` semantics: no floats,
    no strings, no booleans, no nested lists), and for strings, bytes and mappings as a whole.
    """
    if isinstance(ranks, (str, bytes, bytearray, memoryview, Mapping)):
        raise TypeError(f"a {type(ranks).__name__} is not a list of ranks")
    if isinstance(ranks, (list, tuple)):
        # numpy reads True as 1: one pass to refuse bools (about 30 ns per rank).
        if any(type(r) is bool or type(r) is np.bool_ for r in ranks):
            raise TypeError("a bool is not a rank")
        ranks = np.asarray(ranks)
    elif isinstance(ranks, range):
        ranks = np.asarray(ranks)
    if not isinstance(ranks, np.ndarray):  # sets, generators: one step per rank
        return np.fromiter((operator.index(r) for r in ranks), dtype=np.int64)
    if ranks.ndim == 1 and (ranks.dtype.kind in "iu" or ranks.size == 0):
        return ranks.astype(np.int64, copy=False)
    raise TypeError(f"not a flat list of integers (numpy reads it as {ranks.dtype}, "
                    f"{ranks.ndim}-d)")


def replan(layout: Layout, alive: Iterable[int]) -> Replan:
    """The layout the ranks in ``alive`` can form, by shrinking one elastic dim.

    Each candidate elastic dim (of ``layout.elastic``) drops every coordinate that holds a lost rank;
    a candidate is feasible when the dim stays at or above its minimum. The feasible candidate that
    keeps the most ranks wins (ties: the outermost dim). Nothing lost: the same layout.

    Args:
        layout: the layout the job ran on.
        alive: the global ranks still alive (any order; duplicates ignored).

    Returns:
        A :class:`Replan`: the new layout, the map new rank -> global rank, the lost ranks, and the
        survivors left without a place (spares or dropped, per ``elastic.spares``).

    Raises:
        ReplanError: a rank in ``alive`` is outside the world, nobody is alive, or no elastic dim
            can absorb the loss; the message names a lost rank's group along a dim that may not
            shrink (``"cp group [4, 5, 6, 7] lost rank 5; cp may not shrink"``) and why each elastic
            dim could not.

    Example::

        >>> from commgroups.layout.specs import Layout
        >>> layout = Layout(dims={"dp_replicate": 2, "dp_shard": 2},
        ...                 elastic={"dims": {"dp_replicate": 1}, "spares": True})
        >>> result = replan(layout, alive=[0, 1, 2])
        >>> result.layout.dims, result.ranks, result.lost, result.spares
        ({'dp_replicate': 1, 'dp_shard': 2}, (0, 1), (3,), (2,))
    """
    return replan_arrays(layout, alive).as_tuples()


def replan_arrays(layout: Layout, alive: Iterable[int]) -> ReplanArrays:
    """:func:`replan` with the rank sets as int64 arrays (same rules, same errors)."""
    world = layout.world_size
    # Masks rather than np.unique/np.isin: those import numpy.ma on first use (0.2-1.5 s, paid
    # inside a rebuild).
    try:
        given = as_rank_array(alive)
    except (TypeError, ValueError, OverflowError) as error:
        raise ReplanError(f"alive: {limits.short_repr(alive)} is not a list of global ranks "
                          f"({error}); fix: pass e.g. alive=[0, 1, 3]") from None
    if given.size and (given.min() < 0 or given.max() >= world):
        outside = sorted({int(r) for r in given if r < 0 or r >= world})
        raise ReplanError(f"alive: ranks {outside} are outside the world 0..{world - 1}; fix: "
                          "pass global ranks of the layout's world")
    if given.size == 0:
        raise ReplanError("alive: no rank survived; fix: restart the job from its checkpoint")
    is_alive = np.zeros(world, dtype=bool)
    is_alive[given] = True
    survivors = np.flatnonzero(is_alive)
    lost = np.flatnonzero(~is_alive)
    if lost.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ReplanArrays(layout, survivors, empty, empty, empty)
    elastic = layout.elastic
    shapes = dim_shapes(layout.dims)
    best: tuple[int, str, np.ndarray] | None = None
    reasons: list[str] = []
    for name, minimum in (elastic.dims.items() if elastic is not None else ()):
        size, stride = shapes[name]
        hit = np.zeros(size, dtype=bool)
        hit[(lost // stride) % size] = True
        gone = np.flatnonzero(hit)
        if size - gone.size < minimum:
            reasons.append(f"{name} would shrink from {size} to {size - gone.size}, below its "
                           f"minimum {minimum}")
            continue
        keep = ~hit[(np.arange(world) // stride) % size]
        kept = int(keep.sum())
        outer = list(layout.dims).index(name)
        if best is None or kept > best[0] or (kept == best[0]
                                              and outer < list(layout.dims).index(best[1])):
            best = (kept, name, keep)
    if best is None:
        rank = int(lost[0])
        blocking = _blocking_group(layout, rank)
        where = (f"{blocking[0]} group {blocking[1]} lost rank {rank}; {blocking[0]} may not shrink"
                 if blocking is not None else f"rank {rank} is lost")
        others = f" ({len(lost)} ranks lost in all: {[int(r) for r in lost[:16]]}"
        others += "...)" if len(lost) > 16 else ")"
        why = ("; " + "; ".join(reasons)) if reasons else "; the layout declares no elastic dim"
        raise ReplanError(
            f"{where}{others if len(lost) > 1 else ''}{why}; fix: declare an elastic dim with "
            "room to shrink (layout elastic.dims, e.g. dp_replicate), or restart from a "
            "checkpoint on a layout the survivors fill"
        )
    _, name, keep = best
    size, stride = shapes[name]
    removed = tuple(sorted({int(c) for c in (lost // stride) % size}))
    new_layout = _shrunk(layout, {name: size - len(removed)})
    placed = np.flatnonzero(keep)
    leftover = np.flatnonzero(~keep & is_alive)
    assert math.prod(new_layout.dims.values()) == placed.size
    assert bool(is_alive[placed].all())
    spare = bool(elastic is not None and elastic.spares)
    none = np.zeros(0, dtype=np.int64)
    return ReplanArrays(
        layout=new_layout,
        ranks=placed,
        lost=lost,
        spares=leftover if spare else none,
        dropped=none if spare else leftover,
        removed={name: removed},
    )


def alive_ranks(alive: Iterable[int], plan: Plan, rank: int) -> np.ndarray:
    """``alive`` as a sorted int64 array of distinct ranks of ``plan``'s generation, ``rank``
    included; else a :class:`~commgroups.errors.RebuildError` naming what is wrong."""
    try:
        given = as_rank_array(alive)
    except (TypeError, ValueError, OverflowError) as error:
        raise RebuildError(f"alive: {limits.short_repr(alive)} is not a list of global "
                           f"ranks ({error}); fix: pass e.g. alive=[0, 1, 3]") from None
    ranks = np.sort(given)
    if ranks.size:  # duplicates ignored (masks, not np.unique: see replan)
        ranks = ranks[np.concatenate(([True], ranks[1:] != ranks[:-1]))]
    outside = ranks[~plan.holds(ranks)].tolist()
    index = int(np.searchsorted(ranks, rank))
    if outside or index >= ranks.size or int(ranks[index]) != rank:
        raise RebuildError(
            f"alive: {format_ranks(ranks.tolist())} must be global ranks of the current "
            f"generation and include this rank ({rank}); "
            f"{'outside: ' + format_ranks(outside) if outside else 'this rank is missing'}; "
            "fix: pass the survivors' global ranks, or alive=None"
        )
    return ranks
