"""The demo's one connection to :mod:`commgroups.audit` (isolated here on purpose).

Everything the demo knows about the audit's API is in this module: start recording around the
training and checkpoint, then turn the records into a JSON-ready list of hazards. When the audit
package is missing or fails to import, the demo still runs and says the audit was unavailable.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .groups import JobGroups

__all__ = ["DemoAudit", "start_audit"]

logger = logging.getLogger(__name__)


class DemoAudit:
    """Records the run's collectives (when the audit is available) and reports hazards."""

    def __init__(self, status: str, groups: JobGroups) -> None:
        self.status = status
        """``on``, ``off`` or ``unavailable: <why>``."""
        self._groups = groups
        self._auditor: Any = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every collective issued inside the scope (no-op when the audit is not on)."""
        yield

    def finish(self) -> list[dict[str, Any]]:
        """The hazards found, as JSON-ready dicts (empty when the audit is not on). Collective."""
        return []


def start_audit(enabled: bool, groups: JobGroups) -> DemoAudit:
    """A :class:`DemoAudit` for this run; ``enabled=False`` gives one whose status is ``off``."""
    if not enabled:
        return DemoAudit("off", groups)
    try:
        import commgroups.audit  # noqa: F401
    except ImportError as error:
        logger.info("audit unavailable: %s", error)
        return DemoAudit(f"unavailable: {error}", groups)
    return DemoAudit("unavailable: not wired yet", groups)
