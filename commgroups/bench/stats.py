"""Medians with spread, paired ratios and the tables every scenario fills."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commgroups.util.text_table import format_table, markdown_table

__all__ = ["Summary", "Table", "interleaved", "number", "paired_ratios", "summarize"]


def number(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, without exponents for numbers people read (0.001 to 10**9)."""
    if value != 0 and (abs(value) >= 10**digits) and abs(value) < 1e9:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


@dataclass(frozen=True)
class Summary:
    """Median and interquartile range of repeated measurements."""

    median: float
    p25: float
    p75: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready form."""
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "n": self.n}

    def scaled(self, factor: float) -> Summary:
        """The same summary in other units (e.g. 1e3: seconds to milliseconds)."""
        return Summary(self.median * factor, self.p25 * factor, self.p75 * factor, self.n)

    def text(self, scale: float = 1.0, digits: int = 3) -> str:
        """``median [p25-p75]`` scaled (e.g. 1e3 for ms)."""
        return (f"{number(self.median * scale, digits)} "
                f"[{number(self.p25 * scale, digits)}-{number(self.p75 * scale, digits)}]")


def summarize(values: Sequence[float]) -> Summary:
    """Median and quartiles of ``values`` (at least one)."""
    if not values:
        raise ValueError("summarize needs at least one value")
    array = np.asarray(values, dtype=np.float64)
    p25, median, p75 = np.percentile(array, [25, 50, 75])
    return Summary(float(median), float(p25), float(p75), len(values))


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-repetition ratios: each repetition measured both variants back to back, so its ratio
    cancels the slow drifts (other jobs, frequency changes) that a ratio of medians would keep."""
    if len(numerators) != len(denominators):
        raise ValueError("paired_ratios needs as many numerators as denominators")
    return [n / d for n, d in zip(numerators, denominators) if d > 0 and math.isfinite(n / d)]


def interleaved(variants: Sequence[str], repetition: int) -> list[str]:
    """The variants in the order to run them in repetition ``repetition``, counterbalanced: a
    rotation, run forward in even repetitions and backward in odd ones, rotated one further every
    two. Over every two repetitions each variant runs once before and once after each other
    variant, and over ``2 * len(variants)`` each runs first twice, so a paired ratio carries no
    order effect: whatever runs first warms the code the others then run (torch's group
    creation), and what runs last runs after the others' garbage.

    A rotation alone was not balanced for a pair: with 5 variants, one ran before another in 3
    repetitions of 5 (creation on 4 gloo ranks, 20 worlds: the registry read 1.53x DeviceMesh
    where it ran first, 0.97x where it ran after; 1.21x pooled, from 60% of its pairs run first).

    >>> [interleaved("abc", r) for r in range(4)]
    [['a', 'b', 'c'], ['c', 'b', 'a'], ['b', 'c', 'a'], ['a', 'c', 'b']]
    """
    shift = (repetition // 2) % len(variants)
    order = [*variants[shift:], *variants[:shift]]
    return order[::-1] if repetition % 2 else order


@dataclass
class Table:
    """One result table: named columns, rows of JSON-ready cells, a title and notes."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        """Append a row; it must have one cell per column."""
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.name}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: title, columns, rows (Summary cells become dicts), notes."""
        return {
            "title": self.title,
            "columns": self.columns,
            "rows": [[c.to_dict() if isinstance(c, Summary) else c for c in row]
                     for row in self.rows],
            "notes": self.notes,
        }

    def column(self, name: str) -> list[Any]:
        """Every cell of column ``name``."""
        index = self.columns.index(name)
        return [row[index] for row in self.rows]

    @staticmethod
    def _cell(value: Any) -> str:
        if isinstance(value, Summary):
            return value.text()
        if isinstance(value, float):
            return number(value, 4)
        return str(value)

    def text(self) -> str:
        """A plain-text rendering (Summary cells as median [p25-p75])."""
        rows = [[self._cell(c) for c in row] for row in self.rows]
        lines = [self.title, "=" * len(self.title), *format_table(self.columns, rows)]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        """A GitHub-flavoured markdown rendering for benchmarks/README.md."""
        lines = [f"### {self.title}", "",
                 *markdown_table(self.columns, [[self._cell(c) for c in row] for row in self.rows])]
        if self.notes:
            lines.append("")
            lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines)
