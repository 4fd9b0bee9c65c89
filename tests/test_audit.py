"""The audit: records every collective (our wrapper, FSDP2, DCP, spmd_types) and names the hazards.

One real 4-rank gloo world runs three scenarios, each writing per-rank files the parent merges:
the seed's layout built the plain DeviceMesh way (flagged), the same layout through a registry
(clean), and ranks that recorded different sequences (flagged).

Its tests that start processes are in ``tests/test_audit_world.py`` (marked ``world``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import commgroups as cg

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

SEED = str(LAYOUTS / "seed_cp4.toml")


# ------------------------------------------------------------------------ the recorder alone
def test_from_env_unset_records_nothing(tmp_path: Path) -> None:
    with cg.audit.from_env(environ={}) as rec:
        assert rec is None
    assert list(tmp_path.iterdir()) == []


def test_bad_roles_are_named() -> None:
    with pytest.raises(TypeError, match="not a ProcessGroup"), cg.audit.record({"cp": 3}):
        pass
    with pytest.raises(TypeError, match="GroupRegistry or a mapping"), cg.audit.record(42):
        pass
    registry = cg.GroupRegistry(cg.load_layout(SEED))
    with pytest.raises(ValueError, match=r"registry.create\(\)"), cg.audit.record(registry):
        pass
