"""The bounds every layout input is checked against, and the checks that need no spec.

Each bound is far above any real job and far below what would make validation, planning or the CLI
slow: whatever passes them validates, plans and prints within a second (``tests/test_fuzz_layouts.py``
and ``tests/test_limits.py`` hold that). A value outside a bound raises a
:class:`~commgroups.errors.LayoutError` subclass that names the field, the bound and the fix.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from commgroups import errors

__all__ = [
    "MAX_DIMS",
    "MAX_LAYOUT_CHARS",
    "MAX_LAYOUT_NODES",
    "MAX_NAME_LENGTH",
    "MAX_NESTING",
    "MAX_ROLES",
    "MAX_TIMEOUT_S",
    "MAX_VIEWS",
    "MAX_WORLD_SIZE",
    "MIN_TIMEOUT_S",
    "check_input_shape",
    "check_timeout",
    "short_repr",
]

MAX_WORLD_SIZE = 1 << 20
"""Ranks in a layout (1,048,576): several times the largest jobs run today, and small enough that
materialising every group of a role (``Plan.groups``) takes well under a second."""

MAX_DIMS = 16
"""Dims in ``dims`` or in one view (torchtitan uses at most 6)."""

MAX_VIEWS = 16
"""Views of a layout."""

MAX_ROLES = 256
"""Roles of a layout (each costs a communicator per rank)."""

MAX_NAME_LENGTH = 64
"""Characters in a dim, view or role name."""

MAX_NESTING = 16
"""Levels of nested mappings and lists in a layout (a valid layout needs at most 7)."""

MAX_LAYOUT_NODES = 50_000
"""Values in a layout once YAML aliases are expanded (a layout holds a few dozen)."""

MAX_LAYOUT_CHARS = 200_000
"""Characters in a layout file or text (a layout is a few hundred; PyYAML reads ~100k a second)."""

MIN_TIMEOUT_S = 0.01
"""Shortest timeout: torch counts timeouts in milliseconds, and below this every call times out."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest timeout, one week (604,800 s): c10d turns timeouts into int64 nanoseconds and chrono
durations, where values from about 9.2e9 s overflow and every collective times out at once."""

_short = reprlib.Repr()
_short.maxlevel = 3
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 6


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a readable size, safe on deep or huge values (for error messages)."""
    try:
        return _short.repr(value)
    except Exception:  # a user object whose __repr__ fails must not hide the real error
        return f"<{type(value).__name__}>"


def check_input_shape(data: Any, where: str) -> None:
    """Refuse input too deep, too large, cyclic, or with non-text keys, before pydantic sees it.

    Iterative, so a dict nested thousands deep (or a YAML list that contains itself) is an error
    naming the field, not a ``RecursionError``; pydantic models inside are leaves.

    Raises:
        LayoutError: deeper than :data:`MAX_NESTING` (a cycle is infinitely deep) or more than
            :data:`MAX_LAYOUT_NODES` values.
        UnknownFieldError: a mapping key that is not text (YAML's ``? [a] : 1``).
    """
    # Each entry: (value, depth, parent entry, key); paths are only spelled out for an error.
    Entry = tuple[Any, int, Any, Any]
    stack: list[Entry] = [(data, 0, None, None)]
    nodes = 0
    while stack:
        entry = stack.pop()
        node, depth = entry[0], entry[1]
        nodes += 1
        if nodes > MAX_LAYOUT_NODES:
            raise errors.LayoutError(
                f"the layout holds more than {MAX_LAYOUT_NODES:,} values (MAX_LAYOUT_NODES, YAML "
                "aliases expanded); fix: a layout needs a few dozen values, so remove repeated or "
                "generated content",
                field=where,
            )
        kind = type(node)
        if kind is dict or (kind is not list and kind is not tuple and isinstance(node, Mapping)):
            if not node:
                continue
            if depth >= MAX_NESTING:
                raise _too_deep(_path_of(entry) or where)
            for key, value in node.items():
                if type(key) is not str:
                    path = _path_of(entry) or where
                    raise errors.UnknownFieldError(
                        f"{path}: key {short_repr(key)} is not a name; fix: use text keys such as "
                        "'dims'",
                        field=path,
                    )
                stack.append((value, depth + 1, entry, key))
        elif kind is list or kind is tuple:
            if not node:
                continue
            if depth >= MAX_NESTING:
                raise _too_deep(_path_of(entry) or where)
            stack.extend((value, depth + 1, entry, index) for index, value in enumerate(node))


def _path_of(entry: tuple[Any, int, Any, Any]) -> str:
    """The dotted field path of a stack entry of :func:`check_input_shape`."""
    parts: list[str] = []
    while entry is not None and entry[2] is not None:
        key = entry[3]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    return "".join(reversed(parts)).lstrip(".")


def _too_deep(path: str) -> errors.LayoutError:
    return errors.LayoutError(
        f"{path}: nested more than {MAX_NESTING} levels deep (MAX_NESTING, or it contains itself); "
        "fix: flatten it (a layout nests at most 7 levels)",
        field=path,
    )


def check_timeout(value: Any, field: str) -> float:
    """``value`` as seconds when it is a real timeout, else an ArgumentError naming ``field``.

    For arguments (the registry's timeouts, command-line options); a layout's ``timeout_s`` is
    checked by its spec and raises a LayoutError.

    A timeout is an int or float (not a bool, not text), or a ``timedelta`` (its seconds),
    finite, within [:data:`MIN_TIMEOUT_S`, :data:`MAX_TIMEOUT_S`].
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.ArgumentError(
            f"{field}: a timeout is a number of seconds, got {type(value).__name__} "
            f"{short_repr(value)}; fix: give seconds such as 300",
            field=field,
        )
    # Compared as given, before anything turns it into a float: an int past float's range
    # (10**400) would raise OverflowError there. The bounds also refuse nan and inf.
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise errors.ArgumentError(
            f"{field}: {short_repr(value)} s is outside [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] "
            "(MIN_TIMEOUT_S..MAX_TIMEOUT_S: torch counts milliseconds and overflows past ~9.2e9 s); "
            "fix: give seconds in that range, e.g. 300",
            field=field,
        )
    return float(value)
