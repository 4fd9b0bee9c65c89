"""Progress reporting that works the same in the CLI process and inside benchmark ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["NullProgress", "Progress", "QueueProgress", "TqdmProgress", "apply_message"]


class Progress(Protocol):
    """Where a scenario reports how much work it has and how much it did."""

    def add_total(self, units: int) -> None:
        """Announce ``units`` more units of work."""

    def advance(self, units: int = 1) -> None:
        """Report ``units`` done."""

    def describe(self, text: str) -> None:
        """Say what is running now."""


class NullProgress:
    """Reports nothing (ranks other than 0, tests)."""

    def add_total(self, units: int) -> None:
        """Ignored."""

    def advance(self, units: int = 1) -> None:
        """Ignored."""

    def describe(self, text: str) -> None:
        """Ignored."""


class QueueProgress:
    """Forwards progress from a benchmark rank to the parent process (``post`` sends a message)."""

    def __init__(self, post: Callable[[Any], None]) -> None:
        self._post = post

    def add_total(self, units: int) -> None:
        """Forward to the parent."""
        self._post(("total", units))

    def advance(self, units: int = 1) -> None:
        """Forward to the parent."""
        self._post(("advance", units))

    def describe(self, text: str) -> None:
        """Forward to the parent."""
        self._post(("describe", text))


class TqdmProgress:
    """A tqdm bar whose total grows as scenarios announce their work."""

    def __init__(self, enabled: bool = True) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=0, unit="step", disable=not enabled, dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                    "[{elapsed}<{remaining}]")

    def add_total(self, units: int) -> None:
        """Grow the bar's total."""
        self._bar.total = (self._bar.total or 0) + units
        self._bar.refresh()

    def advance(self, units: int = 1) -> None:
        """Move the bar."""
        self._bar.update(units)

    def describe(self, text: str) -> None:
        """Show what runs now."""
        self._bar.set_description_str(text)

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()


def apply_message(progress: Progress, message: tuple[str, Any]) -> None:
    """Apply one message sent by a :class:`QueueProgress` to ``progress``."""
    kind, value = message
    if kind == "total":
        progress.add_total(int(value))
    elif kind == "advance":
        progress.advance(int(value))
    elif kind == "describe":
        progress.describe(str(value))
