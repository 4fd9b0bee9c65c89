"""The wheel installs backends/ as commgroups.backends and never as a bare top-level package.

Its tests that start processes are in ``tests/test_packaging_world.py`` (marked ``world``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The wheel's contents: CI runs it on the main torch leg only.
pytestmark = pytest.mark.version_independent


def test_backends_import_under_commgroups() -> None:
    import commgroups.backends as backends

    assert Path(backends.__file__).parent.name == "backends"
    assert backends.resolve_backend("gloo").name == "gloo"
    assert backends.resolve_backend("device", "fake").name == "fake"
    assert "backends" not in sys.modules  # no bare top-level package was imported
