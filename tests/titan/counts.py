"""Collective counts per process group, from gloo's own per-group sequence numbers (tests only).

An oracle independent of commgroups' audit: gloo numbers every collective it runs on a group
(functional collectives and barriers included), so the difference of two snapshots is how many
collectives each group carried in between. Groups of other backends (torch's ``fake``, commgroups'
single-rank backend) keep no number and are left out: they move no data between ranks.

A :class:`Tally` splits one training into windows: ``build`` (trainer construction), ``train``
(the training loop, outside the windows below), ``checkpoint`` (inside DCP save and load) and
``timeouts`` (torchtitan's timeout change after step 1, whose stock version barriers on the
default group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

from tests import torch_private

__all__ = ["GroupKey", "Tally", "snapshot"]

GroupKey = tuple[str, tuple[int, ...]]
"""(group name, global ranks) of one process group."""


def snapshot() -> dict[GroupKey, int]:
    """The sequence number of every gloo process group of this process, keyed by name and ranks."""
    counts: dict[GroupKey, int] = {}
    for group, name in torch_private.group_names().items():
        number = torch_private.group_sequence_number(group)
        if number is None:
            continue  # fake or single-rank backend: no sequence number, no traffic
        counts[(name, tuple(dist.get_process_group_ranks(group)))] = number
    return counts


def _delta(before: dict[GroupKey, int], after: dict[GroupKey, int]) -> dict[GroupKey, int]:
    return {key: value - before.get(key, 0) for key, value in after.items()
            if value - before.get(key, 0)}


@dataclass
class Tally:
    """Collectives per group in each window of one training (see the module docs)."""

    windows: dict[str, dict[GroupKey, int]] = field(default_factory=dict)
    _last: dict[GroupKey, int] = field(default_factory=dict)
    _open: str = "build"

    def start(self) -> None:
        """Begin counting (the ``build`` window)."""
        self._last = snapshot()
        self._open = "build"

    def _close(self) -> None:
        now = snapshot()
        window = self.windows.setdefault(self._open, {})
        for key, value in _delta(self._last, now).items():
            window[key] = window.get(key, 0) + value
        self._last = now

    def switch(self, window: str) -> None:
        """Close the open window and open ``window``."""
        self._close()
        self._open = window

    @contextlib.contextmanager
    def inside(self, window: str) -> Iterator[None]:
        """Count the block in ``window``, then return to the window open before it."""
        outer = self._open
        self.switch(window)
        try:
            yield
        finally:
            self.switch(outer)

    def stop(self) -> None:
        """Close the open window."""
        self._close()

    def by_group(self, window: str) -> dict[GroupKey, int]:
        """The counts of ``window`` (an empty dict when nothing ran there)."""
        return dict(self.windows.get(window, {}))
