"""registry.collectives(role): every method matches the raw torch.distributed call (real gloo, 4 ranks),
and every call it makes reaches c10d as async_op=True (unless the role turns async_and_wait off).

Its tests that start processes are in ``tests/test_role_collectives_world.py`` (marked ``world``).
"""

from __future__ import annotations

import pytest

import commgroups as cg


def test_needs_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"registry.group\('cp'\)"):
        cg.RoleCollectives(None, role="cp", async_and_wait=True)  # type: ignore[arg-type]
