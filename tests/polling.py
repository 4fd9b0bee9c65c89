"""Waiting in tests for what another thread or process does: poll a condition until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["until"]


def until(condition: Callable[[], object], within_s: float = 15.0) -> bool:
    """Whether ``condition()`` became true within ``within_s`` (checked every 10 ms): a test
    asserts on the result, so a condition never met fails the test instead of hanging it."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
