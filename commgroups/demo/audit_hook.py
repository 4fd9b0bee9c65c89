"""The demo's one connection to :mod:`commgroups.audit` (isolated here on purpose).

Everything the demo knows about the audit's API is in this module: record around the training and
checkpoint with ``audit.record(roles)``, gather every rank's ``Recorder.to_dict()`` on rank 0 and
``audit.merge`` them, which adds the cross-rank sequence check to the per-rank hazards (aliasing of
the default group, mixed blocking/async calls on one communicator). When the audit package is missing
or fails to import, the demo still runs and says the audit was unavailable.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from .groups import JobGroups

__all__ = ["DemoAudit", "start_audit"]

logger = logging.getLogger(__name__)


class DemoAudit:
    """Records the run's collectives (when the audit is available) and reports hazards."""

    def __init__(self, status: str, groups: JobGroups, audit: Any = None) -> None:
        self.status = status
        """``on``, ``off`` or ``unavailable: <why>``."""
        self.summary: dict[str, Any] = {}
        """Per-group call counts from the merged report (rank 0, after :meth:`finish`)."""
        self.report_text = ""
        """The audit's own rendering of the merged report (rank 0, after :meth:`finish`)."""
        self._groups = groups
        self._audit = audit
        self._recorder: Any = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every collective this thread issues inside the scope (no-op unless on)."""
        if self._audit is None:
            yield
            return
        roles: Any = self._groups.registry or self._groups.role_groups
        with self._audit.record(roles) as recorder:
            self._recorder = recorder
            yield

    def finish(self) -> list[dict[str, Any]]:
        """Hazards of the whole run as JSON-ready dicts, on rank 0 (others: []). Collective.

        Every rank's records travel to rank 0 over the exchange group (the checkpoint-metadata gloo
        group with the registry), outside the recording, so the exchange itself is not audited.
        """
        if self._audit is None or self._recorder is None:
            return []
        data = self._recorder.to_dict()
        rank = dist.get_rank()
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(data, gathered, dst=0, group=self._groups.exchange_group)
        if gathered is None:
            return []
        report = self._audit.merge(gathered)
        self.summary = report.summary
        self.report_text = report.render()
        return [hazard.to_dict() for hazard in report.hazards]


def start_audit(enabled: bool, groups: JobGroups) -> DemoAudit:
    """A :class:`DemoAudit` for this run; ``enabled=False`` gives one whose status is ``off``."""
    if not enabled:
        return DemoAudit("off", groups)
    try:
        # audit.record's half (the recorder) loads on first use: load it here, where a failure
        # can still turn into "unavailable" instead of stopping the run
        from commgroups import audit
        from commgroups.audit import recorder  # noqa: F401
    except ImportError as error:
        logger.info("audit unavailable: %s", error)
        return DemoAudit(f"unavailable: {error}", groups)
    return DemoAudit("on", groups, audit)
