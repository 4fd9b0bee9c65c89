"""Error texts within their bound: what failed, the field, one fix, in at most 300 characters.

The reasoning behind an error belongs in ``docs/guide.md``; a text that lists values (the problems
of a layout, the fields two ranks disagree on, known names) lists what fits and counts the rest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["MAX_ERROR_CHARS", "backend_words", "first_fitting", "fit_lines", "listed"]

MAX_ERROR_CHARS = 300
"""The longest error text commgroups writes (``tests/test_error_texts.py`` holds every one to it)."""


_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def backend_words(cause: str, width: int) -> str:
    """A backend's own error line, without gloo's source location (``[.../pair.cc:553] ``), cut
    to ``width`` characters (``...`` ending a cut one)."""
    words = _GLOO_SOURCE.sub("", cause)
    return words if len(words) <= width else words[:width - 4] + " ..."


def first_fitting(*candidates: str) -> str:
    """The first of ``candidates`` (fullest first) within :data:`MAX_ERROR_CHARS`, else the last."""
    for text in candidates:
        if len(text) <= MAX_ERROR_CHARS:
            return text
    return candidates[-1]


def listed(items: Sequence[str], width: int = 100, sep: str = ", ", *, count: bool = True) -> str:
    """``items`` joined by ``sep`` up to about ``width`` characters, then ``... (N in all)``
    (``...`` alone with ``count=False``, where the text says how many already).

    Example::

        >>> listed(["dp", "cp", "tp"], width=6)
        'dp, cp, ... (3 in all)'
    """
    shown: list[str] = []
    used = 0
    for item in items:
        if shown and used + len(sep) + len(item) > width:
            return f"{sep.join(shown)}{sep}..." + (f" ({len(items)} in all)" if count else "")
        shown.append(item)
        used += len(item) + (len(sep) if len(shown) > 1 else 0)
    return sep.join(shown)


def fit_lines(head: str, lines: Sequence[str], tail: str = "", *, sep: str = "\n  ",
              names: Sequence[str] | None = None) -> str:
    """``head``, as many of ``lines`` as fit, ``(and N more)``, then ``tail``: within the bound.

    ``head`` and ``tail`` are kept whole (``tail`` holds the fix). ``names``: a short name per line
    (its field); the lines left out are then named, ``(and 2 more: roles[1].name, dims.cp)``. A
    first line that does not fit even alone is cut in the middle, keeping its ``fix:`` part.
    """
    budget = MAX_ERROR_CHARS - len(head) - len(tail)

    def more(start: int) -> str:
        left = len(lines) - start
        if not left:
            return ""
        named = f": {listed(names[start:], width=60, count=False)}" if names is not None else ""
        return f"{sep}(and {left} more{named})"

    count = 0
    while count < len(lines) and len(sep.join(lines[: count + 1]) + more(count + 1)) <= budget:
        count += 1
    if count:
        return head + sep.join(lines[:count]) + more(count) + tail
    rest = more(1)
    return head + (_cut(lines[0], budget - len(rest)) if lines else "") + rest + tail


def _cut(line: str, room: int) -> str:
    """``line`` in ``room`` characters: its start, `` ... ``, and its fix (what follows ``fix:``)."""
    at = line.rfind("; fix:")
    keep = line[at:] if at >= 0 else ""
    start = room - len(keep) - 4
    if start < 20:  # no room for both: the start alone
        keep, start = "", max(room - 4, 0)
    return line[:start] + " ..." + keep
