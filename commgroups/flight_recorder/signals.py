"""Dump on a signal: ``kill -USR1 <pid>`` makes a rank write its flight recorder (opt-in).

A hung job's ranks can then be dumped from outside, e.g. ``pkill -USR1 -f train.py`` by whoever
runs the job, and merged with ``commgroups flight merge DIR``.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commgroups.registry import GroupRegistry

__all__ = ["dump_on_signal"]

logger = logging.getLogger(__name__)


def dump_on_signal(registry: GroupRegistry, directory: str | os.PathLike[str] | None = None,
                   signum: int = signal.SIGUSR1) -> Any:
    """Install a handler for ``signum`` that writes ``registry``'s flight recorder into
    ``directory``; returns the previous handler. Call it from the main thread.

    The handler runs between two Python bytecodes of the main thread; a rank blocked in a C++
    collective runs it once the collective returns or times out.
    """

    def handler(number: int, frame: Any) -> None:
        del number, frame
        path = registry.dump_flight_recorder(directory)
        logger.warning("flight recorder written to %s (signal %d)", path, signum)

    return signal.signal(signum, handler)
