"""Audit: record every collective on this rank and name the hazards.

    import commgroups as cg
    with cg.audit.record(registry) as rec:        # or a mapping role -> ProcessGroup
        train_step()
    for hazard in rec.hazards():
        print(hazard.kind, hazard.message)

For whole runs: wrap the loop in ``with cg.audit.from_env(registry):`` and launch with
``COMMGROUPS_AUDIT_DIR=/path``; each rank writes one JSON file there, and ``commgroups audit /path``
(or :func:`merge_dir`) merges them and adds the cross-rank sequence check.

Two halves, and only the first imports torch:

- :mod:`~commgroups.audit.recorder` observes live collectives (:func:`record`, :func:`from_env`,
  :class:`Recorder`); what it sees and misses is documented there. It uses
  :mod:`~commgroups.util.call_sites` to name the frame that issued each call.
- The analysis reads only the recordings: :mod:`~commgroups.audit.records` (the schema),
  :mod:`~commgroups.audit.hazards` (the rules), :mod:`~commgroups.audit.merge` (per-rank files into
  one :class:`AuditReport`, :mod:`~commgroups.audit.report`). None of it imports torch, so it runs
  wherever the files are; the recorder's names here load on first use, so importing this package
  for the analysis imports no torch either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from commgroups.audit.hazards import Hazard, find_hazards
from commgroups.audit.merge import AuditFileError, load_dir, merge, merge_dir
from commgroups.audit.records import AUDIT_DIR_ENV, CollectiveRecord, rank_file_name
from commgroups.audit.report import AuditReport

if TYPE_CHECKING:
    from commgroups.audit.recorder import Recorder, from_env, record

__all__ = [
    "AUDIT_DIR_ENV",
    "AuditFileError",
    "AuditReport",
    "CollectiveRecord",
    "Hazard",
    "Recorder",
    "find_hazards",
    "from_env",
    "load_dir",
    "merge",
    "merge_dir",
    "rank_file_name",
    "record",
]

# Names of the torch half, imported when first asked for (PEP 562).
_RECORDER_NAMES = frozenset({"Recorder", "from_env", "record"})


def __getattr__(name: str) -> Any:
    """``Recorder``, ``record`` and ``from_env``, importing the recorder (and torch) on first use."""
    if name in _RECORDER_NAMES:
        return getattr(importlib.import_module("commgroups.audit.recorder"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The package's names, the lazily imported ones included."""
    return sorted(set(globals()) | _RECORDER_NAMES)
