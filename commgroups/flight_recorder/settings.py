"""Whether the flight recorder runs, and how big its buffers are: one environment variable and a
layout field.

The recorder is on by default. ``COMMGROUPS_FLIGHT_RECORDER=0`` (read at each generation's
creation, never written) turns it off for the process; ``Layout(flight_recorder=False)`` (a layout
file's top-level ``flight_recorder = false``) for every rank of a job.
"""

from __future__ import annotations

import os

from commgroups.layout.specs import Layout

__all__ = ["DEFAULT_ENTRIES", "ENV_VAR", "flight_enabled"]

ENV_VAR = "COMMGROUPS_FLIGHT_RECORDER"
"""``0`` (or ``off``, ``false``, ``no``) turns the recorder off; anything else leaves it on."""

DEFAULT_ENTRIES = 256
"""Entries each role keeps (the newest); a role's older calls fall out of its ring buffer."""

_OFF = frozenset({"0", "off", "false", "no"})


def flight_enabled(layout: Layout) -> bool:
    """Whether generations made from ``layout`` record: the layout's field and the environment.

    Example::

        >>> flight_enabled(Layout(dims={"cp": 2}))           # unless COMMGROUPS_FLIGHT_RECORDER=0
        True
        >>> flight_enabled(Layout(dims={"cp": 2}, flight_recorder=False))
        False
    """
    if not layout.flight_recorder:
        return False
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF
