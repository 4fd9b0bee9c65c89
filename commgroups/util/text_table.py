"""Plain-text tables and rank lists, as the CLI, ``describe()`` and reports print them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_ranks", "format_table", "markdown_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header; one string a line."""
    table = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub-flavoured markdown table: header, ``|---|`` rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(row) + " |" for row in rows]]


def format_ranks(ranks: Sequence[int]) -> str:
    """A rank list, shortened past 8 ranks: ``[0..127]`` when contiguous, else the first six."""
    ranks = list(ranks)
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}..{ranks[-1]}]"
    if len(ranks) > 8:
        return "[" + ", ".join(map(str, ranks[:6])) + f", ... {ranks[-1]}] ({len(ranks)} ranks)"
    return str(ranks)
