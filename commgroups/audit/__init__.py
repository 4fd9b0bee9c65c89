"""Audit: record every collective on this rank and name the hazards.

    import commgroups as cg
    with cg.audit.record(registry) as rec:        # or a mapping role -> ProcessGroup
        train_step()
    for hazard in rec.hazards():
        print(hazard.kind, hazard.message)

For whole runs: wrap the loop in ``with cg.audit.from_env(registry):`` and launch with
``COMMGROUPS_AUDIT_DIR=/path``; each rank writes one JSON file there, and ``commgroups audit /path``
(or :func:`merge_dir`) merges them and adds the cross-rank sequence check. What is observed and what
is missed is documented in :mod:`commgroups.audit._recorder`; the hazards in
:mod:`commgroups.audit._analysis`.
"""

from commgroups.audit._analysis import (
    AuditFileError,
    AuditReport,
    Hazard,
    find_hazards,
    load_dir,
    merge,
    merge_dir,
)
from commgroups.audit._recorder import (
    AUDIT_DIR_ENV,
    CollectiveRecord,
    Recorder,
    from_env,
    rank_file_name,
    record,
)

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
